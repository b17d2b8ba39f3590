"""The record schema: for each record kind, the fields its `params` and `results` may carry, with their types,
declared once; the writers' records are checked against it (`records.store.append`, `load`) and the report reads
fields through its `Field` objects (`BENCH.results.tok_s.get(record)`), never through free strings.

A record says which rules it was written under (`schema`):

- 1: every record written before this module. Checked as it always was (`V1_SHAPES`): the shape of each field the
  report reads, where present; any other field is let through. Records on disk are never rewritten, so these rules
  are frozen.
- 2 (`VERSION`, what `make_record` writes): every field of git, machine, params and results is declared here.

Strictness of version 2, so that the writers' real outputs pass and a typo is caught:

- An object declared with fields (`Obj`) is closed: a key it does not declare is refused, with the closest
  declared name offered (`results.tok_ss`: did you mean results.tok_s?). The objects whose keys are data, not
  names (a launch config, the shares by kernel category, the nightly's steps by name, the model config), are
  declared as maps (`MapOf`) of a value type.
- null stands for missing wherever a declared field stands: the report reads absent and null alike, and
  `make_record` writes a non-finite number as null (and makes the record INVALID). An element of an array or a
  value of a map may be null only where its type says so (`NUMBER_OR_NULL`, `JSON`): the report iterates those.
- A VALID record must carry (present and not null) the few fields its kind lists in `valid_needs`: the ones the
  report keys it by or draws. An INVALID record may stop anywhere: a run that failed half way keeps what it has.
- An integer is `INT`; `NUMBER` takes integers and floats (finite as floats); a boolean is neither.

Adding a field: declare it in its kind's `Obj` below (a type from this module), in the same change as the writer
that writes it; records already written stay valid, so the version stays. A change that would refuse a record
already written (a type narrowed, a field removed or renamed, a field made required) bumps VERSION and keeps the
previous version's rules for the records written under it, as V1_SHAPES does for version 1 (docs/RECORDS.md).
"""
from __future__ import annotations

import difflib
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable

VERSION = 2
VERSIONS = (1, 2)  # the versions a record on disk may carry


# ---- values in messages ----------------------------------------------------------------------------

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 4, 4


def brief(x) -> str:
    """`x` for an error message: its JSON type and a cut repr, so that a hostile value cannot flood the message."""
    if x is None:
        return "null"
    kind = {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(x), type(x).__name__)
    try:
        text = _REPR.repr(x)
    except ValueError:  # an integer past Python's digit limit for str()
        text = "(too many digits to show)"
    return f"{kind} {text}"


def cut(where: str, chars: int = 80) -> str:
    """A field's dotted path for a message, on one line and cut: the keys along it come from the record and may be
    of any length or hold any character (a newline, a lone surrogate), which are shown escaped."""
    if not where.isprintable():
        where = "".join(c if c.isprintable() else repr(c)[1:-1] for c in where)
    return where if len(where) <= chars else where[:chars - 1] + "…"


def is_number(x) -> bool:
    """A JSON number that is finite as a float (an integer of 400 digits is not: it cannot be formatted or drawn)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def is_scalar(x) -> bool:
    return x is None or isinstance(x, (bool, str)) or is_number(x)


def is_erratum_field(x) -> bool:
    """A field an erratum may void: `verdict`, `reasons`, or a field inside git, machine, params or results (the
    report indexes every top-level field, so voiding one whole would take it down)."""
    parts = x.split(".") if isinstance(x, str) else []
    return x in ("verdict", "reasons") or (
        len(parts) >= 2 and parts[0] in ("git", "machine", "params", "results") and all(parts))


# ---- types -------------------------------------------------------------------------------------------

class Type:
    """A declared type: `check` appends to `out` one line per value that is not of it, naming where."""
    expected: str
    null: bool = False  # whether null is a value of this type as an element of an array or a value of a map

    def check(self, value, where: str, out: list[str]) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Leaf(Type):
    expected: str
    ok: Callable[[Any], bool]
    null: bool = False

    def check(self, value, where, out):
        if value is None and self.null:
            return
        if not self.ok(value):
            out.append(f"{cut(where)} must be {self.expected}, got {brief(value)}")


@dataclass(frozen=True)
class ListOf(Type):
    item: Type
    expected: str = "an array"

    def check(self, value, where, out):
        if not isinstance(value, list):
            out.append(f"{cut(where)} must be {self.expected}, got {brief(value)}")
            return
        for i, x in enumerate(value):
            self.item.check(x, f"{where}[{i}]", out)


@dataclass(frozen=True)
class Obj(Type):
    """An object: `fields` by name (each may be absent or null), and `extra`, the type of the value of any other
    key, None where other keys are refused."""
    fields: dict[str, Type] = field(default_factory=dict)
    extra: Type | None = None
    expected: str = "an object"

    def check(self, value, where, out):
        if not isinstance(value, dict):
            out.append(f"{cut(where)} must be {self.expected}, got {brief(value)}")
            return
        for k, v in value.items():
            at = f"{where}.{k}" if where else k
            t = self.fields.get(k)
            if t is not None:
                if v is not None:
                    t.check(v, at, out)
            elif self.extra is not None:
                self.extra.check(v, at, out)
            else:
                out.append(self.undeclared(k, where, v))

    def undeclared(self, key: str, where: str, value) -> str:
        near = difflib.get_close_matches(key, self.fields, n=1)
        hint = f" (did you mean {f'{where}.{near[0]}' if where else near[0]}?)" if near else ""
        return (f"{cut(f'{where}.{key}' if where else key)} is not a declared field (expected a field that "
                f"records/schema.py declares in {where or 'it'}{hint}), got {brief(value)}")


def MapOf(value: Type) -> Obj:
    """An object whose keys are data (a config, categories, step names), each value of type `value`."""
    return Obj({}, extra=value)


NUMBER = Leaf("a finite number", is_number)
NUMBER_OR_NULL = Leaf("a finite number or null", is_number, null=True)  # an element make_record may have nulled
INT = Leaf("an integer", lambda x: type(x) is int and is_number(x))
BOOL = Leaf("a boolean", lambda x: type(x) is bool)
TEXT = Leaf("a string", lambda x: isinstance(x, str))
SCALAR_OR_NULL = Leaf("a string, number, boolean or null", is_scalar, null=True)
JSON = Leaf("any JSON value", lambda x: True, null=True)  # free form: a config, the launch config changes
ERRATUM_FIELD = Leaf("'verdict', 'reasons' or a dotted field inside git, machine, params or results",
                     is_erratum_field)
NUMBERS = ListOf(NUMBER_OR_NULL)
TEXTS = ListOf(TEXT)


def obj(**fields: Type) -> Obj:
    return Obj(fields)


# ---- reading a field through the schema --------------------------------------------------------------

_MISSING = object()


@dataclass(frozen=True, eq=False)
class Field:
    """A declared field, by its dotted path from the object it is read from (a record; an element of an array, for
    the fields under `.each`), with its type. `.get(x)` reads it; a declared field below it is an attribute
    (`BENCH.results.clocks.sm_mhz_mean`), an element of an array or a value of a map is `.each`."""
    path: str
    type: Type
    owner: str = "record"  # for messages: the kind, or the object the path starts from

    def __getattr__(self, name: str) -> Field:
        if name.startswith("_"):
            raise AttributeError(name)
        t = self.type
        if isinstance(t, Obj) and name in t.fields:
            return Field(f"{self.path}.{name}" if self.path else name, t.fields[name], self.owner)
        here = f"{self.owner} {self.path}" if self.path else self.owner
        why = ("is an array: read its elements through .each" if isinstance(t, ListOf) else
               "is a map: read its values through .each" if isinstance(t, Obj) and t.extra is not None else
               f"declares no field {name!r} (records/schema.py)" if isinstance(t, Obj) else "is not an object")
        raise AttributeError(f"{here} {why}")

    def field(self, name: str) -> Field:
        """The declared field `name` below this one, where the name is made at run time (`f"{side}_ms"`)."""
        return getattr(self, name)

    @property
    def each(self) -> Field:
        """An element of this array, or a value of this map, as the object its fields are read from."""
        t = self.type
        inner = t.item if isinstance(t, ListOf) else t.extra if isinstance(t, Obj) else None
        if inner is None:
            raise AttributeError(f"{self.owner} {self.path} is neither an array nor a map")
        return Field("", inner, f"{self.owner} {self.path}")

    def _walk(self, x):
        for part in self.path.split(".") if self.path else ():
            if not isinstance(x, dict) or part not in x:
                return _MISSING
            x = x[part]
        return x

    def get(self, x, default=None):
        """The field's value in `x`, or `default` where any part of its path is missing or null."""
        value = self._walk(x)
        return default if value is _MISSING or value is None else value

    def lookup(self, x):
        """The field's value in `x`, null included; KeyError where a part of its path is absent."""
        value = self._walk(x)
        if value is _MISSING:
            raise KeyError(self.path)
        return value

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"Field({self.path!r})"


# ---- what every record carries ----------------------------------------------------------------------

GIT = obj(commit=TEXT, dirty=BOOL,
          commit_source=TEXT,  # where the commit came from when git could not tell (KIMI_GIT_COMMIT)
          tree_commit=TEXT, tree_dirty=BOOL,  # the commit whose tree was sent to a box without usable git
          device_reported=obj(commit=TEXT, dirty=BOOL),  # records.import_run: the box's own view, kept
          note=TEXT)  # records.import_run: which run the records came from
MACHINE = obj(host=TEXT, gpu=TEXT, driver=TEXT, cuda=TEXT, torch=TEXT, triton=TEXT, transformers=TEXT, python=TEXT,
              cpu=TEXT)

# The GPU's clocks over a timed run (benchmarks.gpu_clocks.summarize_clocks; bench_ab averages them per call)
CLOCKS_T = obj(samples=INT, sm_mhz_mean=NUMBER, sm_mhz_min=NUMBER, sm_mhz_max=NUMBER, power_w_mean=NUMBER,
               power_w_max=NUMBER, power_limit_w=NUMBER, power_cap_share=NUMBER, hw_slowdown_share=NUMBER,
               thermal_share=NUMBER, sampler=TEXT, energy_j=NUMBER, energy_j_per_call=NUMBER, power_capped_s=NUMBER,
               power_capped_time_share=NUMBER)

# ---- the gates: gate_a, gate_b, memory (gates/run.py `record`: the options, then the gate's own) ----------

GATE_OPTIONS = dict(preset=TEXT, model=TEXT, dtype=TEXT, device=TEXT, new_tokens=INT, floor_gib=NUMBER, source=TEXT,
                    golden=TEXT, seed=INT, kernels=TEXT, expert_dtype=TEXT,
                    cfg=MapOf(JSON),  # benchmarks.detection --slice: the config of a model that is no preset
                    # a run over several ranks (gates/run.py Options, `record`): how many, the routed experts each
                    # holds, why the default world was chosen; on CUDA each rank's GPU and the links between them
                    # as NVML reports them (gates.memory.gpu_links)
                    world=INT, experts_per_rank=INT, world_choice=TEXT,
                    gpus=ListOf(obj(rank=INT, cuda=INT, nvml_index=INT, name=TEXT, nvlinks=INT)),
                    links=ListOf(obj(ranks=ListOf(INT), link=TEXT)))
# the floor guard's fields (gates/run.py Guard.results)
GUARD = dict(projected_bytes=INT, floor_bytes=INT, free_before_bytes=INT, min_free_bytes=INT, floor_decision=TEXT)
# gates/compare.py: a divergence (Divergence.to_dict), the noise control (NoiseCheck), the per-prompt results
SIDE_T = obj(name=TEXT, token=INT, topk_ids=ListOf(INT), topk_logprobs=NUMBERS,
             top_logit=NUMBER)  # the chosen token's logit, where the side kept it (the near-tie eps follows it)
MARGIN_T = obj(nats=NUMBER, lower_bound=BOOL)
DIAGNOSIS_T = obj(prompt=INT, step=INT, ref=SIDE_T, test=SIDE_T, ref_margin=MARGIN_T, test_margin=MARGIN_T,
                  in_each_others_top=BOOL, eps=NUMBER, verdict=TEXT, explanation=TEXT)
NOISE_T = obj(control=TEXT, control_first_divergence=INT, test_noise=NUMBER, control_noise=NUMBER, within_noise=BOOL)
PROMPT_T = obj(prompt=INT, k=INT, n=INT, first_divergence=INT, verdict=TEXT, noise=NOISE_T, failed=TEXT,
               logit_excess=obj(step=INT, max_abs_logit_diff=NUMBER))
LOGIT_BOUND_T = obj(control=TEXT, floor=NUMBER, floor_at=ListOf(INT), resolution=NUMBER, factor=NUMBER,
                    enforced=BOOL, bound=NUMBER, derivation=TEXT)
GATE_RESULTS = dict(score=INT, total=INT, passed=BOOL, tokens_passed=BOOL, logits_passed=BOOL,
                    logit_bound=LOGIT_BOUND_T, per_prompt=ListOf(PROMPT_T), diagnoses=ListOf(DIAGNOSIS_T),
                    near_tie_eps=NUMBER, refused=TEXT, **GUARD)

GATE_A_PARAMS = Obj(dict(GATE_OPTIONS, prompt_ids_source=TEXT, prompts=INT, weights_source=TEXT, decode=TEXT))
GATE_A_RESULTS = Obj(dict(
    GATE_RESULTS, max_abs_logit_diff=ListOf(NUMBERS), max_abs_logit_diff_overall=NUMBER,
    timings=obj(load_s=NUMBER, recompute_s=NUMBER, incremental_s=NUMBER, control_s=NUMBER, logit_floor_s=NUMBER,
                total_s=NUMBER)))
GATE_B_PARAMS = Obj(dict(GATE_OPTIONS, prompt_ids_source=TEXT, prompts=INT, weights_source=TEXT, golden_path=TEXT,
                         golden_source=TEXT, golden_dtype=TEXT, golden_device=TEXT, golden_implementation=TEXT))
GATE_B_RESULTS = Obj(dict(GATE_RESULTS, md5=TEXT, golden_md5=TEXT,
                          timings=obj(load_s=NUMBER, generate_s=NUMBER, total_s=NUMBER)))
MEMORY_PARAMS = Obj(dict(GATE_OPTIONS, prompt_ids_source=TEXT, context=INT))
AUDIT_T = obj(ok=BOOL, ratio=NUMBER, message=TEXT)
# over several ranks, each rank's own figures (gates/gate_memory.py); the fields above are the worst rank's
MEMORY_RANK_T = obj(rank=INT, free_before_bytes=INT, min_free_bytes=INT, measured_peak_bytes=INT,
                    nvml_used_delta_bytes=INT, torch_max_allocated_bytes=INT, samples=INT, audit=AUDIT_T)
MEMORY_RESULTS = Obj(dict(
    GUARD, decision=TEXT,  # 'ran' | 'refused' | 'tripped' | 'skipped'
    passed=BOOL, projection=TEXT, measured_peak_bytes=INT, nvml_used_delta_bytes=INT, torch_max_allocated_bytes=INT,
    samples=INT, run_s=NUMBER, audit=AUDIT_T, ranks=ListOf(MEMORY_RANK_T)))

# ---- bench: benchmarks/bench_e2e.py, one record per configuration and peer ---------------------------------

BENCH_PARAMS = obj(phase=TEXT, context=INT, batch=INT, decode_tokens=INT, impl=TEXT, peer=TEXT, run=TEXT,
                   prefill_chunk=INT, reps=INT, peer_reps=INT, peer_decode_tokens=INT,
                   # the ranks the routed experts were split over (benchmarks/ranks.py), the experts each held and,
                   # on CUDA, each rank's GPU and the links between them, as the gates record them
                   world=INT, experts_per_rank=INT, gpus=GATE_OPTIONS["gpus"], links=GATE_OPTIONS["links"])
SPOT_CHECK_T = obj(agree=INT, total=INT, prompt_len=INT, verdict=TEXT, first_divergence=INT, explanation=TEXT,
                   error=TEXT)
# ours and the peer: the same measurements, the peer's under `peer_`
_SIDE = dict(samples_ms=NUMBERS, median_ms=NUMBER, host_ms=NUMBERS, host_paced=INT, clocks=CLOCKS_T,
             joules_per_token=NUMBER)
BENCH_RESULTS = Obj(dict(
    tok_s=NUMBER, peer=TEXT, peer_tok_s=NUMBER, speedup_vs_peer=NUMBER, roofline_tok_s=NUMBER,
    roofline_fraction=NUMBER, roofline_note=TEXT, hbm_gbps=NUMBER, matmul_tflops=NUMBER, host_launch_us=NUMBER,
    host_kernel_launch_us=NUMBER, bytes_per_token=NUMBER, flops_per_token=NUMBER, p10_ms=NUMBER, p90_ms=NUMBER,
    prefill_s=NUMBER, peak_gib=NUMBER, peer_prefill_ms=NUMBER, peer_kernels=MapOf(TEXT), spot_check=SPOT_CHECK_T,
    # over several ranks: each rank's ceilings and work per token, how the roofline was derived from them, and the
    # all_reduce's share of the decode step from an A/B in the same run (benchmarks/ranks.py)
    rank_hbm_gbps=NUMBERS, rank_matmul_tflops=NUMBERS, rank_bytes_per_token=NUMBERS, rank_flops_per_token=NUMBERS,
    roofline_derivation=TEXT, collective_share=NUMBER, collective_ms=NUMBER, no_collective_median_ms=NUMBER,
    rank_no_collective_median_ms=NUMBERS, collective_ab=TEXT,
    **_SIDE, **{f"peer_{k}": t for k, t in _SIDE.items()}))

# ---- kernel: benchmarks/kernels, bench_ab, bench_energy -----------------------------------------------------

KERNEL_PARAMS = obj(
    op=TEXT, kernel=TEXT,  # `kernel` alone names the op in older records; the part of moe_decode it times
    dtype=TEXT, sweep=BOOL, cfg=MapOf(JSON),
    B=INT, T=INT, H=INT, d=INT, D=INT, E=INT, I=INT, K=INT, M=INT, N=INT, O=INT,  # shapes
    shape=TEXT, heads=INT, split=INT, peer_split=INT, short=MapOf(JSON), step=INT, warps=INT, shared_experts=INT,
    router=TEXT, prec=TEXT, prep=TEXT, replicas=INT, ours_scope=TEXT, peer_scope=TEXT,
    # bench_ab and bench_energy: the arm, and the model it ran in
    variant=TEXT, module=TEXT, changes=MapOf(JSON), rounds=INT, round=INT, preset=TEXT, model_dtype=TEXT,
    weights=TEXT)
ENERGY_RUN_T = obj(calls=INT, seconds=NUMBER, joules=NUMBER, ms=NUMBER, j_per_token=NUMBER, watts=NUMBER)
SWEEP_ENTRY_T = obj(kernel=TEXT, cfg=MapOf(JSON), ms=NUMBER, rel_err_vs_peer=NUMBER, bits_differing=INT, error=TEXT)
KERNEL_RESULTS = Obj(dict(
    {f"{side}_{k}": t for side in ("ours", "peer") for k, t in dict(
        ms=NUMBER, eager_ms=NUMBER, graph_ms=NUMBER, kernel_ms=NUMBER, kernel_us=MapOf(NUMBER_OR_NULL), gbps=NUMBER,
        frac_of_nominal=NUMBER, frac_of_measured=NUMBER, after_proj_ms=NUMBER, tile_rows_wasted=INT,
        j_per_token=NUMBER, watts=NUMBER, run=ENERGY_RUN_T, host_ms=NUMBERS, host_paced=INT).items()},
    peer=TEXT, peer_version=TEXT, peer_cfg=MapOf(JSON), peer_graph_error=TEXT, peer_kernel_error=TEXT,
    peer_samples_ms=NUMBERS, peer_gate_up_ms=NUMBER, peer_down_ms=NUMBER, ours_plain_after_proj_ms=NUMBER,
    samples_ms=NUMBERS, host_ms=NUMBERS, host_paced=INT, clocks_ours=CLOCKS_T, clocks_peer=CLOCKS_T,
    speedup=NUMBER, timing=TEXT, timing_graph=TEXT, timing_kernel=TEXT, timing_after_proj=TEXT, proj_ms=NUMBER,
    cfg=MapOf(JSON), sweep=ListOf(SWEEP_ENTRY_T),
    rel_err_vs_peer=NUMBER, rel_err_vs_default=NUMBER, rel_err_vs_fp32_ref=NUMBER, rel_err_vs_fp64=NUMBER,
    rel_err_vs_per_expert_mm=NUMBER, state_rel_err_vs_peer=NUMBER, bits_differing=INT, bits_equal=BOOL,
    same_argmax=BOOL, same_bits=BOOL, finite=BOOL, paired_ratio_median=NUMBER, paired_ratio_min=NUMBER,
    paired_ratio_max=NUMBER, gbps=NUMBER, bytes=INT, measured_read_gbps=NUMBER, routing_mismatch_tokens=INT,
    router=TEXT, rows_per_expert_sd=NUMBER, rows_per_expert_min=INT, rows_per_expert_max=INT,
    mean_rows_per_expert=NUMBER, groups=INT, model_replicas=INT, tflops_ours=NUMBER, tflops_peer=NUMBER,
    energy_ratio=NUMBER, idle_watts_before_ours=NUMBER, idle_watts_before_peer=NUMBER))

# ---- decomposition: benchmarks/decompose.py, one record per mode ---------------------------------------------

DECOMPOSITION_PARAMS = obj(phase=TEXT, mode=TEXT, steps=INT, context=INT, batch=INT, device=TEXT, run=TEXT,
                           variant=obj(name=TEXT, module=TEXT, changes=MapOf(JSON)))
TOP_KERNEL_T = obj(name=TEXT, category=TEXT, us_per_step=NUMBER, exclusive_us_per_step=NUMBER,
                   calls_per_step=NUMBER, share=NUMBER)
DECOMPOSITION_RESULTS = obj(
    kernels_per_step=NUMBER, shares=MapOf(NUMBER_OR_NULL), exclusive_shares=MapOf(NUMBER_OR_NULL),
    idle_fraction=NUMBER, step_ms=NUMBER, kernel_us=NUMBER, busy_us=NUMBER, wall_us=NUMBER, n_kernels=INT,
    top_kernels=ListOf(TOP_KERNEL_T), step_ms_unprofiled=NUMBER, trace=TEXT, trace_bytes=INT, events=TEXT)

# ---- detection: benchmarks/detection.py, one Gate A run with an error planted (or none) --------------------

DETECTION_PARAMS = obj(site=TEXT, rel=NUMBER, kernels=TEXT, precision=TEXT, new_tokens=INT,
                       model=obj(label=TEXT, config=MapOf(JSON), weights=TEXT))
DETECTION_RESULTS = obj(exit_code=INT, passed=BOOL, tokens_passed=BOOL, logits_passed=BOOL, score=INT, total=INT,
                        max_abs_logit_diff=NUMBER, bound=NUMBER, floor=NUMBER, enforced=BOOL, summary=TEXT,
                        seconds=NUMBER)

# ---- routing_noise: benchmarks/routing_noise.py, how much of a narrow dtype's logit noise the flipped expert
# choices make ----------------------------------------------------------------------------------------------------

ROUTING_NOISE_PARAMS = obj(model=TEXT, preset=TEXT, new_tokens=INT, prompts=INT, prompt_ids_source=TEXT,
                           reference_dtype=TEXT, kernels=TEXT)
_ROUTING_MEASURES = dict(max_abs_logit_diff_free=NUMBER, max_abs_logit_diff_pin=NUMBER,
                         max_margin_change_free=NUMBER, max_margin_change_pin=NUMBER, agree_free=INT, agree_pin=INT)
ROUTING_NOISE_RESULTS = obj(
    prompts=ListOf(obj(steps=INT, decisions=INT, flips=INT, **_ROUTING_MEASURES)),
    steps=INT, decisions=INT, flips=INT, flip_fraction=NUMBER, **_ROUTING_MEASURES,
    gap_quantiles=MapOf(NUMBER), gap_threshold=NUMBER, frac_gap_below=NUMBER)

# ---- nightly: reports/nightly.py; erratum: a later record voiding fields of an earlier one ------------------

NIGHTLY_PARAMS = obj(steps=TEXTS, step_timeout_s=NUMBER, logs=TEXT)
STEP_T = obj(returncode=INT, seconds=NUMBER, gate=BOOL, timed_out=BOOL, skipped=BOOL,
             tail=TEXT)  # tail: a failed step's last lines
REGRESSION_T = obj(key=ListOf(SCALAR_OR_NULL), verdict=TEXT, ratio=NUMBER, p_value=NUMBER, record=TEXT, message=TEXT)
NIGHTLY_RESULTS = obj(passed=BOOL, steps=MapOf(STEP_T), regressions=ListOf(REGRESSION_T))
ERRATUM_PARAMS = obj(record=TEXT, fields=ListOf(ERRATUM_FIELD))
ERRATUM_RESULTS = obj(reason=TEXT)

# ---- train: model/train.py, one record per training run of the reference checkpoint --------------------------

SPLIT_T = obj(files=INT, bytes=INT)
TRAIN_PARAMS = obj(
    label=TEXT, checkpoint=TEXT, command=TEXT,  # the checkpoint folder's name and path, the command that trained it
    corpus=obj(source=TEXT, python=TEXT, sha256=TEXT, train=SPLIT_T, heldout=SPLIT_T, heldout_rule=TEXT,
               max_bytes=INT, skipped_not_utf8=INT),
    tokenizer=obj(sha256=TEXT, library=TEXT, kind=TEXT, base_tokens=INT, specials=INT, vocab=INT, train_tokens=INT,
                  heldout_tokens=INT),
    model=obj(parameters=INT, checkpoint_bytes=INT, layers=TEXT, size=MapOf(JSON)),  # layers: K KDA, M MLA
    steps=INT, seed=INT, batch=INT, seq_len=INT, lr=NUMBER, warmup=INT, weight_decay=NUMBER, clip=NUMBER,
    bias_rate=NUMBER, eval_every=INT, eval_windows=INT, time_limit=NUMBER,
    device_name=TEXT, precision=TEXT, kernels=TEXT, torch=TEXT, python=TEXT,
    source=TEXT)  # where the record was made from: the run itself, or the folder's provenance.json (--record-from)
TRAIN_RESULTS = obj(
    curve=ListOf(obj(step=INT, loss=NUMBER)),  # the training loss at every step
    evals=ListOf(obj(step=INT, heldout_loss=NUMBER, heldout_bpb=NUMBER)),  # held-out windows during training
    # the checkpoint as written, over every held-out window
    heldout_loss=NUMBER, heldout_bpb=NUMBER, heldout_tokens=INT, heldout_bytes=INT, heldout_of=TEXT,
    final_train_loss=NUMBER, train_loss_over=TEXT,
    expert_load_max=NUMBERS, expert_unused=ListOf(INT),  # per MoE layer: the busiest expert's share of an even one
    train_s=NUMBER, total_s=NUMBER)

# ---- margins: gates/margins.py, one record per golden: its greedy margins on the battery ---------------------

MARGINS_PARAMS = obj(golden=TEXT, golden_md5=TEXT, label=TEXT, source=TEXT, implementation=TEXT, golden_dtype=TEXT,
                     golden_device=TEXT, device_name=TEXT, golden_time=TEXT, golden_commit=TEXT,
                     prompt_ids_source=TEXT, prompts=INT, new_tokens=INT, topk=INT)
MARGINS_RESULTS = obj(
    margins=ListOf(NUMBERS),  # [prompt][step]: top-1 minus top-2 log-probability, nats
    n=INT, median=NUMBER, min=NUMBER, max=NUMBER, zeros=INT,
    bf16_eps=NUMBER, frac_below_bf16_eps=NUMBER,  # gates.compare.NEAR_TIE_EPS in bf16 and in fp32 (and fp64)
    fp32_eps=NUMBER, frac_below_fp32_eps=NUMBER)


# ---- the kinds ---------------------------------------------------------------------------------------------

_FIELD_ATTRIBUTES = frozenset(a for a in dir(Field) if not a.startswith("_")) | {"path", "type", "owner"}


def _names(t: Type, where: str) -> list[str]:
    """Declared names below `t` that a Field could not reach as attributes (its own attributes), with where."""
    if isinstance(t, ListOf):
        return _names(t.item, where + "[]")
    if not isinstance(t, Obj):
        return []
    out = [f"{where}.{k}" for k in t.fields if k in _FIELD_ATTRIBUTES]
    for k, sub in t.fields.items():
        out += _names(sub, f"{where}.{k}")
    return out + (_names(t.extra, where + ".*") if t.extra is not None else [])


@dataclass(frozen=True, eq=False)
class Kind:
    """One record kind: its params and results (Fields over their Obj), and what a VALID record of it carries."""
    name: str
    params: Field
    results: Field
    valid_needs: tuple[Field, ...] = ()

    def problems(self, rec: dict) -> list[str]:
        """What is wrong with the params and results of `rec` (a record of this kind), each line naming the kind."""
        out: list[str] = []
        for f in (self.params, self.results):
            if isinstance(rec.get(f.path), dict):
                f.type.check(rec[f.path], f.path, out)
        out = [f"{self.name} {p}" for p in out]
        lacking = [f.path for f in self.valid_needs if f.get(rec) is None]
        if lacking and rec.get("verdict") == "VALID":
            out.append(f"{self.name} record is VALID without {', '.join(lacking)}: expected a VALID {self.name} "
                       f"record to carry {'them' if len(lacking) > 1 else 'it'} (a run that could not measure "
                       f"{'them' if len(lacking) > 1 else 'it'} is INVALID), got null or nothing")
        return out


def kind(name: str, params: Obj, results: Obj, needs: tuple[str, ...] = ()) -> Kind:
    clash = _names(params, "params") + _names(results, "results")
    if clash:
        raise TypeError(f"{name}: fields named like a Field's own attributes cannot be read as attributes: {clash}")
    top = {"params": Field("params", params, name), "results": Field("results", results, name)}

    def resolve(path: str) -> Field:
        section, *rest = path.split(".")
        f = top[section]
        for part in rest:
            f = getattr(f, part)
        return f
    return Kind(name, top["params"], top["results"], tuple(resolve(p) for p in needs))


GATE_A = kind("gate_a", GATE_A_PARAMS, GATE_A_RESULTS, ("results.score", "results.total", "results.passed"))
GATE_B = kind("gate_b", GATE_B_PARAMS, GATE_B_RESULTS, ("results.score", "results.total", "results.passed"))
MEMORY = kind("memory", MEMORY_PARAMS, MEMORY_RESULTS, ("results.decision",))
BENCH = kind("bench", BENCH_PARAMS, BENCH_RESULTS, ("params.phase", "params.context", "results.tok_s"))
KERNEL = kind("kernel", KERNEL_PARAMS, KERNEL_RESULTS, ("results.ours_ms",))
DECOMPOSITION = kind("decomposition", DECOMPOSITION_PARAMS, DECOMPOSITION_RESULTS,
                     ("params.phase", "params.context", "results.shares"))
DETECTION = kind("detection", DETECTION_PARAMS, DETECTION_RESULTS, ("results.passed", "results.score",
                                                                     "results.total"))
NIGHTLY = kind("nightly", NIGHTLY_PARAMS, NIGHTLY_RESULTS, ("results.passed", "results.steps"))
ERRATUM = kind("erratum", ERRATUM_PARAMS, ERRATUM_RESULTS, ("params.record", "params.fields", "results.reason"))
TRAIN = kind("train", TRAIN_PARAMS, TRAIN_RESULTS, ("results.curve", "results.evals", "results.heldout_bpb"))
MARGINS = kind("margins", MARGINS_PARAMS, MARGINS_RESULTS, ("results.margins", "results.median",
                                                            "results.frac_below_bf16_eps"))
ROUTING_NOISE = kind("routing_noise", ROUTING_NOISE_PARAMS, ROUTING_NOISE_RESULTS,
                     ("results.flip_fraction", "results.max_abs_logit_diff_free", "results.max_abs_logit_diff_pin"))
# What gate_a and gate_b records both carry (the gates section reads them alike); not a kind of its own
GATE = Kind("gate", Field("params", Obj(GATE_OPTIONS), "gate"), Field("results", Obj(GATE_RESULTS), "gate"))
KINDS: dict[str, Kind] = {k.name: k for k in (GATE_A, GATE_B, MEMORY, BENCH, KERNEL, DECOMPOSITION, DETECTION,
                                              NIGHTLY, ERRATUM, TRAIN, MARGINS, ROUTING_NOISE)}

# What every record carries beside its kind's params and results; `RECORD.machine.gpu.get(r)`. The store checks
# the top-level fields themselves (records.store.validate_record); git and machine are checked here.
RECORD = Field("", obj(preset=TEXT, dtype=TEXT, device=TEXT, weights=TEXT, verdict=TEXT, git=GIT, machine=MACHINE))

# Objects the report reads from inside a record (an element of an array, a value of a map, a nested object)
CLOCKS = Field("", CLOCKS_T, "clocks")
DIAGNOSIS = GATE_A.results.diagnoses.each
PROMPT = GATE_A.results.per_prompt.each
NOISE = Field("", NOISE_T, "per_prompt[].noise")
SPOT_CHECK = Field("", SPOT_CHECK_T, "spot_check")
STEP = NIGHTLY.results.steps.each
REGRESSION = NIGHTLY.results.regressions.each


def problems(rec: dict) -> list[str]:
    """What is wrong with a version-2 record's git, machine, params and results by its kind's schema (the store
    checks the rest); each line names the kind, the field, what was expected and what was found."""
    k = KINDS.get(rec.get("kind")) if isinstance(rec.get("kind"), str) else None
    if k is None:
        return []  # the store says the kind is unknown
    out: list[str] = []
    for name in ("git", "machine"):
        if isinstance(rec.get(name), dict):
            RECORD.type.fields[name].check(rec[name], name, out)
    return [f"{k.name} {p}" for p in out] + k.problems(rec)


# ---- version 1: the rules the records on disk were written under -------------------------------------------

# (expected, test) of a v1 shape
V1_TEXT = ("a string", lambda x: isinstance(x, str))
V1_NUMBER = ("a finite number", is_number)
V1_NUMBER_OR_NULL = ("a finite number or null", lambda x: x is None or is_number(x))
V1_SCALAR = ("a string, number or boolean (it keys a group of records)", is_scalar)
V1_OBJECT = ("an object", lambda x: isinstance(x, dict))
V1_ARRAY = ("an array", lambda x: isinstance(x, list))
V1_ERRATUM_FIELD = (ERRATUM_FIELD.expected, is_erratum_field)
# Every field the report read when version 1 was current, with the shape it read it as. A field may be absent or
# null; where present it must have this shape. `a[]` is each element of array a and `a.*` each value of object a,
# null included: the shape says whether null is allowed there. Frozen: it decides which lines on disk load.
V1_SHAPES = (
    ("git.commit", V1_TEXT), ("git.tree_commit", V1_TEXT), ("machine.gpu", V1_TEXT), ("machine.host", V1_TEXT),
    *((f"params.{k}", V1_SCALAR) for k in ("phase", "batch", "impl", "peer", "run", "op", "kernel", "mode")),
    ("params.context", V1_NUMBER), ("params.cfg", V1_OBJECT),
    ("params.record", V1_TEXT), ("params.fields", V1_ARRAY), ("params.fields[]", V1_ERRATUM_FIELD),
    ("results.peer", V1_TEXT), ("results.trace", V1_TEXT),
    *((f"results.{k}", V1_NUMBER) for k in (
        "tok_s", "peer_tok_s", "roofline_fraction", "host_launch_us", "host_kernel_launch_us", "hbm_gbps", "score",
        "total", "ours_ms", "peer_ms", "ours_graph_ms", "peer_graph_ms", "ours_kernel_ms", "peer_kernel_ms",
        "measured_peak_bytes", "projected_bytes", "free_before_bytes", "floor_bytes", "min_free_bytes",
        "idle_fraction", "step_ms")),
    *((f"results.{c}{k}", shape) for c in ("clocks", "peer_clocks") for k, shape in (
        ("", V1_OBJECT), (".sm_mhz_mean", V1_NUMBER), (".sm_mhz_max", V1_NUMBER), (".power_cap_share", V1_NUMBER))),
    ("results.spot_check", V1_OBJECT), ("results.audit", V1_OBJECT), ("results.audit.ratio", V1_NUMBER),
    ("results.shares", V1_OBJECT), ("results.shares.*", V1_NUMBER_OR_NULL),
    ("results.exclusive_shares", V1_OBJECT), ("results.exclusive_shares.*", V1_NUMBER_OR_NULL),
    ("results.samples_ms", V1_ARRAY), ("results.samples_ms[]", V1_NUMBER_OR_NULL),
    ("results.diagnoses", V1_ARRAY), ("results.diagnoses[]", V1_OBJECT), ("results.diagnoses[].eps", V1_NUMBER),
    ("results.diagnoses[].ref_margin.nats", V1_NUMBER), ("results.diagnoses[].test_margin.nats", V1_NUMBER),
    ("results.per_prompt", V1_ARRAY), ("results.per_prompt[]", V1_OBJECT), ("results.per_prompt[].noise", V1_OBJECT),
    ("results.per_prompt[].noise.test_noise", V1_NUMBER), ("results.per_prompt[].noise.control_noise", V1_NUMBER),
    ("results.steps", V1_OBJECT), ("results.steps.*", V1_OBJECT), ("results.steps.*.seconds", V1_NUMBER),
    ("results.steps.*.tail", V1_TEXT),
    ("results.regressions", V1_ARRAY), ("results.regressions[]", V1_OBJECT), ("results.regressions[].key", V1_ARRAY),
)


def at(record: dict, path: str) -> list[tuple[str, Any]]:
    """(where, value) for each value at `path` (see V1_SHAPES): a field that is absent or null yields nothing,
    an element of an array or a value of an object (`[]`, `*`) is yielded even when null."""
    found = [("", record)]
    for part in path.split("."):
        each, name = part.endswith("[]"), part.removesuffix("[]")
        step = []
        for where, node in found:
            if not isinstance(node, dict):
                continue
            if name == "*":
                step += [(f"{where}.{k}", v) for k, v in node.items()]
            elif node.get(name) is not None:
                step.append((f"{where}.{name}", node[name]))
        if each:
            step = [(f"{w}[{i}]", v) for w, node in step if isinstance(node, list) for i, v in enumerate(node)]
        found = step
    return [(w.lstrip("."), v) for w, v in found]


def v1_problems(rec: dict) -> list[str]:
    """What is wrong with a version-1 record by the rules it was written under (V1_SHAPES)."""
    return [f"{cut(where)} must be {expected}, got {brief(value)}"
            for path, (expected, ok) in V1_SHAPES for where, value in at(rec, path) if not ok(value)]

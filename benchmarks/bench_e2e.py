"""End-to-end speed: decode and prefill tokens/s against context length, ours vs HF transformers, held against
the rooflines measured in the same run.

    python -m benchmarks.bench_e2e [--preset 48b-a3b] [--contexts 1024,8192,32768,131072]
        [--prefill 1024,8192,32768] [--decode-tokens 64] [--peers hf,hf-fla] [--world N] [--quick]

One process; the synthetic weights are built once on the device and HF's KimiLinearForCausalLM wraps the same
tensors. For each context, cheapest first:
- decode, ours: prefill a random prompt in chunks, then time greedy steps of the CUDA-graph decoder
  (`model.fast.GraphDecoder`; eager `decode_step` where it cannot be used, with the reason recorded), one
  CUDA-event sample per token after warm-up;
- decode, recompute (one context only): a few greedy steps that each re-run the whole sequence;
- prefill, ours: `model.prefill` of the prompt into a fresh cache, median of a few;
- the peers on the same prompt: HF `generate` (its own cache; a logits processor stamps every step, which
  gives the prefill time and the per-token decode times) and an HF forward over the prompt for prefill.
  'hf' = HF with its torch KDA fallback, 'hf-fla' = HF with fla's Triton KDA. HF binds one or the other when
  its module is imported; while 'hf' runs, this script puts the torch functions back in that module's two
  KDA names, so both are measured in one process.
A plan, from the rates of SPEC.md §4 and then from the rates measured so far, skips a peer configuration that
would take more than `--peer-max-s` and anything that would end past `--budget-s`; each skip is recorded with
its reason. An OOM or error in one configuration becomes an INVALID record and the run goes on. One `bench`
record per configuration and peer. Each record also keeps the host probe measured at the start of the run
(`results.host_launch_us`, `benchmarks.roofline.measure_launch_us`) and the host's cost of one launch of our own
Triton kernels through their wrappers (`results.host_kernel_launch_us`, `measure_kernel_launch_us`): HF's eager
decode and an eager prefill of a short prompt are bound by the host's launch path, and move with it from run to run.
`--quick` runs the same code on the tiny preset on a CPU in seconds.

`--world N` splits the routed experts over N ranks that the command starts itself (benchmarks/ranks.py: gloo on a
CPU, NCCL on CUDA with rank r on cuda:r): every rank runs every configuration in step, rank 0 prints and appends the
records (params.world, experts_per_rank, on CUDA the GPUs and their links; impl `<impl>-ep<N>`). The peers are not
run (HF holds the whole model in one process). The ranks step together, so the roofline is the slowest rank's
measured ceiling over its own work per token (`roofline_derivation`), and each decode record carries the
all_reduce's share of the step, from an A/B in the same run (`collective_share`). An error in any rank stops the
run (exit 2, naming the rank): a rank that went on alone would wait in the next collective.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import inspect
import os
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace

import torch

from benchmarks import ranks, roofline
from benchmarks.cli import ints
from benchmarks.timing import Samples, clock_sampler, log, summarize, sync, time_calls, time_steps
from gates.memory import check_world, gpu_links
from gates.ranks import RankFailed, check_rank_timeout
from gates.run import gather
from model import parallel
from records.exits import EXIT_REFUSED, run_main

PEERS = ("hf", "hf-fla")
HF_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
HF_KDA_FUNCS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
# Rates the plan starts from (tokens/s): HF's are SPEC.md §4's H200 anchors, ours are guesses. Each is
# replaced by the rate measured so far as the run goes.
PLAN_RATES = {"ours": {"prefill": 20_000.0, "decode": 100.0},
              "hf": {"prefill": 3_700.0, "decode": 7.0},
              "hf-fla": {"prefill": 26_000.0, "decode": 7.0}}
PLAN_GRAPH_CAPTURE_S = 5.0  # capture + Triton warm-up of one graph decoder
PLAN_SYNTH_GBPS = 2.0  # synthetic weights built per second on the device, for the printed estimate only
GiB = 1 << 30


@dataclass(frozen=True)
class Settings:
    preset: str = "48b-a3b"
    device: str = "cuda"
    dtype: str = "bfloat16"
    contexts: tuple[int, ...] = (1024, 8192, 32768, 131072)
    prefill: tuple[int, ...] = (1024, 8192, 32768)
    decode_tokens: int = 64
    warmup_steps: int = 8
    prefill_chunk: int = 8192  # the decode contexts are filled this many tokens at a time (bounds memory)
    prefill_reps: int = 3
    recompute_context: int = 1024
    recompute_steps: int = 3
    peers: tuple[str, ...] = PEERS
    peer_decode_tokens: int = 16
    peer_prefill_reps: int = 2
    peer_max_s: float = 30.0
    budget_s: float = 480.0
    spot_prompt: int = 32
    spot_tokens: int = 8
    eager: bool = False
    seed: int = 0
    read_bytes: int = 4 * GiB
    matmul_n: int = 8192
    ceiling_reps: int = 20
    world: int = 1  # ranks the routed experts are split over (`model.parallel`), one process each
    rank_timeout_s: float = ranks.DEFAULT_RANK_TIMEOUT_S


# A CPU run's records carry no roofline: its read "ceiling" of a few MiB moved from 2 to 39 GB/s between five runs
# on one machine (a cache, not DRAM), and the prefill's is a bf16 matmul rate set beside an fp32 model.
CPU_ROOFLINE_NOTE = "no roofline on a CPU: the ceilings are measured (hbm_gbps, matmul_tflops) but describe caches"

QUICK = dict(preset="tiny", device="cpu", dtype="float32", contexts=(16, 48), prefill=(16, 48), decode_tokens=4,
             warmup_steps=1, prefill_chunk=32, prefill_reps=2, recompute_context=16, recompute_steps=2,
             peers=("hf",), peer_decode_tokens=3, peer_prefill_reps=1, budget_s=120.0, spot_prompt=8,
             spot_tokens=4, read_bytes=16 << 20, matmul_n=128, ceiling_reps=3)


# ---- HF peer: the model, its KDA kernel choice, its timings ---------------------------------------

def hf_kda_backends() -> dict[str, str]:
    """The module whose code each of HF's KDA names runs now: fla's, or HF's own torch fallback. HF's
    decorator keeps the implementation it chose at import in its wrapper's closure."""
    mod = importlib.import_module(HF_MODULE)
    out = {}
    for name in HF_KDA_FUNCS:
        fn = getattr(mod, name)
        try:
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
        except TypeError:  # not a plain function (a hub-kernel wrapper object): report what it is
            impl = fn
        out[name] = getattr(impl, "__module__", None) or "unknown"
    return out


@contextlib.contextmanager
def hf_kernels(peer: str):
    """Inside the block HF runs as `peer`: 'hf' with its torch KDA functions, 'hf-fla' as imported (fla)."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")
    mod = importlib.import_module(HF_MODULE)
    bound = {name: getattr(mod, name) for name in HF_KDA_FUNCS}
    if peer == "hf":
        for name, fn in bound.items():
            setattr(mod, name, inspect.unwrap(fn))  # the decorator wraps the torch function it falls back to
    try:
        yield
    finally:
        for name, fn in bound.items():
            setattr(mod, name, fn)


def peer_unavailable(peer: str) -> str | None:
    """Why `peer` cannot run in this process, or None."""
    if peer == "hf":
        return None
    backends = hf_kda_backends()
    if all(b.startswith("fla") for b in backends.values()):
        return None
    try:
        import fla  # noqa: F401
        why = "fla imports, but HF bound other kernels (fla was imported after HF's module?)"
    except Exception as e:  # any import failure makes HF fall back; say which
        why = f"import fla failed: {type(e).__name__}: {e}"
    return f"peer hf-fla unavailable: HF's KDA functions are bound to {backends}; {why}"


class _StepClock:
    """A logits processor that stamps each generation step (after a device sync) and watches for NaN/inf."""

    def __init__(self, device):
        self.device, self.stamps, self.finite = device, [], []

    def __call__(self, input_ids, scores):
        self.finite.append(torch.isfinite(scores).all())
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


@torch.no_grad()
def hf_decode(hf, ids: torch.Tensor, steps: int, device) -> dict:
    """HF `generate`, greedy, `steps` decode steps after the prompt: the prefill time (to the first token's
    logits) and one latency sample per decoded token, generate's own per-step work included."""
    from transformers import LogitsProcessorList

    clock = _StepClock(device)
    sync(device)
    t0 = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    with (clock_sampler(device) if cuda else contextlib.nullcontext()) as clocks:
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 2, min_new_tokens=steps + 2,
                    do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=hf.config.pad_token_id,
                    logits_processor=LogitsProcessorList([clock]))
    # The first decode step is warm-up, as ours are: it carries fla's autotuning of the decode kernel at a new
    # shape, several times a later step's time (docs/RESULTS.md, "Notes behind the code").
    ms = [1000.0 * (b - a) for a, b in zip(clock.stamps[1:], clock.stamps[2:])]
    # the clocks cover generate's prefill and warm-up step too: a few of its many steps
    samples = Samples(ms, 1000.0 * (clock.stamps[-1] - clock.stamps[1]), clocks.summary() if cuda else None)
    return {"samples": samples,
            "prefill_ms": 1000.0 * (clock.stamps[0] - t0), "finite": bool(torch.stack(clock.finite).all())}


def hf_prefill_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """HF's prefill as every prefill benchmark times it: the forward over the prompt with its cache on, the last
    position's logits only."""
    return hf(ids, use_cache=True, logits_to_keep=1).logits


@torch.no_grad()
def hf_prefill(hf, ids: torch.Tensor, reps: int, device) -> dict:
    """`hf_prefill_logits`, timed."""
    out = {}

    def run():
        out["logits"] = hf_prefill_logits(hf, ids)

    run()  # untimed: fla autotunes its kernels for each new shape, and that must not count as prefill time
    samples = time_calls(run, reps, device)
    return {"samples": samples, "finite": bool(torch.isfinite(out.pop("logits")).all())}


# ---- ours ------------------------------------------------------------------------------------------

def choose_decoder(s: Settings, model):
    """(impl, make(cache) -> decode callable, reason or None): the graph decoder when it can be used."""
    eager = ("ours-eager", lambda cache: model.decode_step)
    if s.eager:
        return (*eager, "--eager: eager decode_step measured, not the graph decoder")
    if torch.device(s.device).type != "cuda":
        return (*eager, "CUDA graphs need a CUDA device: eager decode_step measured")
    try:
        from model.fast import GraphDecoder
    except ImportError as e:
        return (*eager, f"model.fast.GraphDecoder not importable ({e}): eager decode_step measured")
    return "ours-graph", lambda cache: GraphDecoder(model, cache), None


@torch.no_grad()
def ours_decode(s: Settings, model, ids: torch.Tensor, make_decoder, collective_ab: bool = False) -> dict:
    """Prefill `ids`, then warm-up and timed greedy steps of `make_decoder(cache)`. `collective_ab` (over several
    ranks): then as many steps again with the all_reduce of every MoE layer skipped (a decoder made inside
    `model.parallel.collective_skipped`), timed into `no_collective`; their tokens are wrong and unused."""
    T = ids.shape[1]
    steps = s.warmup_steps + s.decode_tokens
    cache = model.new_cache(ids.shape[0], T + steps * (2 if collective_ab else 1) + 1)
    t0 = time.perf_counter()
    for a in range(0, T, s.prefill_chunk):
        logits = model.prefill(ids[:, a:a + s.prefill_chunk], cache)
    sync(s.device)
    prefill_s = time.perf_counter() - t0
    finite = [torch.isfinite(logits).all()]
    state = {"tok": logits.argmax(-1)}

    def run(decode):
        def step():
            state["logits"] = decode(state["tok"], cache)
            state["tok"] = state["logits"].argmax(-1)

        for _ in range(s.warmup_steps):
            step()
        return time_steps(step, s.decode_tokens, s.device)

    samples = run(make_decoder(cache))
    finite.append(torch.isfinite(state["logits"]).all())
    out = {"samples": samples, "prefill_s": prefill_s, "finite": bool(torch.stack(finite).all())}
    if collective_ab:
        with parallel.collective_skipped():
            out["no_collective"] = run(make_decoder(cache))
        # without the all_reduce each rank keeps its own experts' share, so the ranks' logits must now differ
        out["no_collective_digest"] = float(state["logits"].double().sum())
    return out


@torch.no_grad()
def recompute_decode(s: Settings, model, ids: torch.Tensor) -> dict:
    """Greedy steps that each run the whole sequence so far (the first two untimed, as warm-up).

    Two, because Triton compiles a kernel again when an integer argument stops being a multiple of 16 (its
    specialisation): the warm-up at the context length (1024) and the next length (1025) compile both
    variants; with one, the second compile landed in the timed steps (docs/RESULTS.md, "Notes behind the code")."""
    state = {"ids": ids, "finite": []}

    def step():
        logits = model(state["ids"], last_only=True)
        state["finite"].append(torch.isfinite(logits).all())
        state["ids"] = torch.cat([state["ids"], logits.argmax(-1)[:, None]], dim=1)

    step()
    step()
    samples = time_steps(step, s.recompute_steps, s.device)
    return {"samples": samples, "finite": bool(torch.stack(state["finite"]).all())}


class PrefillCall:
    """Our prefill as every prefill benchmark times it: `run()` is a whole `model.prefill` of `ids` into the cache
    that `setup()` made fresh (untimed), keeping the last position's logits (`logits`). `setup()` drops the last
    call's cache before it allocates the next: two caches of a long prompt at 48B need not fit."""

    def __init__(self, model, ids: torch.Tensor):
        self.model, self.ids, self.cache, self.logits = model, ids, None, None

    def setup(self) -> None:
        self.cache = self.logits = None
        self.cache = self.model.new_cache(self.ids.shape[0], self.ids.shape[1])

    def run(self) -> None:
        self.logits = self.model.prefill(self.ids, self.cache)

    def drop(self) -> None:
        self.cache = self.logits = None


@torch.no_grad()
def ours_prefill(s: Settings, model, ids: torch.Tensor) -> dict:
    """`PrefillCall`, timed; one untimed run first (kernel compilation)."""
    call = PrefillCall(model, ids)
    call.setup()
    call.run()
    samples = time_calls(call.run, s.prefill_reps, s.device, setup=call.setup)
    return {"samples": samples, "finite": bool(torch.isfinite(call.logits).all())}


# ---- running configurations -------------------------------------------------------------------------

def free_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def attempt(fn, device, fatal: bool = False) -> tuple[dict | None, str | None]:
    """(result, None), or (None, reason) after an OOM or any error; memory is released either way. `fatal` (a run
    over several ranks): the error is raised, since a rank that went on alone would wait in the next collective."""
    try:
        return fn(), None
    except torch.cuda.OutOfMemoryError as e:
        if fatal:
            raise
        reason = f"out of memory: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # one configuration failing must not end an unattended run
        if fatal:
            raise
        traceback.print_exc()
        reason = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        free_memory(device)
    log(f"  FAILED: {reason}")
    return None, reason


@dataclass
class Plan:
    """Time estimates from the rates measured so far, and the skip rules; the budget runs from its creation."""
    s: Settings
    rates: dict = field(default_factory=lambda: {k: dict(v) for k, v in PLAN_RATES.items()})
    started: float = field(default_factory=time.perf_counter)

    def used_s(self) -> float:
        return time.perf_counter() - self.started

    def seconds(self, who: str, phase: str, T: int) -> float:
        r = self.rates["ours" if who in ("ours", "recompute") else who]
        s = self.s
        if who == "ours" and phase == "decode":
            return T / r["prefill"] + (s.warmup_steps + s.decode_tokens) / r["decode"] + PLAN_GRAPH_CAPTURE_S
        if who == "ours":
            return (1 + s.prefill_reps) * T / r["prefill"]
        if who == "recompute":
            return (1 + s.recompute_steps) * T / r["prefill"]
        if phase == "decode":
            return T / r["prefill"] + (s.peer_decode_tokens + 1) / r["decode"]
        return (1 + s.peer_prefill_reps) * T / r["prefill"]

    def skip_reason(self, who: str, phase: str, T: int) -> str | None:
        est = self.seconds(who, phase, T)
        if who in PEERS and est > self.s.peer_max_s:
            return f"{who} {phase} at context {T} skipped: estimated {est:.0f} s > --peer-max-s {self.s.peer_max_s:g}"
        if self.used_s() + est > self.s.budget_s:
            return (f"{who} {phase} at context {T} skipped: estimated {est:.0f} s would end past the run budget "
                    f"--budget-s {self.s.budget_s:g} ({self.used_s():.0f} s used)")
        return None

    def learn(self, who: str, phase: str, tok_s: float) -> None:
        """Only warm rates are learned: decode steps after warm-up, prefills after a run at the same length
        (a first prefill at a new length may include kernel compilation and autotuning)."""
        self.rates[who][phase] = tok_s


@dataclass
class Outcome:
    """One side of a configuration: measured, failed, or not run (skipped/unavailable)."""
    tok_s: float | None = None
    samples: Samples | None = None
    extra: dict = field(default_factory=dict)
    reason: str | None = None
    invalid: bool = False  # the reason makes the record INVALID (failure, NaN, peer missing), not a budget skip


def measured(res: dict | None, reason: str | None, tokens: int, what: str) -> Outcome:
    """An Outcome from `attempt`'s result; `tokens` per sample (1 for decode steps, T for a prefill)."""
    if res is None:
        return Outcome(reason=f"{what}: {reason}", invalid=True)
    samples = res.pop("samples")
    if samples.clocks:
        res["clocks"] = samples.clocks
    out = Outcome(tokens * samples.per_s, samples, res)
    if not res.pop("finite"):
        out.reason, out.invalid = f"{what}: NaN/inf in the logits", True
    return out


def host_pacing(samples: Samples) -> dict:
    """The host's time per call and how many calls it paced (`Samples.host_paced`), where they were measured."""
    if samples.host_ms is None:
        return {}
    return {"host_ms": samples.host_ms, "host_paced": samples.host_paced()}


def peer_measured(res: dict | None, reason: str | None, tokens: int, peer: str) -> Outcome:
    """`measured` for a peer, except that a peer running out of memory is a skip, not a failure: it shares our
    weights on one device, and at long contexts HF alone asks for more than is left (128 GiB at 128k context on
    the H200, docs/RESULTS.md, "Notes behind the code"). No peer figure either way."""
    out = measured(res, reason, tokens, peer)
    if res is None and reason.startswith("out of memory"):
        out.reason, out.invalid = f"{peer} not measured (does not fit beside ours): {reason}", False
    return out


def spot_result(ours, theirs, peer: str, eps: float) -> dict:
    """The spot check's record entry: tokens agreeing position by position (`agree` of `total`) and, where they
    part, the diagnosis of the first divergence (`gates.compare.compare_prompt`, ours as the reference)."""
    from gates.compare import compare_prompt
    r = compare_prompt(0, ours, theirs, eps, "ours", peer)
    out = {"agree": r.k, "total": r.n, "prompt_len": len(ours.prompt), "verdict": r.verdict}
    if r.divergence is not None:
        out.update(first_divergence=r.first_divergence, explanation=r.divergence.explain())
    return out


def groups(s: Settings) -> list[tuple[str, int]]:
    """(phase, context) in the order they run: cheapest first. At the recompute context, recompute goes before
    ours' decode, so a report that keys records by (phase, context) alone shows the graph decoder's, the later."""
    out = []
    for T in sorted(set(s.contexts) | set(s.prefill) | ({s.recompute_context} if s.recompute_steps else set())):
        if s.recompute_steps and T == s.recompute_context:
            out.append(("recompute", T))
        if T in s.contexts:
            out.append(("decode", T))
        if T in s.prefill:
            out.append(("prefill", T))
    return out


def estimate_s(s: Settings, plan: Plan) -> float:
    """Seconds the measurements should take at the plan's rates (peers capped as the run caps them)."""
    total = 0.0
    for phase, T in groups(s):
        if phase == "recompute":
            total += plan.seconds("recompute", "decode", T)
            continue
        total += plan.seconds("ours", phase, T)
        total += sum(min(plan.seconds(p, phase, T), s.peer_max_s) for p in s.peers)
    return total


class Bench:
    """Every configuration of a run on one model; with `ep` (more than one rank), this rank's share of it, every
    rank running the same configurations in step and rank 0 alone keeping the records. `notes`: said in every
    record's reasons."""

    def __init__(self, s: Settings, loaded, plan: Plan, ep=None, notes=()):
        self.s, self.loaded, self.cfg, self.model, self.plan = s, loaded, loaded.cfg, loaded.model, plan
        self.dtype = getattr(torch, s.dtype)
        self.ep, self.notes = ep, list(notes)
        self.world, self.rank = (1, 0) if ep is None else (ep.world, ep.rank)
        self.run_id = self.agreed(uuid.uuid4().hex[:12])
        self.records: list[dict] = []
        self.pending: list[dict] = []  # this group's records, appended once every rank has finished it
        self.impl, self.make_decoder, self.decoder_note = choose_decoder(s, self.model)
        self.hf, self.unavailable, self.spot, self.kernels = None, {}, {}, {}
        self.gpus = {}
        if self.world > 1 and torch.device(s.device).type == "cuda":  # each rank's GPU, and the links between them
            mine = {"rank": self.rank, "cuda": torch.cuda.current_device(), "name": torch.cuda.get_device_name()}
            names = gather(mine)
            if self.rank == 0:
                self.gpus = gpu_links(range(self.world)) or {"gpus": names}

    def agreed(self, x):
        """Rank 0's x on every rank (a collective), so that every rank makes the same choices; x in one process."""
        return x if self.world == 1 else gather(x)[0]

    # -- setup ----------------------------------------------------------------------------------------
    def prompt(self, T: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.s.seed * 1_000_003 + T)
        return torch.randint(0, self.cfg.vocab_size, (1, T), generator=g).to(self.s.device)

    def measure_ceilings(self) -> None:
        s = self.s
        self.ceil = roofline.measure_ceilings(s.device, s.read_bytes, s.matmul_n, s.ceiling_reps)
        self.rank_ceil = [self.ceil] if self.world == 1 else gather(self.ceil)
        log(f"ceilings: read {self.ceil.hbm_gbps:.0f} GB/s, bf16 matmul {self.ceil.matmul_tflops:.1f} TFLOP/s; "
            f"host: {self.ceil.launch_us:.2f} us an eager launch, {self.ceil.kernel_launch_us:.2f} us one of our kernels")
        if self.world > 1:
            log(f"ceilings over {self.world} ranks: read {sum(c.hbm_gbps for c in self.rank_ceil):.0f} GB/s, bf16 "
                f"matmul {sum(c.matmul_tflops for c in self.rank_ceil):.1f} TFLOP/s (sums of each rank's)")

    def setup_peers(self) -> None:
        if not self.s.peers:
            return
        from model.hf import hf_from_state_dict
        try:
            self.hf = hf_from_state_dict(self.cfg, self.model.state_dict(), attn="sdpa")
        except Exception as e:
            traceback.print_exc()
            for p in self.s.peers:
                self.unavailable[p] = f"peer {p} unavailable: HF model could not be built: {type(e).__name__}: {e}"
            return
        for p in self.s.peers:
            why = peer_unavailable(p)
            if why:
                self.unavailable[p] = why
                log(why)
            else:
                with hf_kernels(p):
                    self.kernels[p] = hf_kda_backends()
                log(f"peer {p}: HF's KDA functions run {self.kernels[p]}")

    @torch.no_grad()
    def spot_check(self) -> None:
        """First greedy tokens of ours (incremental, the measured decoder) vs each peer on a short prompt:
        provenance for the speed numbers, not a gate. Also warms up HF's generate and kernels. A disagreement is
        diagnosed as the gates diagnose one (`gates.compare`): the first divergent step, both tokens, both margins,
        near-tie (rounding deciding between two almost equal logits, at the model dtype's epsilon) or real."""
        from gates.compare import near_tie_eps
        from model.generate import Generation, generate_incremental
        from model.hf import hf_greedy

        s = self.s
        if self.world > 1:  # no peer runs over several ranks: nothing to check against
            return
        prompt = self.prompt(s.spot_prompt)[0].tolist()
        cache = self.model.new_cache(1, len(prompt) + s.spot_tokens)
        res, why = attempt(lambda: generate_incremental(self.model, prompt, s.spot_tokens, cache=cache,
                                                        decode=self.make_decoder(cache)), s.device)
        del cache
        for p in s.peers:
            if p in self.unavailable:
                continue
            if res is None:
                self.spot[p] = {"error": f"ours: {why}"}
                continue
            with hf_kernels(p):
                theirs, pwhy = attempt(lambda: hf_greedy(self.hf, prompt, s.spot_tokens), s.device)
            if theirs is None:
                self.spot[p] = {"error": f"{p}: {pwhy}"}
            else:
                self.spot[p] = spot_result(res, Generation(prompt, *theirs), p, near_tie_eps(self.dtype))
            log(f"spot check vs {p}: {self.spot[p]}")

    # -- one configuration ------------------------------------------------------------------------------
    def run_ours(self, who: str, phase: str, T: int, fn) -> Outcome:
        why = self.agreed(self.plan.skip_reason(who, phase, T))
        if why:
            log(f"  {why}")
            return Outcome(reason=why, invalid=True)
        if torch.device(self.s.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res, err = attempt(fn, self.s.device, fatal=self.world > 1)
        ab = res.pop("no_collective", None) if res else None
        ab_digest = res.pop("no_collective_digest", None) if res else None
        out = measured(res, err, T if phase == "prefill" else 1, who)
        if torch.device(self.s.device).type == "cuda":
            out.extra["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        if self.world > 1 and who == "ours" and phase == "decode":
            medians = gather(summarize(ab.samples_ms)["median_ms"] if ab else None)
            digests = gather(ab_digest)
            if out.samples and None not in medians and len(set(digests)) == 1:
                out.reason, out.invalid = ("the collective A/B is void: with the all_reduce skipped the ranks' "
                                           "logits still agree, so the skip did not take effect"), True
            elif out.samples and None not in medians:
                out.extra.update(ranks.collective_share(summarize(out.samples.samples_ms)["median_ms"], medians))
                log(f"  all_reduce share of the decode step: {out.extra['collective_share']:.1%} (median "
                    f"{summarize(out.samples.samples_ms)['median_ms']:.3f} ms a step with it, "
                    f"{out.extra['no_collective_median_ms']:.3f} ms without, slowest rank; A/B in this run)")
        if out.tok_s and who == "ours":
            self.plan.learn("ours", phase, out.tok_s)
        return out

    def run_peer(self, peer: str, phase: str, T: int, ids: torch.Tensor) -> Outcome:
        if peer in self.unavailable:
            return Outcome(reason=self.unavailable[peer], invalid=True)
        why = self.plan.skip_reason(peer, phase, T)
        if why:
            log(f"  {why}")
            return Outcome(reason=why)
        s = self.s
        with hf_kernels(peer):
            if phase == "decode":
                res, err = attempt(lambda: hf_decode(self.hf, ids, s.peer_decode_tokens, s.device), s.device)
            else:
                res, err = attempt(lambda: hf_prefill(self.hf, ids, s.peer_prefill_reps, s.device), s.device)
        out = peer_measured(res, err, T if phase == "prefill" else 1, peer)
        if out.tok_s:
            self.plan.learn(peer, phase, out.tok_s)
        return out

    def group(self, phase: str, T: int) -> None:
        """Ours (or recompute) and every peer at one context; records appended at the end of the group."""
        s, ids = self.s, self.prompt(T)
        who = "recompute" if phase == "recompute" else "ours"
        log(f"{phase} at context {T}: {self.impl if phase == 'decode' else who}")
        if phase == "decode":
            ours = self.run_ours(who, "decode", T, lambda: ours_decode(s, self.model, ids, self.make_decoder,
                                                                      collective_ab=self.world > 1))
        elif phase == "recompute":
            ours = self.run_ours(who, "decode", T, lambda: recompute_decode(s, self.model, ids))
        else:
            ours = self.run_ours(who, "prefill", T, lambda: ours_prefill(s, self.model, ids))
        if ours.tok_s:
            log(f"  {who}: {ours.tok_s:,.1f} tok/s (median {summarize(ours.samples.samples_ms)['median_ms']:.3f} ms)")
        peers = {}
        for p in s.peers if phase != "recompute" else ():
            if ours.tok_s is None:  # the record is INVALID already; spend the time elsewhere
                peers[p] = Outcome(reason=f"{p} not run: ours has no measurement at this context", invalid=True)
                continue
            peers[p] = self.run_peer(p, phase, T, ids)
            if peers[p].tok_s:
                log(f"  {p}: {peers[p].tok_s:,.1f} tok/s")
        del ids
        free_memory(s.device)
        for p in peers or [None]:
            self.record(phase, T, ours, p, peers.get(p))
        self.flush()

    def flush(self) -> None:
        """Append the group's records: over several ranks once every rank has finished the group (a rank that
        failed in it has stopped the run before this), by rank 0 alone."""
        from records.store import append

        if self.world > 1:
            gather(None)
        for rec in self.pending:
            append(rec)
            self.records.append(rec)
        self.pending = []

    # -- records --------------------------------------------------------------------------------------
    def record(self, phase: str, T: int, ours: Outcome, peer: str | None, theirs: Outcome | None) -> None:
        """One `bench` record: ours at this configuration, against one peer (or none); made on rank 0 alone."""
        from records.store import make_record

        if self.rank != 0:
            return
        s, cfg, decode = self.s, self.cfg, phase != "prefill"
        impl = {"decode": self.impl, "recompute": "recompute", "prefill": "ours-eager"}[phase]
        params = {"phase": "decode" if decode else "prefill", "context": T, "batch": 1,
                  "decode_tokens": {"decode": s.decode_tokens, "recompute": s.recompute_steps, "prefill": 0}[phase],
                  "impl": ranks.impl_name(impl, self.world), "peer": peer, "run": self.run_id, "world": self.world}
        if self.world > 1:
            params.update(experts_per_rank=self.ep.num_local, **self.gpus)
        if phase == "decode":
            params["prefill_chunk"] = s.prefill_chunk
        if phase == "prefill":
            params.update(reps=s.prefill_reps, peer_reps=s.peer_prefill_reps)
        if peer and phase == "decode":
            params["peer_decode_tokens"] = s.peer_decode_tokens

        if self.world > 1:
            roof, work = ranks.over_ranks(cfg, T, self.dtype, decode, self.rank_ceil)
        elif decode:
            roof = roofline.decode_roofline_tok_s(cfg, T, self.ceil.hbm_gbps, self.dtype)
            work = {"bytes_per_token": roofline.decode_bytes_per_token(cfg, T, self.dtype)}
        else:
            roof = roofline.prefill_roofline_tok_s(cfg, T, self.ceil.matmul_tflops)
            work = {"flops_per_token": roofline.prefill_flops_per_token(cfg, T)}
        if s.device == "cpu":   # no roofline: a smoke run's ceilings (16 MiB read, 128^3 matmul) measure caches
            roof, work["roofline_note"] = None, CPU_ROOFLINE_NOTE
        results = {"tok_s": ours.tok_s, "peer": peer, "peer_tok_s": None, "speedup_vs_peer": None,
                   "roofline_tok_s": roof, "roofline_fraction": ours.tok_s / roof if ours.tok_s and roof else None,
                   "hbm_gbps": self.ceil.hbm_gbps, "matmul_tflops": self.ceil.matmul_tflops,
                   "host_launch_us": self.ceil.launch_us, "host_kernel_launch_us": self.ceil.kernel_launch_us, **work,
                   "samples_ms": ours.samples.samples_ms if ours.samples else [], **ours.extra}
        if ours.samples:
            results.update(summarize(ours.samples.samples_ms), **host_pacing(ours.samples))
        if theirs is not None:
            results.update(peer_kernels=self.kernels.get(peer), spot_check=self.spot.get(peer),
                           **{f"peer_{k}": v for k, v in theirs.extra.items()})
        if theirs is not None and theirs.samples:
            results.update(peer_tok_s=theirs.tok_s, peer_samples_ms=theirs.samples.samples_ms,
                           peer_median_ms=summarize(theirs.samples.samples_ms)["median_ms"],
                           **{f"peer_{k}": v for k, v in host_pacing(theirs.samples).items()})
            if ours.tok_s:
                results["speedup_vs_peer"] = ours.tok_s / theirs.tok_s

        sides = [o for o in (ours, theirs) if o is not None]
        reasons = [o.reason for o in sides if o.reason]
        if phase == "decode" and self.decoder_note:
            reasons.append(self.decoder_note)
        reasons += self.notes
        rec = make_record("bench", preset=s.preset, dtype=s.dtype, device=s.device,
                          weights=self.loaded.weights, params=params, results=results,
                          verdict="INVALID" if any(o.invalid for o in sides) else "VALID", reasons=reasons)
        self.pending.append(rec)

    # -- the whole run --------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        self.measure_ceilings()
        self.setup_peers()
        self.spot_check()
        for phase, T in groups(self.s):
            self.group(phase, T)
        self.summary()
        return self.records

    def summary(self) -> None:
        log("summary (tok/s; roofline fraction; peers):")
        print(f"{'phase':8} {'context':>8} {'impl':14} {'tok/s':>10} {'roofline':>9} {'peer':7} {'peer tok/s':>10} "
              f"{'speedup':>8}  verdict", flush=True)
        for r in self.records:
            p, q = r["params"], r["results"]

            def f(x, spec):
                return "-" if x is None else format(x, spec)

            print(f"{p['phase']:8} {p['context']:>8} {p['impl']:14} {f(q['tok_s'], ',.1f'):>10} "
                  f"{f(q['roofline_fraction'], '.1%'):>9} {p['peer'] or '-':7} {f(q['peer_tok_s'], ',.1f'):>10} "
                  f"{f(q['speedup_vs_peer'], '.1f'):>8}  {r['verdict']}"
                  + (f" ({'note: ' if r['verdict'] == 'VALID' else ''}{'; '.join(x[:120] for x in r['reasons'])})"
                     if r["reasons"] else ""), flush=True)
        for r in self.records:
            p, q = r["params"], r["results"]
            if q.get("collective_share") is not None:
                print(f"collective: decode at context {p['context']} over {p['world']} ranks: the all_reduce takes "
                      f"{q['collective_share']:.1%} of the step ({q['median_ms']:.3f} ms with it, "
                      f"{q['no_collective_median_ms']:.3f} ms without, A/B in this run)", flush=True)


# ---- command line ----------------------------------------------------------------------------------

def _peers(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip() and x.strip() != "none")
    bad = [v for v in vals if v not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peers {bad}; expected a subset of {PEERS} or 'none'")
    return vals


def settings(argv: list[str] | None = None) -> Settings:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny preset on the CPU, small everything (smoke test)")
    ap.add_argument("--preset")
    ap.add_argument("--device")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--contexts", type=ints, help="decode contexts (tokens in the cache)")
    ap.add_argument("--prefill", type=ints, help="prefill lengths")
    ap.add_argument("--decode-tokens", type=int, help="timed decode steps per context (ours)")
    ap.add_argument("--prefill-chunk", type=int, help="tokens per prefill call when filling a decode context")
    ap.add_argument("--recompute-context", type=int)
    ap.add_argument("--recompute-steps", type=int, help="timed recompute steps (0: none)")
    ap.add_argument("--peers", type=_peers, help=f"comma-separated subset of {PEERS}, or 'none'")
    ap.add_argument("--peer-decode-tokens", type=int)
    ap.add_argument("--peer-max-s", type=float, help="skip a peer configuration estimated to take longer")
    ap.add_argument("--budget-s", type=float, help="skip what would end past this many seconds of the run")
    ap.add_argument("--eager", action="store_true", help="time eager decode_step instead of the graph decoder")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--world", type=int, metavar="N",
                    help="split the routed experts over N ranks, one process (on CUDA one GPU) each (default 1)")
    ap.add_argument("--rank-timeout-s", type=float, metavar="S",
                    help=f"with N > 1: seconds the ranks may run, and one collective may wait "
                         f"(default {ranks.DEFAULT_RANK_TIMEOUT_S:g})")
    a = ap.parse_args(argv)
    base = Settings(**QUICK) if a.quick else Settings()
    if a.device is None and not a.quick and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --quick (make bench QUICK=1) for the CPU smoke run, or --device cpu with a "
                 "small --preset")
    given = {k: v for k, v in vars(a).items() if v is not None and k != "quick" and v is not False}
    s = replace(base, **given)
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {s.device}: no CUDA device here")
    from model.config import PRESETS
    if s.preset not in PRESETS:
        ap.error(f"--preset {s.preset!r}: no such preset; presets: {', '.join(PRESETS)}")
    for name in ("decode_tokens", "prefill_chunk", "peer_decode_tokens", "recompute_context"):
        if getattr(s, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if s.recompute_steps < 0:
        ap.error("--recompute-steps must be >= 0")
    for name in ("budget_s", "peer_max_s"):
        if not getattr(s, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0 seconds")
    if not (s.contexts or s.prefill or s.recompute_steps):
        ap.error("nothing to measure: --contexts and --prefill name no length and --recompute-steps is 0")
    try:
        check_world(s.world, PRESETS[s.preset].num_experts)
        check_rank_timeout(s.rank_timeout_s)
    except ValueError as e:
        ap.error(str(e))
    if s.world > 1 and s.device not in ("cpu", "cuda"):
        ap.error(f"--device {s.device} with --world {s.world}: rank r computes on cuda:r; give --device cuda or cpu")
    gpus = torch.cuda.device_count() if s.device == "cuda" else None
    if gpus is not None and s.world > gpus:
        ap.error(f"--world {s.world}: each rank computes on a GPU of its own, and torch sees {gpus} CUDA "
                 f"device{'s' if gpus != 1 else ''}")
    return s


def measure(s: Settings, ep=None) -> list[dict]:
    """Load the model (with `ep`, this rank's share of it: a collective) and run every configuration: a run in one
    process, or one rank's part of a run over several (`benchmarks.ranks`)."""
    from model.build import load_model
    from model.config import get_config
    from model.params import param_counts

    world, notes = 1 if ep is None else ep.world, []
    if world > 1 and s.peers:
        notes.append(ranks.peers_skipped(s.peers, world))
        log(notes[-1])
        s = replace(s, peers=())
    c = param_counts(get_config(s.preset))
    weight_gb = (c.total - c.routed_experts * (world - 1) // world) * getattr(torch, s.dtype).itemsize / 1e9
    plan = Plan(s)
    log(f"plan: {weight_gb:.1f} GB of synthetic weights{' a rank' if world > 1 else ''} "
        f"(~{weight_gb / PLAN_SYNTH_GBPS:.0f} s), then {groups(s)} in ~{estimate_s(s, plan):.0f} s at the rates "
        f"{PLAN_RATES} (tok/s, updated as measured); budget {s.budget_s:g} s from the start, each peer "
        f"configuration capped at {s.peer_max_s:g} s")
    loaded = load_model(s.preset, device=s.device, dtype=getattr(torch, s.dtype), seed=s.seed, ep=ep)
    sync(s.device)
    log(f"weights {loaded.source} {loaded.weights} on {loaded.model.device}")
    return Bench(s, loaded, plan, ep=ep, notes=notes).run()


def main(argv: list[str] | None = None) -> list[dict] | int:
    """The records appended; over several ranks, exit 2 (one line naming the rank) where a rank failed."""
    # fla reads this when imported (by HF's module, later): measure its Triton KDA path (SPEC.md §2).
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    s = settings(argv)
    log(f"bench_e2e: {s}")
    if s.world == 1:
        records = measure(s)
    else:
        try:
            records = ranks.run_ranks(s)
        except RankFailed as e:
            if e.detail:
                print(e.detail.strip(), file=sys.stderr)
            print(f"error: bench over {s.world} ranks stopped: {e}; records are kept only of the configurations "
                  f"every rank finished", file=sys.stderr)
            return EXIT_REFUSED
    bad = sum(r["verdict"] != "VALID" for r in records)
    run = records[0]["params"]["run"] if records else "-"
    log(f"done: {len(records)} bench records appended ({bad} INVALID), run {run}")
    return records


if __name__ == "__main__":
    sys.exit(run_main(main, kinds=('bench',)))

"""What every gate run shares: resolved options, the model under test, the memory floor guard, records.

Defaults (the CLI reads no environment variables; the Makefile maps its variables to flags):
- device: `cuda` when torch sees a GPU, else `cpu`;
- dtype: `fp32` on a CPU; on CUDA `bf16`, except for Gate A, Gate B and self-made goldens (`exact=True`): `fp32`
  with the routed experts held in `bf16` (their checkpoint dtype: the same weights, 102 GB of weights for the 48B
  model instead of 196 by param_counts, so it fits one H200). Gate A asks whether the carried state gives the
  recompute path's tokens; in bf16 a 27-layer model of random weights puts near-ties inside the rounding noise of
  two correct paths (measured on the H200: every divergence of a bf16 Gate A within the noise floor of the
  PyTorch-kernel control; docs/RESULTS.md), so bf16 cannot tell a bug from rounding there. In fp32 it can, and
  that is the question the gate exists to answer. Gate B follows for the same reason: in bf16 our kernels and
  HF's part at the noise floor (against the HF bf16 golden; docs/RESULTS.md), so on CUDA its default is
  the fp32 golden our recompute path made (`gates/goldens/48b-a3b-fp32-cuda-self.json`), a regression check
  across commits; HF cannot make that golden on one GPU. `--dtype bf16` still runs either gate in bf16 (Gate B
  then against the HF bf16 golden; the diagnosis says near-tie or real);
- expert dtype: the model dtype, except as above (`--expert-dtype`);
- model (without --preset or --model): on a CPU the trained reference checkpoint `checkpoints/kimi-linear-ref`
  (`tiny` where a checkout lacks it), on CUDA the `48b-a3b` preset (`--preset tiny` runs tiny there);
- world (the ranks the routed experts are split over, `model.parallel`; `--world`): 1 on a CPU; on CUDA, where the
  command spreads (`world=None`), 1 when GPU 0's free memory (NVML) holds the model's projected peak plus the floor,
  else the fewest ranks, one a GPU, that split the experts evenly and leave each GPU the floor
  (`gates.memory.choose_world`); a box on which no number of its GPUs would refuses, saying what would. Without an
  NVML reading, 1 (the floor guard then refuses for want of a reading).

The model under test comes from `model.build.load_model`; its weights id (`model.weights.weights_id`) is
the same for any dtype of checkpoint-valued weights, so a golden made in fp64 judges the fp32 and bf16 runs
of the same weights.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from model.build import Loaded as Subject, is_small, load_model
from model.config import KimiConfig, get_config
from model.parallel import ExpertParallel
from model.tokenizer import TOKENIZER_FILE
from records import store

from .memory import (FloorDecision, FloorSampler, GiB, MemoryFloorError, MemReading, Projection, check_floor,
                     check_world, choose_world, gpu_links, nvml_index, project_peak, read_device_memory,
                     visible_gpu_memory)
from .prompts import DEFAULT_NEW_TOKENS, Battery, battery, check_prompt_files

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
DEVICES = ("cpu", "cuda")
KERNELS = ("auto", "torch", "triton")
SOURCES = ("hf", "self")
DEFAULT_FLOOR_GIB = 15.0
DEFAULT_TOPK = 10
# Bounds on the numeric options, so that a typo is refused before a run rather than running until killed: the
# recompute path's cost grows with the square of the new tokens, no GPU has a TiB of memory, and torch's
# generators take 64-bit seeds.
MAX_NEW_TOKENS = 1024
MAX_FLOOR_GIB = 1024.0
MAX_SEED = 2 ** 63 - 1

# Exit codes of every gate command.
EXIT_PASS, EXIT_FAIL, EXIT_REFUSED = 0, 1, 2
# The record kind each gate appends; a gate that crashes (a kernel that fails to compile, CUDA out of memory)
# still appends one, INVALID, so that a nightly run's records say what happened instead of going silent.
RECORD_KINDS = {"gate-a": "gate_a", "gate-b": "gate_b", "gate-memory": "memory"}


class GateRefused(RuntimeError):
    """The gate cannot judge this run (memory floor, wrong golden, no reading); the message says why."""


# ---- options -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    preset: str | None      # None with a checkpoint
    model: str | None       # checkpoint directory
    dtype: str              # a key of DTYPES
    device: str             # 'cpu' | 'cuda'
    new_tokens: int
    floor_gib: float
    source: str             # golden source: 'hf' | 'self'
    golden: str | None
    seed: int
    kernels: str
    expert_dtype: str | None = None  # a key of DTYPES: the routed experts' dtype when not the model's
    world: int = 1  # ranks the routed experts are split over (`model.parallel`), one process each
    experts_per_rank: int | None = None  # routed experts each rank holds, with world > 1
    world_choice: str | None = None  # why the default world was chosen, where it was (on CUDA)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_expert_dtype(self) -> torch.dtype | None:
        return None if self.expert_dtype is None else DTYPES[self.expert_dtype]

    @property
    def precision(self) -> str:
        """'fp32', or 'fp32 (experts bf16)' when the experts are held apart."""
        return self.dtype if self.expert_dtype is None else f"{self.dtype} (experts {self.expert_dtype})"

    @property
    def floor_bytes(self) -> int:
        return int(self.floor_gib * GiB)

    @property
    def config(self) -> KimiConfig:
        return get_config(self.model if self.model else self.preset)

    @property
    def label(self) -> str:
        """The model's short name: the preset (with a non-zero seed), or the checkpoint directory's name."""
        if self.model:
            return Path(self.model).resolve().name
        return self.preset if self.seed == 0 else f"{self.preset}-seed{self.seed}"


def context_len(b: Battery, new_tokens: int) -> int:
    return max(map(len, b.ids)) + new_tokens


def check_new_tokens(n) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NEW_TOKENS:
        raise ValueError(f"--new-tokens must be an integer in 1..{MAX_NEW_TOKENS}, got {n!r}")
    return n


def check_floor_gib(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= MAX_FLOOR_GIB:  # NaN, inf fail too
        raise ValueError(f"--floor-gib must be a number of GiB in 0..{MAX_FLOOR_GIB:g}, got {x!r}")
    return float(x)


def check_seed(seed) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"--seed must be an integer in 0..2^63-1, got {seed!r}")
    return seed


REFERENCE_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "kimi-linear-ref"


def default_cpu_model() -> str | None:
    """The CPU default: the suite's trained reference checkpoint (docs/REFERENCE.md), named relative to the working
    folder where it lies under it (so records name no machine's path); None where the checkout lacks it."""
    if not REFERENCE_CHECKPOINT.is_dir():
        return None
    rel = os.path.relpath(REFERENCE_CHECKPOINT)
    return str(REFERENCE_CHECKPOINT) if rel.startswith("..") else rel


def resolve(preset=None, model=None, dtype=None, device=None, new_tokens=DEFAULT_NEW_TOKENS,
            floor_gib=DEFAULT_FLOOR_GIB, source="hf", golden=None, seed=0, kernels="auto", expert_dtype=None,
            exact: bool = False, world: int | None = 1,
            readings: Callable[[], list[MemReading | None]] | None = None,
            reader: Callable[[], MemReading | None] | None = None, log=print) -> Options:
    """Fill in the defaults (module docstring; `exact`: the token-exact commands', gates.__main__.EXACT_COMMANDS;
    `world=None`: chosen by the box, for the commands that spread over ranks) and refuse impossible combinations.
    `readings`: each visible GPU's free memory (default `gates.memory.visible_gpu_memory`); `reader`: instead, one
    GPU's. `log`: where the reason for a default world chosen on CUDA is said."""
    if preset is not None and model is not None:
        raise ValueError("give --preset or --model, not both")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise ValueError(f"--model must name a checkpoint directory, got {model!r}")
    if model is not None and not Path(model).is_dir():
        raise ValueError(f"--model {model}: no such checkpoint directory")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: expected one of {DEVICES}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    if dtype is None and device == "cuda" and exact:
        dtype, expert_dtype = "fp32", expert_dtype or "bf16"
    dtype = dtype or ("bf16" if device == "cuda" else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if expert_dtype == dtype:
        expert_dtype = None  # one dtype for the whole model: nothing held apart
    if expert_dtype is not None and expert_dtype not in DTYPES:  # every DTYPES key holds bf16 experts exactly
        raise ValueError(f"--expert-dtype {expert_dtype!r}: expected one of {', '.join(DTYPES)}")
    check_new_tokens(new_tokens)
    check_floor_gib(floor_gib)
    check_seed(seed)
    if source not in SOURCES:
        raise ValueError(f"--source {source!r}: expected one of {SOURCES}")
    if kernels not in KERNELS:
        raise ValueError(f"--kernels {kernels!r}: expected one of {KERNELS}")
    if kernels == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--kernels triton on a CPU runs Triton's interpreter: set TRITON_INTERPRET=1 (or --kernels torch)")
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        raise ValueError(f"--world must be a positive integer, got {world!r}")
    if model is None and preset is None:
        model = default_cpu_model() if device == "cpu" else None
        preset = None if model else "tiny" if device == "cpu" else "48b-a3b"
    if preset is not None:
        get_config(preset)  # unknown names fail here, with the list of presets
    if world is None and device == "cpu":
        world = 1
    choice = None
    if world != 1:
        cfg = get_config(model if model else preset)
        if world is None:
            free = readings() if readings else [reader()] if reader else visible_gpu_memory()
            world, choice = default_world(cfg, model, DTYPES[dtype], expert_dtype and DTYPES[expert_dtype],
                                          new_tokens, floor_gib, free)
            if choice:
                log(f"default world {world}: {choice}")
        check_world(world, cfg.num_experts)
        gpus = torch.cuda.device_count() if device == "cuda" else None
        if gpus is not None and world > gpus:
            raise ValueError(f"--world {world}: each rank computes on a GPU of its own, and torch sees {gpus} CUDA "
                             f"device{'s' if gpus != 1 else ''}")
    per_rank = cfg.num_experts // world if world > 1 else None
    return Options(preset, model, dtype, device, new_tokens, float(floor_gib), source, golden, seed, kernels,
                   expert_dtype, world, per_rank, choice)


def default_world(cfg: KimiConfig, model: str | None, dtype: torch.dtype, expert_dtype: torch.dtype | None,
                  new_tokens: int, floor_gib: float, free: list[MemReading | None]) -> tuple[int, str | None]:
    """The number of ranks a CUDA run spreads over by default (module docstring), and why; 1 without a reading of
    every visible GPU."""
    if not free or any(r is None for r in free):
        return 1, None
    context = context_len(battery(cfg, model), new_tokens)
    floor = int(floor_gib * GiB)

    def need(world: int) -> int:
        return project_peak(cfg, dtype, 1, context, expert_dtype=expert_dtype, world=world).total + floor
    what = Path(model).resolve().name if model else cfg.name
    return choose_world(what, need, cfg.num_experts, [r.free for r in free])


# ---- the model under test ------------------------------------------------------------------------

def limit_cpu_threads(opts: Options) -> None:
    """A small model on a CPU runs on one thread: its ops are too small to split, and intra-op threads that
    spin-wait for a core shared with other processes slow a run down ~10x (measured: Gate A on tiny, 2-core
    box under load, 72 s with 2 threads, 4 s with 1)."""
    if opts.device == "cpu" and is_small(opts.config):
        torch.set_num_threads(1)


def load_subject(opts: Options) -> Subject:
    """The model under test, as `model.build.load_model` makes it for these options; with `world` > 1, this rank's
    share of it (a collective: every rank of the process group loads at once), on its own GPU on CUDA."""
    ep, device = None, opts.device
    if opts.world > 1:
        ep = ExpertParallel.of(opts.config.num_experts)
        if ep.world != opts.world:
            raise RuntimeError(f"the options say {opts.world} ranks; the process group has {ep.world}")
        if opts.device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # cuda:LOCAL_RANK (`model.parallel.init`)
    return load_model(opts.preset if opts.model is None else None, opts.model, device=device,
                      dtype=opts.torch_dtype, seed=opts.seed, expert_dtype=opts.torch_expert_dtype, ep=ep)


def prompt_note(opts: Options) -> str | None:
    """For a checkpoint folder without a tiktoken.model, a note that its prompts are the synthetic-byte battery.
    Checks the prompt files first (`check_prompt_files`), so that the command line refuses before any record."""
    if opts.model is None:
        return None
    check_prompt_files(opts.model)
    if os.path.lexists(Path(opts.model) / TOKENIZER_FILE):
        return None
    shown = store.shown_path(opts.model)
    return f"note: {shown} has no {TOKENIZER_FILE}, so the prompts are the synthetic-byte battery"


def battery_for(opts: Options) -> Battery:
    """The gates' battery: a checkpoint's text prompts without its tokenizer are refused, not mapped to bytes."""
    if opts.model is not None:
        check_prompt_files(opts.model)
    return battery(opts.config, opts.model)


# ---- the ranks of a run over several processes ---------------------------------------------------

def group_size() -> int:
    """The ranks of this run's process group (`model.parallel.init`); 1 in one process."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def group_rank() -> int:
    return dist.get_rank() if group_size() > 1 else 0


def gather(x) -> list:
    """x of every rank, in rank order (a collective); [x] in one process."""
    if group_size() == 1:
        return [x]
    out = [None] * group_size()
    dist.all_gather_object(out, x)
    return out


def any_rank(flag: bool) -> bool:
    """Whether flag holds on any rank (one small all_reduce); flag in one process."""
    if group_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def agree(why: str | None) -> None:
    """Every rank's check at once (a collective): GateRefused on every rank where any failed, naming each rank
    that did, so that no rank goes on to load alone and wait for the others in the first collective."""
    whys = gather(why)
    failed = [w if len(whys) == 1 else f"rank {r}: {w}" for r, w in enumerate(whys) if w]
    if failed:
        raise GateRefused("; ".join(failed))


def check_every_rank(sampler: FloorSampler) -> None:
    """`FloorSampler.check` over the ranks: where any rank's sampler tripped (or broke), every rank raises
    MemoryFloorError naming those ranks, so that all stop at the same step."""
    if not any_rank(sampler.tripped.is_set() or sampler.error is not None):
        return
    try:
        sampler.check()
        why = None
    except RuntimeError as e:  # MemoryFloorError, or a sampler that could not read
        why = str(e)
    whys = gather(why)
    raise MemoryFloorError("; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w))


# ---- the memory floor ----------------------------------------------------------------------------

@dataclass
class Guard:
    """The floor decision before loading and, on CUDA, the sampler that watches it while running."""
    projection: Projection | None
    decision: FloorDecision | None
    sampler: FloorSampler | None

    def step_hook(self):
        if self.sampler is None:
            return None
        return self.sampler.check if group_size() == 1 else functools.partial(check_every_rank, self.sampler)

    def results(self) -> dict:
        s = self.sampler
        return {
            "projected_bytes": None if self.projection is None else self.projection.total,
            "floor_bytes": None if self.decision is None else self.decision.floor,
            "free_before_bytes": None if self.decision is None else self.decision.free_before,
            "min_free_bytes": None if s is None else s.min_free,
            "floor_decision": None if self.decision is None else self.decision.message,
        }


def cuda_reader() -> Callable[[], MemReading | None]:
    """NVML reader for the CUDA device torch uses (asking torch which one creates the CUDA context)."""
    index = nvml_index(torch.cuda.current_device())
    return lambda: read_device_memory(index)


@contextlib.contextmanager
def floor_guard(opts: Options, context: int, reader: Callable[[], MemReading | None] | None = None,
                log=print):
    """On CUDA (or with an injected reader): refuse before loading when the projected peak would leave less
    than the floor, then watch free memory while the block runs. On a CPU without a reader: nothing. Over several
    ranks each checks and watches its own GPU, and all refuse or stop together (`agree`, `check_every_rank`)."""
    if reader is None and opts.device != "cuda":
        yield Guard(None, None, None)
        return
    reader = reader or cuda_reader()
    projection = project_peak(opts.config, opts.torch_dtype, 1, context, device=opts.device,
                              expert_dtype=opts.torch_expert_dtype, world=opts.world)
    reading = reader()
    decision = None if reading is None else check_floor(projection, opts.floor_bytes, reading)
    agree("no device memory reading (NVML): the memory floor cannot be checked" if decision is None
          else None if decision.ok else decision.message)
    log(decision.message)
    trip = lambda msg: print(f"ABORTING: {msg}", file=sys.stderr, flush=True)
    with FloorSampler(opts.floor_bytes, reader=reader, on_trip=trip) as sampler:
        guard = Guard(projection, decision, sampler)
        yield guard
        if group_size() > 1:
            check_every_rank(sampler)  # a trip after the last step stops every rank, not only its own


# ---- records -------------------------------------------------------------------------------------

def record(kind: str, opts: Options, weights: str | None, params: dict, results: dict, reasons=(),
           valid: bool = True, records_root=None) -> Path | None:
    """Append one gate record; the options are kept in `params` next to the gate's own. Over several ranks rank 0
    alone keeps it (None on the others), with each rank's GPU and the links between them on CUDA."""
    if group_rank() != 0:
        return None
    gpus = (gpu_links(range(opts.world)) or {}) if opts.world > 1 and opts.device == "cuda" else {}
    rec = store.make_record(kind, preset=opts.preset or opts.label, dtype=str(opts.torch_dtype).removeprefix("torch."),
                            device=opts.device, weights=weights, params={**asdict(opts), **gpus, **params},
                            results=results, verdict="VALID" if valid else "INVALID", reasons=list(reasons))
    return store.append(rec, root=records_root)


def shown_record(path: Path | None) -> str | None:
    """A records file as the gates print it: relative to the checkout where it lies inside it (`store.shown_path`);
    None on the ranks that keep no record."""
    return None if path is None else store.shown_path(path)


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def refused(kind: str, opts: Options, why: str, weights=None, records_root=None, log=print) -> int:
    """Record a gate that could not judge (INVALID: it measured nothing) and say so, in one line; printed, that
    line goes to stderr, as every exit-2 reason does."""
    path = record(kind, opts, weights, {}, {"passed": False, "refused": why}, reasons=[f"refused: {why}"],
                  valid=False, records_root=records_root)
    say = to_stderr if log is print else log
    say(f"{kind.replace('_', ' ').title()} REFUSED: {why} [record {shown_record(path)}]")
    return EXIT_REFUSED


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
- preset (without --model): `tiny` on a CPU; on CUDA `48b-a3b` when the GPU's free memory (NVML) holds its
  projected peak plus the floor, else `tiny` (the reason is printed).

The model under test comes from `model.build.load_model`; its weights id (`model.weights.weights_id`) is
the same for any dtype of checkpoint-valued weights, so a golden made in fp64 judges the fp32 and bf16 runs
of the same weights.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from model.build import Loaded as Subject, is_small, load_model
from model.config import KimiConfig, get_config
from records import store

from .memory import (FloorDecision, FloorSampler, GiB, MemReading, Projection, check_floor,
                     project_peak, read_device_memory)
from .prompts import DEFAULT_NEW_TOKENS, Battery, battery

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


def resolve(preset=None, model=None, dtype=None, device=None, new_tokens=DEFAULT_NEW_TOKENS,
            floor_gib=DEFAULT_FLOOR_GIB, source="hf", golden=None, seed=0, kernels="auto", expert_dtype=None,
            exact: bool = False, reader: Callable[[], MemReading | None] = read_device_memory, log=print) -> Options:
    """Fill in the defaults (module docstring; `exact`: the token-exact commands', gates.__main__.EXACT_COMMANDS)
    and refuse impossible combinations."""
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
    if model is None and preset is None:
        preset = _default_preset(device, DTYPES[dtype], expert_dtype and DTYPES[expert_dtype], new_tokens,
                                 floor_gib, reader, log)
    if preset is not None:
        get_config(preset)  # unknown names fail here, with the list of presets
    return Options(preset, model, dtype, device, new_tokens, float(floor_gib), source, golden, seed, kernels,
                   expert_dtype)


def _default_preset(device, dtype, expert_dtype, new_tokens, floor_gib, reader, log) -> str:
    if device == "cpu":
        return "tiny"
    big = get_config("48b-a3b")
    need = project_peak(big, dtype, 1, context_len(battery(big), new_tokens),
                        expert_dtype=expert_dtype).total + floor_gib * GiB
    r = reader()
    if r is not None and r.free >= need:
        return "48b-a3b"
    have = "no NVML reading" if r is None else f"free {r.free / GiB:.1f} GiB"
    log(f"default preset: tiny ({have}; 48b-a3b needs {need / GiB:.1f} GiB incl. the floor)")
    return "tiny"


# ---- the model under test ------------------------------------------------------------------------

def limit_cpu_threads(opts: Options) -> None:
    """A small model on a CPU runs on one thread: its ops are too small to split, and intra-op threads that
    spin-wait for a core shared with other processes slow a run down ~10x (measured: Gate A on tiny, 2-core
    box under load, 72 s with 2 threads, 4 s with 1)."""
    if opts.device == "cpu" and is_small(opts.config):
        torch.set_num_threads(1)


def load_subject(opts: Options) -> Subject:
    """The model under test, as `model.build.load_model` makes it for these options."""
    return load_model(opts.preset if opts.model is None else None, opts.model, device=opts.device,
                      dtype=opts.torch_dtype, seed=opts.seed, expert_dtype=opts.torch_expert_dtype)


def battery_for(opts: Options) -> Battery:
    return battery(opts.config, opts.model)


# ---- the memory floor ----------------------------------------------------------------------------

@dataclass
class Guard:
    """The floor decision before loading and, on CUDA, the sampler that watches it while running."""
    projection: Projection | None
    decision: FloorDecision | None
    sampler: FloorSampler | None

    def step_hook(self):
        return None if self.sampler is None else self.sampler.check

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
    index = torch.cuda.current_device()
    return lambda: read_device_memory(index)


@contextlib.contextmanager
def floor_guard(opts: Options, context: int, reader: Callable[[], MemReading | None] | None = None,
                log=print):
    """On CUDA (or with an injected reader): refuse before loading when the projected peak would leave less
    than the floor, then watch free memory while the block runs. On a CPU without a reader: nothing."""
    if reader is None and opts.device != "cuda":
        yield Guard(None, None, None)
        return
    reader = reader or cuda_reader()
    projection = project_peak(opts.config, opts.torch_dtype, 1, context, device=opts.device,
                              expert_dtype=opts.torch_expert_dtype)
    reading = reader()
    if reading is None:
        raise GateRefused("no device memory reading (NVML): the memory floor cannot be checked")
    decision = check_floor(projection, opts.floor_bytes, reading)
    if not decision.ok:
        raise GateRefused(decision.message)
    log(decision.message)
    trip = lambda msg: print(f"ABORTING: {msg}", file=sys.stderr, flush=True)
    with FloorSampler(opts.floor_bytes, reader=reader, on_trip=trip) as sampler:
        yield Guard(projection, decision, sampler)


# ---- records -------------------------------------------------------------------------------------

def record(kind: str, opts: Options, weights: str | None, params: dict, results: dict, reasons=(),
           valid: bool = True, records_root=None) -> Path:
    """Append one gate record; the options are kept in `params` next to the gate's own."""
    rec = store.make_record(kind, preset=opts.preset or opts.label, dtype=str(opts.torch_dtype).removeprefix("torch."),
                            device=opts.device, weights=weights, params={**asdict(opts), **params},
                            results=results, verdict="VALID" if valid else "INVALID", reasons=list(reasons))
    return store.append(rec, root=records_root)


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def refused(kind: str, opts: Options, why: str, weights=None, records_root=None, log=print) -> int:
    """Record a gate that could not judge (INVALID: it measured nothing) and say so, in one line; printed, that
    line goes to stderr, as every exit-2 reason does."""
    path = record(kind, opts, weights, {}, {"passed": False, "refused": why}, reasons=[f"refused: {why}"],
                  valid=False, records_root=records_root)
    (to_stderr if log is print else log)(f"{kind.replace('_', ' ').title()} REFUSED: {why} [record {path}]")
    return EXIT_REFUSED


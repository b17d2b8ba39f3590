"""The memory floor (SPEC.md §3): project, refuse, watch, audit.

1. Before loading: `project_peak` estimates the peak device memory of a run from the config alone, and
   `check_floor` refuses to start when `free - projected < floor`.
2. While running: `FloorSampler` reads free memory on a daemon thread; when it drops under the floor it
   trips once (`on_trip` callback, e.g. writing a record) and the run's loop stops cleanly at its next
   `sampler.check()`, which raises `MemoryFloorError` in the main thread.
3. After running: `audit` holds the measured peak against the projection.

The floor protects the machine, not the run: on a unified-memory box (the seed's GB10) running out of
device memory takes the whole host down with it, so the seed kept 15 GiB free at all times.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from model.checkpoint import layout
from model.config import KimiConfig
from model.params import param_counts

GiB = 1 << 30
DEFAULT_FLOOR_BYTES = 15 * GiB  # the seed's floor
# What a CUDA process holds beyond its tensors: the context with loaded kernels (~0.5-1 GiB on H200 with
# torch, cuBLAS and Triton modules), cuBLAS/cuBLASLt workspaces, and caching-allocator rounding. NVML sees
# all of it, torch.cuda.max_memory_allocated none of it, so the projection must carry it.
CUDA_CONTEXT_BYTES = 3 * GiB // 2
# the longest chunk the chunked KDA prefill takes (kda_chunk.py's configs: 16 by default, 32 for fp32 inputs,
# up to 64 in its sweeps): an upper bound of its intra-chunk matrices, [chunk, chunk] per head
KDA_CHUNK = 64


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# ---- reading device memory -------------------------------------------------------------------

@dataclass(frozen=True)
class MemReading:
    total: int
    free: int
    source: str  # "nvml", or "meminfo (unified memory)"

    @property
    def used(self) -> int:
        return self.total - self.free


def _host_meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of the host in bytes, from /proc/meminfo."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024  # the file counts kB
    return fields["MemTotal"], fields["MemAvailable"]


def read_device_memory(device_index: int = 0) -> MemReading | None:
    """Total and free memory of one GPU through NVML; None when there is no GPU or no NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception:  # no library, no driver, no such device
        return None
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        total, free = int(info.total), int(info.free)
    except pynvml.NVMLError:  # unified-memory GPUs (GB10) report no framebuffer of their own
        total = free = 0
    if total > 0:
        return MemReading(total, free, "nvml")
    # Unified memory: GPU allocations come out of host RAM, so what the host can still give is the bound.
    host_total, host_free = _host_meminfo()
    return MemReading(host_total, min(host_free, free) if free > 0 else host_free, "meminfo (unified memory)")


# ---- projection --------------------------------------------------------------------------------

def _itemsize(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"model dtype must be a floating torch.dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    return dtype.itemsize


@dataclass(frozen=True)
class Projection:
    weights_bytes: int
    state_bytes: int  # KDA recurrent state (fp32) and conv taps, all sequences
    cache_bytes: int  # MLA latent cache, all sequences at full context
    workspace_bytes: int  # largest transient buffers of one forward, plus the CUDA context allowance

    @property
    def total(self) -> int:
        return self.weights_bytes + self.state_bytes + self.cache_bytes + self.workspace_bytes

    def describe(self) -> str:
        return (f"projected peak {gib(self.total)} = weights {gib(self.weights_bytes)} + states {gib(self.state_bytes)}"
                f" + caches {gib(self.cache_bytes)} + workspace {gib(self.workspace_bytes)}")


def project_peak(cfg: KimiConfig, dtype, batch: int, context: int, prefill_chunk: int | None = None,
                 *, device: str = "cuda", expert_dtype=None) -> Projection:
    """Peak memory of serving `batch` sequences of up to `context` tokens, prefilling `prefill_chunk` at a time,
    the model in `dtype` with its routed experts in `expert_dtype` (default: `dtype`).

    An upper bound by design: a projection that is too low lets a run cross the floor. Attention is assumed
    fused (SDPA/flash: no [T, T] score matrix) and logits are counted for every position of a forward in
    fp32, as the recompute path produces them; a model that keeps only the last position peaks lower. The load's
    transient (one tensor's scratch) counts as a stage: it is over before the first forward.
    """
    for name, v in (("batch", batch), ("context", context)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive integer or None, got {prefill_chunk!r}")
    s, f32 = _itemsize(dtype), 4
    counts = param_counts(cfg)
    e = s if expert_dtype is None else _itemsize(expert_dtype)
    narrow = counts.total - counts.fp32 - counts.routed_experts - counts.router
    # the router in fp32 (or wider), plus the bf16 copy `model.layers.Router.pack_` keeps of checkpoint values
    router = counts.router * (max(s, f32) + 2)
    weights = narrow * s + counts.routed_experts * e + counts.fp32 * f32 + router

    D, hd, H, d = cfg.hidden_size, cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim
    n_kda, n_mla = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    kda_state = n_kda * H * d * d * f32
    conv_taps = n_kda * (cfg.conv_kernel_size - 1) * 3 * hd * s  # the last W-1 inputs of the q, k and v convs
    state = batch * (kda_state + conv_taps)
    cache = batch * context * n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * s

    # Transients of one forward over n tokens. The caching allocator reuses a layer's buffers for the next,
    # so the peak is the residual stream plus the largest single stage, not their sum.
    n = batch * min(prefill_chunk or context, context)
    A, E, I, k = cfg.num_attention_heads, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_token
    residual = 3 * n * D * f32  # residual, normed input and block output (fp32 to stay an upper bound)
    stages = {
        # packed projections (q|k|v, then f and the output gate: all live through the layer), conv+SiLU outputs,
        # fp32 q/k/g/output, intra-chunk [chunk, chunk] matrices (two per head)
        "kda": n * (8 * hd * s + 4 * hd * f32 + 2 * H * KDA_CHUNK * f32),
        # q and output for the new tokens; keys and values up-projected from the latent for the whole context
        "mla": n * A * (cfg.qk_head_dim + cfg.v_head_dim) * s
               + batch * context * A * (cfg.qk_nope_head_dim + cfg.qk_head_dim + cfg.v_head_dim) * s,
        # router scores (raw and biased), per routed token gate|up, activation and output, shared expert
        "moe": n * (2 * E * f32 + k * (3 * I + D) * s + 3 * I * s),
        "dense": n * 3 * cfg.intermediate_size * s,
        "logits": n * cfg.vocab_size * (s + f32),  # lm_head output and its fp32 copy
        # the load, before any forward: one tensor at a time beside the allocated weights, at most 4 bytes a value
        # of the largest (a synthetic weight's fp32 scratch, unless it is fp32 itself; a checkpoint tensor in its
        # stored dtype and its finiteness mask). The gates' short runs peak here (docs/RESULTS.md, memory gate)
        "load": max(math.prod(slot.shape) for slot in layout(cfg)[0].values()) * f32,
    }
    context_allowance = CUDA_CONTEXT_BYTES if str(device).startswith("cuda") else 0
    workspace = residual + max(stages.values()) + context_allowance
    return Projection(int(weights), int(state), int(cache), int(workspace))


# ---- before: the floor check -------------------------------------------------------------------

@dataclass(frozen=True)
class FloorDecision:
    ok: bool
    free_before: int
    free_after_projected: int
    floor: int
    message: str


def check_floor(projection: Projection, floor_bytes: int, reading: MemReading) -> FloorDecision:
    """Refuse (ok=False) when the projected peak would leave less free memory than the floor."""
    if reading is None:
        raise ValueError("no memory reading (no GPU/NVML): the floor cannot be checked; skip the run with that reason")
    if floor_bytes < 0:
        raise ValueError(f"floor_bytes must be >= 0, got {floor_bytes}")
    after = reading.free - projection.total
    ok = after >= floor_bytes
    message = (f"memory floor {'OK' if ok else 'REFUSED'}: free {gib(reading.free)} ({reading.source}) - "
               f"{projection.describe()} leaves {gib(after)} {'>=' if ok else '<'} floor {gib(floor_bytes)}")
    return FloorDecision(ok, reading.free, after, floor_bytes, message)


# ---- during: the sampler -----------------------------------------------------------------------

class MemoryFloorError(RuntimeError):
    """Free device memory fell under the floor during a run."""


class FloorSampler:
    """Watches free memory on a daemon thread while a run is inside `with FloorSampler(...) as s:`.

    The thread cannot stop the main thread safely in the middle of a CUDA call, so it only records the
    trip (and calls `on_trip(message)` once, from the sampler thread, e.g. to write a record); the run's
    loop calls `s.check()` every step, which raises `MemoryFloorError`. A crossing between two checks is
    caught at the next one, and leaving the `with` block checks once more.
    """

    def __init__(self, floor_bytes: int, interval_s: float = 0.05,
                 reader: Callable[[], MemReading | None] | None = None,
                 on_trip: Callable[[str], None] | None = None, device_index: int = 0):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.floor = floor_bytes
        self.interval_s = interval_s
        self.reader = reader or (lambda: read_device_memory(device_index))
        self.on_trip = on_trip
        self.tripped = threading.Event()
        self.message: str | None = None
        self.min_free: int | None = None
        self.peak_used: int | None = None  # total - free at its largest, whoever the user is
        self.samples = 0
        self.error: BaseException | None = None  # a sampler that cannot read no longer guards anything
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-floor-sampler", daemon=True)

    def _sample(self) -> None:
        r = self.reader()
        if r is None:
            raise RuntimeError("memory reader returned None (no GPU/NVML): the floor cannot be watched")
        self.samples += 1
        self.min_free = r.free if self.min_free is None else min(self.min_free, r.free)
        self.peak_used = r.used if self.peak_used is None else max(self.peak_used, r.used)
        if r.free < self.floor and not self.tripped.is_set():
            self.message = (f"memory floor crossed: free {gib(r.free)} ({r.source}) < floor {gib(self.floor)}"
                            f" after {self.samples} samples")
            self.tripped.set()
            if self.on_trip is not None:
                self.on_trip(self.message)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self._sample()
        except BaseException as e:  # surfaced in the main thread by check()
            self.error = e

    def check(self) -> None:
        """Raise in the caller's thread if the floor was crossed (or the sampler broke) since the start."""
        if self.tripped.is_set():
            failed = f"; on_trip failed: {self.error!r}" if self.error is not None else ""
            raise MemoryFloorError(self.message + failed) from self.error
        if self.error is not None:
            raise RuntimeError(f"memory floor sampler stopped: {self.error!r}") from self.error

    def __enter__(self) -> "FloorSampler":
        self._sample()  # a run that starts under the floor trips before its first step
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self.check()


# ---- after: the audit --------------------------------------------------------------------------

@dataclass(frozen=True)
class AuditResult:
    ok: bool
    ratio: float  # measured / projected
    message: str


def audit(measured_peak_bytes: int, projection: Projection, tolerance: float = 0.10) -> AuditResult:
    """Fail when the measured peak exceeds the projection by more than `tolerance`: the projection was wrong.

    Measure what the projection covers: the run's own usage, e.g. the sampler's `peak_used` minus the used
    memory read before loading (it includes the CUDA context, which torch.cuda.max_memory_allocated misses).
    """
    if measured_peak_bytes < 0:
        raise ValueError(f"measured_peak_bytes must be >= 0, got {measured_peak_bytes}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    ratio = measured_peak_bytes / projection.total
    ok = ratio <= 1 + tolerance
    message = (f"memory audit {'OK' if ok else 'FAILED'}: measured peak {gib(measured_peak_bytes)} is "
               f"{ratio:.3f}x the {projection.describe()} (allowed up to {1 + tolerance:.2f}x)")
    return AuditResult(ok, ratio, message)

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
from typing import Callable, Sequence

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
# What NCCL holds beside the tensors on each rank of a run over several GPUs: its communicator's buffers (4 MiB per
# channel and peer by default, up to 32 channels over NVLink, both directions) and its proxy's; an upper bound.
NCCL_BYTES = 1 * GiB
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


def nvml_index(torch_index: int) -> int:
    """The NVML index of torch's CUDA device `torch_index`: they differ where CUDA_VISIBLE_DEVICES hides or reorders
    GPUs (NVML sees them all)."""
    try:
        return int(torch.cuda._get_nvml_device_index(torch_index))
    except Exception:  # no such function in this torch, or a CUDA_VISIBLE_DEVICES it cannot map: torch's own order
        return torch_index


def visible_gpu_memory() -> list[MemReading | None]:
    """NVML's reading of each GPU torch sees, in torch's order (empty without CUDA)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [read_device_memory(nvml_index(i)) for i in range(n)]


# nvidia-smi's names for how far apart two GPUs are on PCIe (NVML's topology levels)
PCIE_PATHS = {0: "same board", 10: "PIX (one PCIe switch)", 20: "PXB (several PCIe switches)",
              30: "PHB (a PCIe host bridge)", 40: "NODE (host bridges of one NUMA node)",
              50: "SYS (across NUMA nodes)"}


def gpu_links(torch_indices: Sequence[int]) -> dict | None:
    """Each GPU's name and active NVLinks, and the link between each pair, as NVML reports them: `NVLink` where
    NVML says the pair can reach each other over NVLink, else the PCIe path between them. None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(nvml_index(i)) for i in torch_indices]
        gpus = []
        for rank, (i, h) in enumerate(zip(torch_indices, handles)):
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append({"rank": rank, "cuda": i, "nvml_index": nvml_index(i),
                         "name": name.decode() if isinstance(name, bytes) else name, "nvlinks": _active_nvlinks(h)})
        links = []
        for a in range(len(handles)):
            for b in range(a + 1, len(handles)):
                links.append({"ranks": [a, b], "link": _pair_link(pynvml, handles[a], handles[b])})
    except Exception:  # no library, no driver, no such device
        return None
    return {"gpus": gpus, "links": links}


def _active_nvlinks(handle) -> int:
    import pynvml

    n = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            n += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
        except pynvml.NVMLError:  # a link this GPU does not have, or no NVLink at all
            pass
    return n


def _pair_link(pynvml, a, b) -> str:
    try:
        if pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK:
            return "NVLink"
    except pynvml.NVMLError:
        pass
    try:
        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    except pynvml.NVMLError:
        return "PCIe (path unknown)"
    return f"PCIe {PCIE_PATHS.get(int(level), f'topology level {int(level)}')}"


def describe_links(links: dict | None) -> str:
    """One line: each rank's GPU and the links between them (`gpu_links`)."""
    if links is None:
        return "GPUs unknown (no NVML)"
    gpus = ", ".join(f"rank {g['rank']} cuda:{g['cuda']} {g['name']}" for g in links["gpus"])
    kinds = sorted({x["link"] for x in links["links"]})
    pairs = (f"all pairs {kinds[0]}" if len(kinds) == 1 else
             "; ".join(f"{x['ranks'][0]}-{x['ranks'][1]} {x['link']}" for x in links["links"]))
    nvlinks = sorted({g["nvlinks"] for g in links["gpus"]})
    return f"{gpus}; {pairs}" + (f" ({'/'.join(map(str, nvlinks))} active NVLinks a GPU)" if nvlinks != [0] else "")


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
    workspace_bytes: int  # largest transient buffers of one forward, plus the CUDA context (and NCCL) allowance
    world: int = 1  # ranks the routed experts are split over; the bytes are one rank's

    @property
    def total(self) -> int:
        return self.weights_bytes + self.state_bytes + self.cache_bytes + self.workspace_bytes

    def describe(self) -> str:
        each = "" if self.world == 1 else f" a rank of {self.world}"
        return (f"projected peak {gib(self.total)}{each} = weights {gib(self.weights_bytes)} + states "
                f"{gib(self.state_bytes)} + caches {gib(self.cache_bytes)} + workspace {gib(self.workspace_bytes)}")


def check_world(world, num_experts: int, what: str = "--world") -> int:
    """A number of ranks the routed experts split over evenly (`model.parallel.ExpertParallel`)."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{what} must be a positive integer, got {world!r}")
    if num_experts % world:
        raise ValueError(f"{what} {world}: the {num_experts} routed experts do not split evenly over {world} ranks; "
                         f"use one of {', '.join(map(str, world_sizes(num_experts)))}")
    return world


def world_sizes(num_experts: int) -> list[int]:
    """The numbers of ranks that split `num_experts` routed experts evenly."""
    return [n for n in range(1, num_experts + 1) if num_experts % n == 0]


def project_peak(cfg: KimiConfig, dtype, batch: int, context: int, prefill_chunk: int | None = None,
                 *, device: str = "cuda", expert_dtype=None, world: int = 1) -> Projection:
    """Peak memory of serving `batch` sequences of up to `context` tokens, prefilling `prefill_chunk` at a time,
    the model in `dtype` with its routed experts in `expert_dtype` (default: `dtype`), on one of `world` ranks:
    each holds 1/world of the routed experts and the rest whole (`model.parallel`), and computes every slot of its
    tokens, so only the experts' weights divide.

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
    check_world(world, cfg.num_experts, "world")
    s, f32 = _itemsize(dtype), 4
    counts = param_counts(cfg)
    e = s if expert_dtype is None else _itemsize(expert_dtype)
    narrow = counts.total - counts.fp32 - counts.routed_experts - counts.router
    # the router in fp32 (or wider), plus the bf16 copy `model.layers.Router.pack_` keeps of checkpoint values
    router = counts.router * (max(s, f32) + 2)
    weights = narrow * s + counts.routed_experts // world * e + counts.fp32 * f32 + router

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
        # router scores (raw and biased), per routed token gate|up, activation and output, shared expert; over
        # several ranks the partial output's fp32 copy that the all_reduce sums
        "moe": n * (2 * E * f32 + k * (3 * I + D) * s + 3 * I * s + (D * f32 if world > 1 else 0)),
        "dense": n * 3 * cfg.intermediate_size * s,
        "logits": n * cfg.vocab_size * (s + f32),  # lm_head output and its fp32 copy
        # the load, before any forward: one tensor at a time beside the allocated weights, at most 4 bytes a value
        # of the largest (a synthetic weight's fp32 scratch, unless it is fp32 itself; a checkpoint tensor in its
        # stored dtype and its finiteness mask). The gates' short runs peak here (docs/RESULTS.md, memory gate)
        "load": max(math.prod(slot.shape) for slot in layout(cfg)[0].values()) * f32,
    }
    cuda = str(device).startswith("cuda")
    context_allowance = (CUDA_CONTEXT_BYTES + (NCCL_BYTES if world > 1 else 0)) if cuda else 0
    workspace = residual + max(stages.values()) + context_allowance
    return Projection(int(weights), int(state), int(cache), int(workspace), world)


# ---- how many GPUs: the default number of ranks -----------------------------------------------------------

class WorldRefused(ValueError):
    """No number of the box's GPUs holds the model with the floor; the message says what would."""


def _gibs(free: Sequence[int]) -> str:
    shown = [f"{f / GiB:.1f}" for f in free]
    if len(set(shown)) == 1:
        return f"{len(free)} x {shown[0]} GiB free"
    return f"{len(free)} GPUs with {', '.join(shown)} GiB free"


def choose_world(what: str, need: Callable[[int], int], num_experts: int, free: Sequence[int]) -> tuple[int, str]:
    """The number of ranks a run spreads over, from each visible GPU's free memory (`free`, in torch's order: rank r
    runs on GPU r) and `need(world)`, one rank's projected peak plus the floor: 1 where GPU 0 holds the model, else
    the smallest world that splits the experts evenly, fits the GPUs there are, and leaves each of its GPUs the
    floor. Returns (world, why); raises WorldRefused, saying what would hold it, where none does."""
    if not free:
        raise ValueError("no GPU memory readings to choose the number of ranks from")
    one = need(1)
    for world in world_sizes(num_experts):
        if world > len(free):
            break
        if all(f >= need(world) for f in free[:world]):
            if world == 1:
                return 1, f"{what} needs {gib(one)} with the floor; GPU 0 has {gib(free[0])} free"
            return world, (f"{what} needs {gib(one)} with the floor in one process, {gib(need(world))} a rank over "
                           f"{world}; this box has {_gibs(free)}")
    best = max(free)
    would = next((w for w in world_sizes(num_experts) if need(w) <= best), None)
    have = f"{what} needs {gib(one)} with the floor; this box has {_gibs(free)}"
    if would is None:
        floor = need(num_experts)
        raise WorldRefused(f"{have}; no number of such GPUs would hold it: even over {num_experts} ranks each needs "
                           f"{gib(floor)} with the floor")
    if would <= len(free):
        raise WorldRefused(f"{have}; over {would} ranks each needs {gib(need(would))} with the floor, more than "
                           f"GPUs 0..{would - 1} have free (rank r runs on GPU r; CUDA_VISIBLE_DEVICES picks them)")
    raise WorldRefused(f"{have}; {would} such GPUs would hold it ({gib(need(would))} each with the floor)")


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

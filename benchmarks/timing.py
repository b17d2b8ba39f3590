"""Timing helpers shared by the benchmarks: per-step latencies with CUDA events, whole-call times, summaries,
and progress lines for unattended runs.

On a CUDA device the times come from CUDA events recorded on the current stream, so they measure what the GPU
did between two points of the host's launch sequence (including the gaps where it waited for the host); on a
CPU they come from the host clock, which is the same thing there. On CUDA the GPU's clocks are sampled over the
timed calls (`Samples.clocks`, `benchmarks.gpu_clocks`): a compute-bound run on the H200 can sit at its 700 W
power cap with the SM clock well under its maximum, and a timing should say so.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from benchmarks.gpu_clocks import ClockSampler, summarize_clocks

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line with the seconds since the process started, flushed at once (the run is read live)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Samples:
    """Latencies of consecutive calls: `samples_ms[i]` is call i; `total_ms` runs from the start of the first
    call to the end of the last (so it also counts whatever ran between calls)."""
    samples_ms: list[float]
    total_ms: float
    clocks: dict | None = None  # the GPU's clocks over the timed calls (`benchmarks.gpu_clocks`); None without NVML
    # `time_calls` on CUDA: the host's time inside each call, from before its first launch until the call returned
    # (no wait for the GPU; the device idle at the start). A call whose host time comes close to its GPU time was
    # paced by the host (`host_paced`). Not kept for back-to-back steps (`time_steps`): there a host that runs
    # ahead blocks once the launch queue is full, and its time per step tends to the GPU's whatever paced it.
    host_ms: list[float] | None = None

    def __post_init__(self):
        if not self.samples_ms:
            raise ValueError("no samples: at least one timed call is needed")

    @property
    def per_s(self) -> float:
        """Calls per second over the whole span."""
        return 1000.0 * len(self.samples_ms) / self.total_ms

    def summary(self) -> dict:
        return summarize(self.samples_ms)

    def host_paced(self) -> int | None:
        """How many calls the host paced: its time inside the call was at least HOST_PACED of the GPU's. Such a
        call measures the host (its launch overhead, or a slow spell of its CPU) as much as the GPU: an eager 1k
        prefill of the 48B model on the H200 keeps only a few ms ahead of the GPU, and its slow calls are the ones
        the host paced (docs/RESULTS.md, "Reading a prefill record"). None off CUDA."""
        if self.host_ms is None:
            return None
        return sum(h >= HOST_PACED * g for h, g in zip(self.host_ms, self.samples_ms))


def summarize(samples_ms: list[float]) -> dict:
    a = np.asarray(samples_ms, dtype=float)
    if a.size == 0:
        raise ValueError("no samples to summarize")
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return {"median_ms": float(med), "p10_ms": float(p10), "p90_ms": float(p90)}


HOST_PACED = 0.95  # `Samples.host_paced`: host time / GPU time at or above which a call counts as host-paced
CLOCK_INTERVAL_S = 0.01  # NVML sampling period while calls are timed
# Where the clocks are sampled (`benchmarks.gpu_clocks.WHERE`): in a child process, so that the timed process spends
# none of its time on it; `benchmarks.bench_ab` can time "thread" and "off" against it (a variant of this CONFIG,
# changed for a block by `configured`; read-only otherwise).
_DEFAULTS = types.MappingProxyType(dict(clocks="process"))
_scoped: contextvars.ContextVar[Mapping] = contextvars.ContextVar("timing_config", default=_DEFAULTS)


class _Config(Mapping):
    """The timing config as it reads in this thread or task: the defaults, or as an enclosing `configured` set it."""

    def __getitem__(self, k):
        return _scoped.get()[k]

    def __iter__(self):
        return iter(_scoped.get())

    def __len__(self) -> int:
        return len(_scoped.get())


CONFIG = _Config()


@contextlib.contextmanager
def configured(changes: Mapping):
    """CONFIG with `changes` (keys it has) inside the block, in this thread or task; as before after it."""
    unknown = sorted(set(changes) - set(_DEFAULTS))
    if unknown:
        raise KeyError(f"benchmarks.timing.CONFIG: unknown keys {unknown}; its keys: {sorted(_DEFAULTS)}")
    token = _scoped.set(types.MappingProxyType({**_scoped.get(), **changes}))
    try:
        yield
    finally:
        _scoped.reset(token)


def clock_sampler(device) -> ClockSampler:
    return ClockSampler(torch.device(device).index or 0, CLOCK_INTERVAL_S, CONFIG["clocks"])


def time_steps(step: Callable[[], object], n: int, device) -> Samples:
    """Run `step()` n times back to back and time each call. On CUDA nothing waits for the GPU between
    calls (events are read after the last one), so the host runs ahead exactly as in a real decode loop."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if torch.device(device).type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        with clock_sampler(device) as clocks:
            for s, e in zip(starts, ends):
                s.record()
                step()
                e.record()
            ends[-1].synchronize()
        return Samples([s.elapsed_time(e) for s, e in zip(starts, ends)], starts[0].elapsed_time(ends[-1]),
                       clocks.summary())
    stamps = [time.perf_counter()]
    for _ in range(n):
        step()
        stamps.append(time.perf_counter())
    ms = [1000.0 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return Samples(ms, 1000.0 * (stamps[-1] - stamps[0]))


def time_calls(fn: Callable[[], object], reps: int, device, setup: Callable[[], object] | None = None) -> Samples:
    """Time `reps` separate calls of `fn`, each from an idle device to its end; `setup()` runs untimed before
    each call (e.g. a fresh cache for a prefill)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    ms, host, rows, limits, where = [], [], [], {}, None
    for _ in range(reps):
        if setup is not None:
            setup()
        sync(device)
        if torch.device(device).type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with clock_sampler(device) as clocks:
                t = time.perf_counter()
                s.record()
                fn()
                e.record()
                host.append(1000.0 * (time.perf_counter() - t))
                e.synchronize()
            ms.append(s.elapsed_time(e))
            rows += clocks.rows
            limits = clocks.limits
            where = clocks.where
        else:
            t = time.perf_counter()
            fn()
            ms.append(1000.0 * (time.perf_counter() - t))
    return Samples(ms, float(sum(ms)), summarize_clocks(rows, limits, where) if rows else None, host or None)

"""The memory gate: project, refuse under the floor, run under the sampler, audit the measured peak.

1. Project the peak of Gate A's workload (the battery on both paths, batch 1) with `project_peak`.
2. Read free device memory (NVML). No reading (no GPU, or `--device cpu`): SKIP, with the reason; exit 0,
   never PASS. Projected peak leaving less than the floor free: REFUSED, nothing is loaded.
3. Load and run the battery on both paths under a `FloorSampler`; its `check()` runs every step, so a
   crossing aborts the run cleanly (FAIL, decision 'tripped').
4. Audit. Measured peak = max(NVML used delta, torch.cuda.max_memory_allocated):
   - the NVML delta (the sampler's peak used memory minus the used memory read before loading) is what the
     projection models: tensors, the caching allocator's slack and the CUDA context. It is sampled every
     50 ms, so a short spike can fall between samples, and on a shared GPU other processes count too;
   - max_memory_allocated is exact for our tensors but misses the context and the allocator's slack;
   the larger of the two is audited (an upper bound the sampler cannot miss); both are recorded.
   The gate fails when the audited peak exceeds the projection by more than 10%.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from model import ops
from model.generate import generate_incremental, generate_recompute

from .memory import FloorSampler, MemoryFloorError, MemReading, audit, check_floor, project_peak, read_device_memory
from .run import EXIT_FAIL, EXIT_PASS, EXIT_REFUSED, Options, battery_for, context_len, load_subject, record


def run_memory_gate(opts: Options, *, reader: Callable[[], MemReading | None] | None = None, records_root=None,
                    log=print) -> int:
    """Run the memory gate, print its decision, append a `memory` record; returns the exit code.

    `reader`: the device memory reader (default NVML for the current CUDA device; none on `--device cpu`).
    """
    b = battery_for(opts)
    projection = project_peak(opts.config, opts.torch_dtype, 1, context_len(b, opts.new_tokens), device=opts.device)
    if reader is None and opts.device == "cuda":
        reader = lambda: read_device_memory(torch.cuda.current_device())
    before = reader() if reader is not None else None
    results = {"projected_bytes": projection.total, "projection": projection.describe(),
               "floor_bytes": opts.floor_bytes, "measured_peak_bytes": None, "min_free_bytes": None, "audit": None}

    def finish(decision: str, passed, reasons: list[str], weights=None, code=EXIT_FAIL) -> int:
        path = record("memory", opts, weights, {"prompt_ids_source": b.source, "context": context_len(b, opts.new_tokens)},
                      {**results, "decision": decision, "passed": passed}, reasons=reasons, records_root=records_root)
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[passed] if decision != "refused" else "REFUSED"
        log(f"Memory gate {verdict} ({decision}): {'; '.join(reasons)} [record {path}]")
        return code

    if before is None:
        why = ("device is cpu: no device memory to guard" if opts.device == "cpu"
               else "no NVML reading of the GPU: the floor cannot be checked")
        return finish("skipped", None, [f"skipped: {why}"], code=EXIT_PASS)
    floor = check_floor(projection, opts.floor_bytes, before)
    results["free_before_bytes"] = floor.free_before
    log(floor.message)
    if not floor.ok:
        return finish("refused", False, [floor.message], code=EXIT_REFUSED)

    cuda = opts.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    weights = None
    sampler = FloorSampler(opts.floor_bytes, reader=reader)
    try:
        with sampler, ops.use(opts.kernels):
            subject = load_subject(opts)
            weights = subject.weights
            for ids in b.ids:
                generate_recompute(subject.model, ids, opts.new_tokens, step_hook=sampler.check)
                generate_incremental(subject.model, ids, opts.new_tokens, step_hook=sampler.check)
            if cuda:
                torch.cuda.synchronize()
    except MemoryFloorError as e:
        results["min_free_bytes"] = sampler.min_free
        return finish("tripped", False, [str(e)], weights)
    nvml_delta = sampler.peak_used - before.used
    torch_peak = torch.cuda.max_memory_allocated() if cuda else None
    measured = max(nvml_delta, torch_peak or 0)
    a = audit(measured, projection)
    results.update(measured_peak_bytes=measured, nvml_used_delta_bytes=nvml_delta, torch_max_allocated_bytes=torch_peak,
                   min_free_bytes=sampler.min_free, samples=sampler.samples, run_s=time.perf_counter() - t0,
                   audit={"ok": a.ok, "ratio": a.ratio, "message": a.message})
    log(a.message)
    return finish("ran", a.ok, [a.message], weights, EXIT_PASS if a.ok else EXIT_FAIL)

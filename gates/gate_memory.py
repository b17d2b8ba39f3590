"""The memory gate: project, refuse under the floor, run under the sampler, audit the measured peak.

1. Project the peak of the gates' workload (the battery on both paths, batch 1) at this run's precision (its
   own default: bf16 on CUDA; `--dtype fp32 --expert-dtype bf16` is Gate A's) with `project_peak`. Gate A and
   Gate B guard their own runs with the same floor (`gates.run.floor_guard`).
2. Read free device memory (NVML). No reading (no GPU, or `--device cpu`): SKIP, with the reason; exit 0,
   never PASS. Projected peak leaving less than the floor free: REFUSED, nothing is loaded.
3. Load and run the battery on both paths under a `FloorSampler`; its `check()` runs every step, so a
   crossing aborts the run cleanly (FAIL, decision 'tripped').
4. Audit: FAIL when the measured peak exceeds the projection by more than 10%.
   Measured peak = max(NVML used delta, torch.cuda.max_memory_allocated), and both are recorded:
   - the NVML delta (the sampler's peak used memory minus the used memory read before loading) covers what
     the projection models: tensors, the caching allocator's slack, cuBLAS workspaces. It is sampled every
     50 ms, so a short spike can fall between samples, and on a shared GPU other processes count too. The
     CUDA context itself is not in it: it exists before the first reading (creating it is how torch names
     the GPU to read), so the audit errs towards passing by the context's size (~0.5 GiB);
   - max_memory_allocated is exact for our tensors but misses the allocator's slack and the workspaces;
   the larger of the two cannot be missed by the sampling.

Over several ranks (`--world`) each rank projects its own share (`project_peak(..., world=)`: the routed experts
divided, the rest whole), reads, watches and audits its own GPU; the ranks skip, refuse or stop together, and
rank 0 records the worst rank's figures with every rank's under `results.ranks`.
"""
from __future__ import annotations

import functools
import time
from typing import Callable

import torch

from model import ops
from model.generate import generate_incremental, generate_recompute

from .memory import FloorSampler, MemoryFloorError, MemReading, audit, check_floor, project_peak
from .run import (EXIT_FAIL, EXIT_PASS, EXIT_REFUSED, Options, battery_for, check_every_rank, context_len,
                  cuda_reader, gather, group_rank, group_size, load_subject, record, shown_record, to_stderr)


def run_memory_gate(opts: Options, *, reader: Callable[[], MemReading | None] | None = None, records_root=None,
                    log=print) -> int:
    """Run the memory gate, print its decision, append a `memory` record; returns the exit code.

    `reader`: the device memory reader (default: NVML for the CUDA device in use; none on `--device cpu`).
    """
    b = battery_for(opts)
    context = context_len(b, opts.new_tokens)
    projection = project_peak(opts.config, opts.torch_dtype, 1, context, device=opts.device,
                              expert_dtype=opts.torch_expert_dtype, world=opts.world)
    if reader is None and opts.device == "cuda":
        reader = cuda_reader()
    results = {"projected_bytes": projection.total, "projection": projection.describe(),
               "floor_bytes": opts.floor_bytes, "free_before_bytes": None, "min_free_bytes": None,
               "measured_peak_bytes": None, "audit": None}
    weights = None

    def finish(verdict: str, decision: str, passed: bool | None, reason: str, code: int) -> int:
        path = record("memory", opts, weights, {"prompt_ids_source": b.source, "context": context},
                      {**results, "decision": decision, "passed": passed}, reasons=[reason], records_root=records_root)
        said = "" if decision[:4] == verdict.lower()[:4] else f" ({decision})"     # not "SKIP (skipped)"
        say = to_stderr if code == EXIT_REFUSED and log is print else log
        say(f"Memory gate {verdict}{said}: {reason} [record {shown_record(path)}]")
        return code

    many = group_size() > 1
    name = (lambda r: f"rank {r}: ") if many else (lambda r: "")
    before = reader() if reader is not None else None
    befores = gather(before)
    if any(x is None for x in befores):
        unread = [r for r, x in enumerate(befores) if x is None]
        why = ("device is cpu: no device memory to guard" if opts.device == "cpu"
               else "no NVML reading of the GPU" + (f" of rank {', '.join(map(str, unread))}" if many else "")
               + ": the floor cannot be checked")
        return finish("SKIP", "skipped", None, why, EXIT_PASS)
    results["free_before_bytes"] = min(x.free for x in befores)
    floor = check_floor(projection, opts.floor_bytes, before)
    floors = gather((floor.ok, floor.message))
    for r, (_, message) in enumerate(floors):
        log(name(r) + message)
    if not all(ok for ok, _ in floors):
        return finish("REFUSED", "refused", False,
                      "; ".join(name(r) + message for r, (ok, message) in enumerate(floors) if not ok), EXIT_REFUSED)

    cuda = opts.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    sampler = FloorSampler(opts.floor_bytes, reader=reader)
    check = functools.partial(check_every_rank, sampler) if many else sampler.check
    try:
        with sampler, ops.use(opts.kernels):
            subject = load_subject(opts)
            weights = subject.weights
            for ids in b.ids:
                generate_recompute(subject.model, ids, opts.new_tokens, step_hook=check)
                generate_incremental(subject.model, ids, opts.new_tokens, step_hook=check)
            if cuda:
                torch.cuda.synchronize()
            if many:
                check()  # a trip after the last step stops every rank
    except MemoryFloorError as e:
        results["min_free_bytes"] = sampler.min_free
        return finish("FAIL", "tripped", False, str(e), EXIT_FAIL)
    nvml_delta = sampler.peak_used - before.used
    torch_peak = torch.cuda.max_memory_allocated() if cuda else None
    measured = max(nvml_delta, torch_peak or 0)
    a = audit(measured, projection)
    rank = group_rank()
    mine = dict(rank=rank, free_before_bytes=before.free, min_free_bytes=sampler.min_free,
                measured_peak_bytes=measured, nvml_used_delta_bytes=nvml_delta, torch_max_allocated_bytes=torch_peak,
                samples=sampler.samples, audit={"ok": a.ok, "ratio": a.ratio, "message": name(rank) + a.message})
    ranks = gather(mine)
    worst = max(ranks, key=lambda x: x["audit"]["ratio"])
    ok = all(x["audit"]["ok"] for x in ranks)
    results.update({k: v for k, v in worst.items() if k not in ("rank", "free_before_bytes")},
                   min_free_bytes=min(x["min_free_bytes"] for x in ranks), run_s=time.perf_counter() - t0)
    if many:
        results["ranks"] = ranks
    return finish("PASS" if ok else "FAIL", "ran", ok, worst["audit"]["message"], EXIT_PASS if ok else EXIT_FAIL)

"""Where a decode step's (or a prefill's) time goes: a PyTorch-profiler trace, kernels mapped to categories.

    python -m benchmarks.decompose [--preset 48b-a3b] [--steps 32] [--context 1024] [--modes eager,graph] [--quick]
    python -m benchmarks.decompose --phase prefill [--context 8192] [--steps 2]

`--phase prefill` traces `--steps` prefills of a random `--context`-token prompt, each from a fresh cache (its
allocation included, as a new request would pay it), eager; the record's `step_ms` is then ms per prefill and
`params.phase` says `prefill`. `--variant NAME=MODULE:JSON` traces with a launch config changed
(`benchmarks.bench_ab`), recorded as `params.variant`, to see where a variant's time goes inside the model. The
rest of this text is about the default, `--phase decode`.

A random prompt of `--context` tokens is prefilled, then each mode decodes greedily: `eager` is
`model.decode_step` launched op by op from Python, `graph` the CUDA-graph decoder (`model.fast.GraphDecoder`).
After warm-up, the steps are timed once with CUDA events and no profiler (`step_ms_unprofiled`), then traced
with torch.profiler (CPU + CUDA activity). The trace's GPU kernel, memcpy and memset events go through
`benchmarks.categories.decompose`: per-category shares of kernel time, the GPU idle fraction between kernels,
the time per step. On a CPU (`--quick`) there are no kernels: the innermost profiled operators (leaf
`cpu_op` events) stand in for them.

Kernels replayed from a CUDA graph are not reported individually by every torch/CUPTI version. When the
graph trace holds fewer kernels per step than the model has layers, the graph record is INVALID and says so,
and the eager record (traced in the same run by default) is the one whose categories to read. The eager trace
includes the profiler's own host overhead, so its idle fraction is an upper bound; `step_ms_unprofiled` is not.

The reduced trace (GPU events and CUDA runtime calls; CPU operators on a CPU) is written gzipped to
`reports/traces/`, one file per mode, and one `decomposition` record per mode is appended; eager first, so
the graph record, the production path, is the latest.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import sys
import tempfile
import traceback
import uuid
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from benchmarks import bench_ab
from benchmarks.categories import categorize, decompose
from benchmarks.timing import log, summarize, sync, time_steps
from records import store
from records.exits import run_main

REPO_ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "graph")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
TRACE_KEEP = {"cuda": set(GPU_CATS) | {"cuda_runtime", "cuda_driver", "user_annotation", "gpu_user_annotation"},
              "cpu": {"cpu_op", "user_annotation"}}
PROFILER_WAIT, PROFILER_WARMUP = 1, 2  # steps the profiler skips, then traces but discards, before the active ones
WARMUP_STEPS = 4
PREFILL_WARMUP = 2  # prefills before timing: Triton compiles, cuBLAS / cutlass pick their kernels
TOP_KERNELS = 15


def self_time_ops(events: list[dict]) -> list[dict]:
    """CPU operators' own time: each operator as the parts of its span that none of its children covers (ops nest
    properly within a thread), so that time spent in an operator's body counts even where it also calls a trivial
    child. (Innermost operators alone missed it: in torch 2.13 a CPU aten::mm's only child is a sub-microsecond
    aten::resolve_conj, and the matmul's own time was dropped.) The parts never overlap within a thread and sum to
    the thread's outermost operators' time."""
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    parts = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, where its uncovered time resumes]

        def close(upto):  # pop the operators that end by `upto`, each with its last uncovered part
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= upto:
                e, t = stack.pop()
                end = e["ts"] + e["dur"]
                if end > t:
                    parts.append({**e, "ts": t, "dur": end - t})
                if stack:
                    stack[-1][1] = end
        for e in evs:
            close(e["ts"])
            if stack:  # e is a child: its parent's part up to here is the parent's own time
                p = stack[-1]
                if e["ts"] > p[1]:
                    parts.append({**p[0], "ts": p[1], "dur": e["ts"] - p[1]})
            stack.append([e, e["ts"]])
        close(float("inf"))
    return parts


def trace_events(trace: dict, device_type: str) -> list[dict]:
    """The events that stand for device work: GPU kernels/copies/fills on CUDA, operators' own time on a CPU."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if device_type == "cuda":
        return [e for e in evs if e.get("cat") in GPU_CATS]
    return self_time_ops([e for e in evs if e.get("cat") == "cpu_op"])


def top_kernels(events: list[dict], steps: int, excl: list[float], n: int = TOP_KERNELS) -> list[dict]:
    """The n kernels with the most time, with their exclusive time too (excl, per event: `decompose`'s
    `exclusive_us`; a kernel launched early, PDL, loses the part it spent beside the kernel before it)."""
    total = sum(e["dur"] for e in events) or 1.0
    agg = defaultdict(lambda: [0.0, 0, 0.0])
    for e, x in zip(events, excl):
        agg[e["name"]][0] += e["dur"]
        agg[e["name"]][1] += 1
        agg[e["name"]][2] += x
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": name[:200], "category": categorize(name), "us_per_step": us / steps,
             "exclusive_us_per_step": x / steps, "calls_per_step": calls / steps, "share": us / total}
            for name, (us, calls, x) in rows]


def write_trace(trace: dict, device_type: str, path: Path) -> int:
    """The trace reduced to what the decomposition reads (plus host launch calls), gzipped; returns bytes."""
    keep = TRACE_KEEP[device_type]
    small = dict(trace)
    small["traceEvents"] = [e for e in trace.get("traceEvents", []) if e.get("ph") == "M" or e.get("cat") in keep]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", compresslevel=6) as f:
        json.dump(small, f, separators=(",", ":"))
    return path.stat().st_size


def profile_steps(step, steps: int, device) -> dict:
    """Chrome trace (as a dict) of `steps` calls of `step`, after the profiler's own wait and warm-up steps."""
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    total = PROFILER_WAIT + PROFILER_WARMUP + steps
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=activities, schedule=schedule(wait=PROFILER_WAIT, warmup=PROFILER_WARMUP,
                                                              active=steps, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
            for i in range(total):
                step()
                # The window holds exactly the active steps' kernels: the steps before it finish before it opens
                # (a sync-free prefill lets the CPU run ahead, and a warm-up step's kernels would run inside the
                # window and be counted as the active steps'), the last finishes inside it.
                if i in (PROFILER_WAIT + PROFILER_WARMUP - 1, total - 1):
                    sync(device)
                prof.step()
        with open(path) as f:
            return json.load(f)


@torch.no_grad()
def run_mode(model, mode: str, ids: torch.Tensor, steps: int, prefill_chunk: int, device) -> dict:
    """Prefill, warm up, time without the profiler, then trace: returns the trace and the unprofiled samples."""
    T = ids.shape[1]
    cache = model.new_cache(1, T + 1 + WARMUP_STEPS + 2 * steps + PROFILER_WAIT + PROFILER_WARMUP)
    for a in range(0, T, prefill_chunk):
        logits = model.prefill(ids[:, a:a + prefill_chunk], cache)
    if mode == "graph":
        from model.fast import GraphDecoder
        decode = GraphDecoder(model, cache)
    else:
        decode = model.decode_step
    state = {"tok": logits.argmax(-1)}

    def step():
        state["tok"] = decode(state["tok"], cache).argmax(-1)

    for _ in range(WARMUP_STEPS):
        step()
    unprofiled = time_steps(step, steps, device)
    trace = profile_steps(step, steps, device)
    return {"trace": trace, "unprofiled": unprofiled}


@torch.no_grad()
def run_prefill(model, ids: torch.Tensor, steps: int, device) -> dict:
    """Prefills of `ids` from a fresh cache each: warm up, time without the profiler, then trace."""
    def step():
        model.prefill(ids, model.new_cache(ids.shape[0], ids.shape[1]))

    for _ in range(PREFILL_WARMUP):
        step()
    unprofiled = time_steps(step, steps, device)
    trace = profile_steps(step, steps, device)
    return {"trace": trace, "unprofiled": unprofiled}


def summarize_trace(events: list[dict], steps: int, mode: str, layers: int) -> tuple[dict, list[str]]:
    """(results, reasons that make the record INVALID) from one mode's device events."""
    per_step = len(events) / steps
    if mode == "graph" and per_step < layers:
        return {"kernels_per_step": per_step}, [
            f"the profiler attributed {per_step:.1f} kernels per step inside CUDA graph replays, fewer than the "
            f"{layers} layers: this torch/CUPTI does not report graph kernels one by one; the eager record of the "
            f"same run carries the categories"]
    if not events:
        return {"kernels_per_step": 0.0}, ["the trace holds no device events to decompose"]
    d = decompose([(e["name"], e["ts"], e["dur"]) for e in events], steps)
    return {"kernels_per_step": per_step, "shares": d["shares"], "exclusive_shares": d["exclusive_shares"],
            "idle_fraction": d["idle_fraction"],
            "step_ms": d["step_ms"], "kernel_us": d["kernel_us"], "busy_us": d["busy_us"], "wall_us": d["wall_us"],
            "n_kernels": d["n_kernels"], "top_kernels": top_kernels(events, steps, d["exclusive_us"])}, []


def describe(r: dict) -> str:
    shares = sorted(r["shares"].items(), key=lambda kv: -kv[1])
    return (f"{r['kernels_per_step']:.0f} kernels/step, {r['step_ms']:.3f} ms/step traced, "
            f"{r['step_ms_unprofiled']:.3f} ms unprofiled, idle {r['idle_fraction']:.1%}; "
            + ", ".join(f"{k} {v:.1%}" for k, v in shares if v > 0)
            + f"; trace {r['trace']} ({r['trace_bytes'] / 1e6:.1f} MB)")


def graph_unavailable(device) -> str | None:
    if torch.device(device).type != "cuda":
        return "graph mode needs a CUDA device"
    try:
        import model.fast  # noqa: F401
    except ImportError as e:
        return f"model.fast not importable ({e})"
    return None


def main(argv: list[str] | None = None) -> list[dict]:
    from model.build import load_model
    from records.store import append, make_record

    ap = argparse.ArgumentParser(prog="python -m benchmarks.decompose", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny preset on the CPU (smoke test)")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--preset")
    ap.add_argument("--device")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--context", type=int)
    ap.add_argument("--modes", default="eager,graph", help=f"comma-separated subset of {MODES}")
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--trace-dir", default=str(REPO_ROOT / "reports" / "traces"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", type=bench_ab.parse_variant,
                    help="NAME=MODULE:JSON: trace with a launch config changed or a candidate installed "
                         "(see benchmarks.bench_ab)")
    a = ap.parse_args(argv)
    quick = dict(preset="tiny", device="cpu", dtype="float32", steps=4, context=16)
    full = dict(preset="48b-a3b", device="cuda", dtype="bfloat16", steps=32, context=1024)
    if a.phase == "prefill":
        quick, full = dict(quick, steps=2), dict(full, steps=2, context=8192)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes must be a comma-separated subset of {MODES}, got {a.modes!r}")
    if a.steps < 1 or a.context < 1:
        ap.error("--steps and --context must be >= 1")
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --quick (make decompose QUICK=1) for the CPU smoke run")
    device_type = torch.device(a.device).type

    if a.variant:
        try:
            bench_ab.changed_config(*a.variant[1:])  # a typo fails here, before the model is built
        except (KeyError, ImportError) as e:
            ap.error(str(e))

    def variant():  # a fresh context per mode: one made by contextlib.contextmanager runs once
        return bench_ab.applied(*a.variant[1:]) if a.variant else contextlib.nullcontext()
    notes = []
    if a.phase == "prefill":
        modes = ["eager"]  # a prefill is launched op by op; --modes is about decode
    if "graph" in modes and (why := graph_unavailable(a.device)):
        log(f"graph mode not profiled: {why}")
        notes.append(f"graph mode not profiled: {why}")
        modes.remove("graph")
        if not modes:
            ap.error(f"nothing to trace: --modes {a.modes} names graph mode only, and {why}")
    modes.sort(key=MODES.index)  # eager first: the graph record, when there is one, is the latest

    log(f"decompose {a.phase}: {a.preset} {a.dtype} on {a.device}, context {a.context}, {a.steps} steps, "
        f"modes {modes}")
    loaded = load_model(a.preset, device=a.device, dtype=getattr(torch, a.dtype), seed=a.seed)
    model, cfg = loaded.model, loaded.cfg
    log(f"weights {loaded.source} {loaded.weights}")
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + a.context)
    ids = torch.randint(0, cfg.vocab_size, (1, a.context), generator=g).to(a.device)
    run_id = uuid.uuid4().hex[:12]
    records = []
    for mode in modes:
        log(f"{a.phase} {mode}: warm-up, {a.steps} timed steps, {a.steps} profiled steps")
        params = {"phase": a.phase, "mode": mode, "steps": a.steps, "context": a.context, "batch": 1,
                  "device": device_type, "run": run_id}
        if a.variant:
            params["variant"] = dict(zip(("name", "module", "changes"), a.variant))
        def run():
            return run_prefill(model, ids, a.steps, a.device) if a.phase == "prefill" else \
                run_mode(model, mode, ids, a.steps, a.prefill_chunk, a.device)
        reached = None
        try:
            with variant():
                if a.variant:   # counted: a variant no call reaches would trace the defaults under its name
                    got = {}
                    reached = bench_ab.calls_during(a.variant[1], a.variant[2], lambda: got.update(out=run()))
                    out = got["out"]
                else:
                    out = run()
        except Exception as e:  # e.g. a graph capture failing: keep the other mode's record, say what broke
            traceback.print_exc()
            out, results = None, {}
            problems = [f"{mode} {a.phase} could not be traced: {type(e).__name__}: {str(e)[:500]}"]
        if out is not None:
            events = trace_events(out["trace"], device_type)
            name = "prefill" if a.phase == "prefill" else mode
            path = Path(a.trace_dir) / f"decompose_{a.preset}_{name}_ctx{a.context}_{run_id}.json.gz"
            size = write_trace(out["trace"], device_type, path)
            results, problems = summarize_trace(events, a.steps, mode, cfg.num_hidden_layers)
            if reached == 0:
                problems.append(f"the variant {a.variant[0]} reached no call of "
                                f"{bench_ab.config_module(a.variant[1])}: this trace is the defaults' (on a CPU the "
                                f"model runs PyTorch's forms unless KIMI_KERNELS=triton under TRITON_INTERPRET=1)")
            results.update({"step_ms_unprofiled": summarize(out["unprofiled"].samples_ms)["median_ms"],
                            "trace": store.shown_path(path), "trace_bytes": size,
                            "events": "gpu kernels, memcpy, memset" if device_type == "cuda"
                            else "leaf cpu operators (no GPU)"})
        rec = make_record("decomposition", preset=a.preset, dtype=a.dtype, device=a.device,
                          weights=loaded.weights, params=params, results=results,
                          verdict="INVALID" if problems else "VALID", reasons=notes + problems)
        append(rec)
        records.append(rec)
        log(f"{mode}: {rec['verdict']} {describe(results) if not problems else '; '.join(problems)}")
        del out
        gc.collect()
        if device_type == "cuda":
            torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    sys.exit(run_main(main, kinds=('decomposition',)))

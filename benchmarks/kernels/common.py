"""What the kernel benchmarks share: the 48B-A3B's KDA layer shapes, fla as the peer, the clocks (`gpu_ms`,
`eager_ms`, `graph_ms`, `kernel_ms`), the judging of ours against a peer, the `kernel` record and the launch-config
sweep. A bench that cannot hand a kernel its `cfg` changes a kernel module's launch config inside
`model.triton.overrides`; none writes it.

The benchmark modules call the clocks and GRAPH_LAYERS through this module (`common.gpu_ms(...)`), so that a test's
fake clock reaches every caller, `time_peer` and `sweep` included.
"""
from __future__ import annotations

import os
import traceback
from collections.abc import Mapping

import torch

import model.triton as mt
from benchmarks.kernels.spec import Size
from benchmarks.timing import log

H, D, W = 32, 128, 4  # the 48B-A3B's KDA layers: heads, head dim, conv taps
DTYPE = torch.bfloat16
PEER = "fla-0.6.0"
PEER_TOL = 2e-2  # bf16 outputs of two fp32-accumulating implementations of the same math

# the token counts of the prefill benches, one option for all of them
PREFILL_T = Size("--prefill-T", (8192,),
                 "token counts for the causal_conv1d, moe_combine, moe_prefill_rows and moe_prefill cases")


def rel_err(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return float((ref - x).norm() / ref.norm().clamp_min(1e-300))


def load_fla():
    """((chunk_kda, fused_recurrent_kda, version), None) from fla, or (None, why)."""
    os.environ.setdefault("FLA_FLASH_KDA", "0")  # read by fla when imported: its Triton path, SPEC.md §2
    try:
        import fla
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # any import failure means: no peer in this run
        return None, f"peer unavailable: import fla failed: {type(e).__name__}: {e}"
    return (chunk_kda, fused_recurrent_kda, getattr(fla, "__version__", "unknown")), None


def gpu_ms(fn, rep_ms: int) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def eager_ms(fn, n: int = 200) -> float:
    """Mean time per call of n calls issued back to back: includes the host's launch cost when it dominates."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def kernel_ms(fn, device: str = "cuda", n: int = 50) -> float:
    """Device busy time per call by the PyTorch profiler: the durations of every kernel, copy and fill that n calls
    launch, summed, over n (on a CPU, its operators' own time). Unlike graph_ms it leaves out the gaps between
    launches, and one call's inputs stay warm in L2 for the next: what the kernels themselves take, which tells a
    slower kernel from a costlier launch sequence."""
    from benchmarks.decompose import profile_steps, trace_events
    fn()
    events = trace_events(profile_steps(fn, n, device), torch.device(device).type)
    return sum(e["dur"] for e in events) / n / 1000.0


KERNEL_TIMING = "profiler: summed device time of the kernels one call launches, L2 warm, mean of 50 calls"

GRAPH_LAYERS = 32  # calls per timed CUDA graph, each on its own layer's weights or state (see graph_ms)


def graph_timing(n: int) -> str:
    """How graph_ms timed: the `timing` field of the records it gives."""
    return f"cuda-graph of {n} layers' calls, median of 20 replays, per call"


def kernel_record(params: dict, results: dict, reasons: list[str], device: str) -> dict:
    from records import store
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else device
    rec = store.make_record("kernel", preset=None, dtype="bfloat16", device=name, weights=None, params=params,
                            results=results, verdict="INVALID" if reasons else "VALID", reasons=reasons)
    store.append(rec)
    return rec


def graph_ms(calls, reps: int = 20) -> float:
    """Median GPU time per call of `calls`, captured back to back in one CUDA graph and replayed. As under the
    model's decode graph: no host launch cost between kernels, and, since each call reads other weights (as each
    of the model's layers reads its own), the weights come cold from HBM; a single repeated call would find a
    good part of its 85 MB in the 50 MB L2, and do_bench's L2 flush leaves dirty lines whose write-back competes
    with the reads of a 20-40 us kernel."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compilation, allocator
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in marks:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = sorted(start.elapsed_time(end) for start, end in marks)
    return ms[len(ms) // 2] / len(calls)


def judge_peer(results: dict, reasons: list[str], tol: float) -> None:
    """The speedup from both times; a relative RMS error against the peer past tol into reasons."""
    results["speedup"] = results["peer_ms"] / results["ours_ms"]
    if not results["rel_err_vs_peer"] <= tol:
        reasons.append(f"ours differs from {results['peer']}: relative RMS error {results['rel_err_vs_peer']:.3g} "
                       f"> {tol}")


def versus(results: dict, reasons: list[str], ours, theirs, tol: float) -> None:
    """The outputs' relative RMS error into results, then `judge_peer`; non-finite output into reasons."""
    results["rel_err_vs_peer"] = rel_err(ours, theirs)
    if not torch.isfinite(ours).all():
        reasons.append("ours produced non-finite values")
    judge_peer(results, reasons, tol)


def time_peer(fn, compare, res: dict, reasons: list, rep_ms: int, eager: bool = False) -> None:
    """Run the peer once (outputs compared with ours by `compare`), then time it; a failure becomes a
    reason, and ours stays measured."""
    try:
        res.update(compare(fn()))
        res["peer_ms"] = gpu_ms(fn, rep_ms)
        if eager:
            res["peer_eager_ms"] = eager_ms(fn)
    except Exception as e:  # a peer that breaks must not take our numbers with it
        traceback.print_exc()
        reasons.append(f"peer failed: {type(e).__name__}: {e}")


def fmt_ms(ms) -> str:
    return "-" if ms is None else f"{ms:.4f}"


def sweep(name: str, configs: list[dict], default: Mapping, run, timed, tol: float, params: dict,
          device: str, keys: set[str] | None = None) -> list[dict]:
    """One record per config (params with `sweep` and the whole config): its outputs `run(cfg)` held against the
    default's `run(None)` by relative RMS error, the worst of them, then `timed(cfg)`. A config that fails to compile
    or run is recorded INVALID and the sweep goes on. Logs the fastest valid config. `keys` (--sweep-keys): only the
    configs that change nothing outside these keys."""
    if keys is not None:
        configs = [cfg for cfg in configs if set(cfg) <= keys]
    ref = run(None)
    recs, best = [], None
    for cfg in configs:
        reasons = []
        try:
            err = max(rel_err(x, r) for x, r in zip(run(cfg), ref))
            if not err <= tol:
                reasons.append(f"differs from the default config: relative RMS error {err:.3g} > {tol}")
            results = {**timed(cfg), "rel_err_vs_default": err}
        except Exception as e:  # a config that fails to compile or run is recorded and skipped
            traceback.print_exc()
            results, reasons = {}, [f"{cfg} failed: {type(e).__name__}: {e}"]
        rec = kernel_record({**params, "sweep": True, "cfg": {**mt.plain(default), **cfg}}, results, reasons, device)
        recs.append(rec)
        log(f"  {name} {cfg}  ours={fmt_ms(results.get('ours_ms'))} ({results.get('timing', '-')})  {rec['verdict']}")
        if not reasons and (best is None or results["ours_ms"] < best[1]):
            best = (cfg, results["ours_ms"])
    if best is not None:
        log(f"  best {name}: {best[0]} {best[1]:.4f} ms")
    return recs

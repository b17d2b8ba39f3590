"""Kernel speed: our Triton kernels against a peer on the same inputs, in one process.

    python -m benchmarks.bench_kernels [--ops chunk_kda,kda_decode_step,mla_decode,causal_conv1d,moe_combine]
        [--chunk-T 1024,8192,32768] [--decode-B 1,8,64] [--mla-T 1024,32768,131072] [--prefill-T 8192] [--rep-ms 200]
        [--chunk-sweep] [--decode-sweep] [--conv-sweep] [--sweep-keys scan_stages,prep_stages]
    python -m benchmarks.bench_kernels --ops moe_decode [--moe-N 1,8] [--moe-sweep]
    python -m benchmarks.bench_kernels --ops moe_prefill [--prefill-T 8192]
    python -m benchmarks.bench_kernels --ops mla_decode_layout [--mla-T 1056,8192]
    python -m benchmarks.bench_kernels --ops mla_absorb
    python -m benchmarks.bench_kernels --ops moe_prefill_rows [--prefill-T 8192]

Needs a CUDA device (SPEC.md §4 anchors are H200 figures). fla is imported from the path as installed;
FLA_FLASH_KDA=0 is set before that import so fla runs its Triton KDA kernels. H=32 heads, head dim 128, bf16.
- chunk prefill, batch 1, fp32 initial state: our `chunk_kda_fwd` vs fla's `chunk_kda`, both L2-normalising
  q/k in the kernel and taking the same q, k, v, g (log decay, fp32) and beta (after the sigmoid);
- decode step, one token per sequence: our whole step in one launch (conv-tap update, conv + SiLU, gate,
  beta, L2 norm, state update, output, gated output RMSNorm) vs fla's `fused_recurrent_kda` call alone (given
  the post-conv q/k/v, the gate and beta, L2 norm in its kernel). The issue's target compares exactly these.
- MLA decode attention over the latent cache (batch 1, 32 heads, rank 512 + 64, bf16 cache filled to T
  positions, the query at T-1): our split-K `mla_decode` (fp32 scores, reads positions 0..pos) vs the
  previous torch-einsum form (bf16 score and p@c einsums over the whole buffer, masked): peer "torch-einsum".
  Ours is also held against the fp32 torch reference (`rel_err_vs_fp32_ref`, must be <= 1e-4); `gbps` is
  the cache bytes read per call over ours' time.
- prefill plumbing, batch 1, T tokens, the 48B's shapes, against the torch forms they replace (peer `torch`):
  `causal_conv1d` (3*H*D channels, 4 taps, from carried taps: ours must match torch's bits, rel_err 0) and
  `moe_combine` (T tokens x top-8 expert rows of 2304 plus the shared expert's, vs the index_add-into-fp32
  combine the grouped MoE used before); `moe_prefill` (not in the default --ops: the Triton grouped GEMMs of
  model/triton/moe_grouped.py, both together against the torch form at the model router's spread of rows, and
  in `results.sweep` each kernel's tile configs timed alone against the part of the torch form it replaces).
Times are medians of `triton.testing.do_bench` (L2 flushed before each call, CUDA events: GPU time), the same
method for ours and the peer; decode shapes also record back-to-back eager times (host launch cost included).
For kernels of a few tens of microseconds do_bench is a poor guide to the time inside the model's decode graph
(the flush leaves dirty L2 lines whose write-back competes with the next kernel's reads; such figures have
swung by 1.6x between runs: fla at batch 64 in kernel records dd7b3146 and fab91b33), so the choices of launch
configs use `graph_ms` (below) instead. The decode step is also timed that way on both sides (`ours_graph_ms`,
`peer_graph_ms`, GRAPH_LAYERS layers' states in one graph), and by the profiler (`ours_kernel_ms`, `peer_kernel_ms`:
the kernels' own device time, launch gaps left out; see `kernel_ms`); the summary states the targets by all three.
Outputs are compared in the same run (relative RMS error, fla as the reference). One `kernel` record per shape;
an error in one shape or side becomes an INVALID record and the run goes on. Without fla, ours is still timed
and every record is INVALID with reason "peer unavailable: ...".

`--ops moe_decode`: the batch-N decode MoE of 48B-A3B at its real shapes (random weights, one layer): the
fused router (GEMV + top-k, one launch), the gate_up and down expert kernels, and the three in sequence
(`moe_layer`, as `model.ops.moe` runs it), each against PyTorch forms of the same part in the same run (see MoeCase;
`moe_layer_plain`: the block against its own launches without the early starts; `moe_norm_layer`: the add+norm
before the block and the block, against the same with the norm not letting the router start early), with GB/s over the
bytes an ideal kernel reads, as a fraction of 4.25 TB/s and of the read ceiling measured in the run.
These are timed by `graph_ms`, not do_bench: 32 layers' calls (each layer its own router, shared expert and
routed experts) captured in one CUDA graph, as the model's decode step runs them.
`--moe-sweep` also times every tile config of `moe_sweep_grid` and logs the best per kernel; pick the
defaults in model/triton/moe.py (GATE_UP, DOWN, ROUTER) from it.

`--ops mla_decode_layout`: `mla_decode` (split kernel + combine) in `default_layout` against the all-heads
layout (peer "all-heads": `default_split`, 32 heads a program), for each SHORT of MLA_SHORTS, `graph_ms` over
MLA_LAYERS layers' calls (each its own cache), batch 1, a buffer of T positions (--mla-T), the query at T-1;
ours is checked against the peer's output in the same run. `--ops mla_absorb`: `mla_absorb_sweep`, the tile
configs of the absorbed up-projections against the default, graph-timed per layer. `--ops mla_decode_rows`:
`mla_rows_case`, the positions-as-rows split kernel against the heads-as-rows one (model.triton.mla_decode's
CONFIG), graph-timed per layer at each --mla-T where the layout's loop step lets both run. `--ops moe_prefill_rows`:
`moe_rows_case`, the prefill MoE's expert GEMMs at the router's rows per expert against the same rows balanced.
"""
from __future__ import annotations

import argparse
import os
import traceback

import torch

from benchmarks.cli import ints
from benchmarks.timing import log

H, D, W = 32, 128, 4
DTYPE = torch.bfloat16
PEER = "fla-0.6.0"
PEER_TOL = 2e-2  # bf16 outputs of two fp32-accumulating implementations of the same math
# the targets: (op, param, value, ours must be <= or < the peer's time)
TARGETS = (("chunk_kda", "T", 8192, "<="), ("kda_decode_step", "B", 1, "<"), ("kda_decode_step", "B", 64, "<"),
           ("mla_decode", "T", 131072, "<"))
MLA_H, MLA_R, MLA_P = 32, 512, 64
MLA_PEER = "torch-einsum"
MLA_PEER_TOL = 5e-2  # the peer rounds scores and p to bf16: ~1e-2 from the fp32 result on these inputs


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


def gate_inputs(B, T, gen, device="cuda"):
    """The model's gate and beta on random activations: g fp32 [B,T,H,D], beta [B,T,H]."""
    from model import kda
    A_log = (torch.rand(H, generator=gen) * 3 - 1).to(device)
    dt_bias = torch.randn(H * D, generator=gen).to(device)
    f = torch.randn(B, T, H * D, generator=gen).to(device).to(DTYPE)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).to(device).to(DTYPE)
    return kda.kda_gate(f, A_log, dt_bias, D), beta


def chunk_inputs(T: int, device: str = "cuda") -> tuple:
    """Seeded inputs of one KDA layer's chunk prefill of T tokens, batch 1: (q, k, v, g, beta, h0)."""
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, T, H, D, generator=gen).to(device).to(DTYPE) for _ in range(3))
    g, beta = gate_inputs(1, T, gen, device)
    return q, k, v, g, beta, torch.randn(1, H, D, D, generator=gen).to(device)


def chunk_case(T: int, peer, rep_ms: int) -> tuple[dict, list[str]]:
    from model.triton.kda_chunk import chunk_kda_fwd
    q, k, v, g, beta, h0 = chunk_inputs(T)

    def ours():
        return chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    o, ht = ours()
    res, reasons = {"ours_ms": gpu_ms(ours, rep_ms)}, []
    if not (torch.isfinite(o).all() and torch.isfinite(ht).all()):
        reasons.append("ours produced non-finite values")
    if peer is not None:
        # fla 0.6.0 autotunes its KDA kernels on keys without T and keeps the result on disk (FLA_CACHE_RESULTS): at
        # this length it may run the config tuned at another (its readings move; "Targets" in docs/RESULTS.md)
        def theirs():
            return peer[0](q, k, v, g, beta, scale=D ** -0.5, initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)

        time_peer(theirs, lambda out: {"rel_err_vs_peer": rel_err(o, out[0]),
                                       "state_rel_err_vs_peer": rel_err(ht, out[1])}, res, reasons, rep_ms)
    return res, reasons


def decode_step_inputs(B: int, device: str = "cuda") -> tuple:
    """Seeded inputs of one KDA layer's decode step at batch B, as the model holds them: (qkv_raw, taps, conv_w,
    f, A_log, dt_bias, b_raw, out_gate, norm_w, state). qkv_raw and b_raw are column slices of one packed
    [B, 3*H*D + 2*D + H] tensor, as they come out of the model's packed input projection (`KimiDeltaAttention`)."""
    gen = torch.Generator().manual_seed(B)
    C = 3 * H * D
    qkv_raw = torch.randn(B, C, generator=gen).to(device).to(DTYPE)
    taps = torch.randn(B, W - 1, C, generator=gen).to(device).to(DTYPE)
    conv_w = (0.5 * torch.randn(C, W, generator=gen)).to(device).to(DTYPE)
    f = torch.randn(B, H * D, generator=gen).to(device).to(DTYPE)
    A_log = (torch.rand(H, generator=gen) * 3 - 1).to(device)
    dt_bias = torch.randn(H * D, generator=gen).to(device)
    b_raw = torch.randn(B, H, generator=gen).to(device).to(DTYPE)
    out_gate = torch.randn(B, H * D, generator=gen).to(device).to(DTYPE)
    norm_w = (1 + 0.1 * torch.randn(D, generator=gen)).to(device).to(DTYPE)
    state = torch.randn(B, H, D, D, generator=gen).to(device)
    packed = torch.zeros(B, C + 2 * D + H, dtype=DTYPE, device=device)  # q|k|v, f_a|g_a (not read here), b
    packed[:, :C], packed[:, C + 2 * D:] = qkv_raw, b_raw
    qkv_raw, b_raw = packed[:, :C], packed[:, C + 2 * D:]
    return qkv_raw, taps, conv_w, f, A_log, dt_bias, b_raw, out_gate, norm_w, state


def decode_case(B: int, peer, rep_ms: int, device: str = "cuda") -> tuple[dict, list[str]]:
    """Ours and fla's call at batch B: do_bench and eager times (the issue's measure), then both as the model
    runs them (`graph_ms` over GRAPH_LAYERS layers' states: ours_graph_ms, peer_graph_ms), which unlike do_bench
    tells ~10 us kernels apart. A peer that cannot be captured leaves peer_graph_error, not an INVALID record."""
    from model import kda
    from model.triton.kda_decode import fused_kda_decode
    qkv_raw, taps, conv_w, f, A_log, dt_bias, b_raw, out_gate, norm_w, state = decode_step_inputs(B, device)
    # what fla is handed: the conv, gate and beta the model computes before its kernel
    y, _ = kda.causal_conv1d(qkv_raw[:, None], conv_w, taps)
    q, k, v = (t.unflatten(-1, (H, D)) for t in y.chunk(3, dim=-1))
    g = kda.kda_gate(f[:, None], A_log, dt_bias, D)
    beta = torch.sigmoid(b_raw.float())[:, None]

    o = fused_kda_decode(qkv_raw, taps.clone(), conv_w, f, A_log, dt_bias, b_raw, state.clone())
    s_ours, t_ours = state.clone(), taps.clone()

    def ours():
        return fused_kda_decode(qkv_raw, t_ours, conv_w, f, A_log, dt_bias, b_raw, s_ours,
                                out_gate=out_gate, norm_weight=norm_w)

    res, reasons = {"ours_ms": gpu_ms(ours, rep_ms), "ours_eager_ms": eager_ms(ours),
                    "ours_kernel_ms": kernel_ms(ours, device), "timing_kernel": KERNEL_TIMING}, []
    if not torch.isfinite(o).all() or not torch.isfinite(ours()).all():
        reasons.append("ours produced non-finite values")
    if peer is not None:
        s_peer = state.clone()

        def theirs():
            return peer[1](q, k, v, g, beta, scale=D ** -0.5, initial_state=s_peer, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)

        time_peer(theirs, lambda out: {"rel_err_vs_peer": rel_err(o, out[0][:, 0])}, res, reasons, rep_ms,
                  eager=True)
        if "peer_ms" in res:
            res["peer_kernel_ms"] = kernel_ms(theirs, device)
    layers = [(state.clone(), taps.clone()) for _ in range(GRAPH_LAYERS)]
    res["ours_graph_ms"] = graph_ms([lambda L=L: fused_kda_decode(qkv_raw, L[1], conv_w, f, A_log, dt_bias, b_raw,
                                                                  L[0], out_gate=out_gate, norm_weight=norm_w)
                                     for L in layers])
    res["timing_graph"] = graph_timing(GRAPH_LAYERS)
    if peer is not None and "peer_ms" in res:
        del layers
        try:
            res["peer_graph_ms"] = graph_ms([lambda s=s: peer[1](q, k, v, g, beta, scale=D ** -0.5, initial_state=s,
                                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
                                             for s in [state.clone() for _ in range(GRAPH_LAYERS)]])
        except Exception as e:  # e.g. a host sync inside the peer's call: it cannot be captured
            traceback.print_exc()
            res["peer_graph_error"] = f"{type(e).__name__}: {e}"
    return res, reasons


# the grids of model.triton.kda_decode: "strided" (the blocks of a head B*H programs apart) at every block size,
# "adjacent" (a head's blocks on consecutive programs) up to 32 columns
DECODE_SWEEP = ([dict(grid="strided", BV=bv, num_warps=nw) for bv in (8, 16, 32, 64) for nw in (1, 2, 4, 8)
                 if bv * nw <= 256]
                + [dict(grid="adjacent", BV=bv, num_warps=nw) for bv in (8, 16, 32) for nw in (1, 2, 4, 8)
                   if bv * nw <= 256]
                # one program per head (BV = the head dim, 128): no block waits for another to finish the head,
                # the whole state in one program (the default at every batch since the sweep of ca2d42f). Over 8 or
                # 16 warps it took 2.3x to 3.4x the 4 warps' time in that sweep (B=1 13.8 / 15.4 us `68648d1c` /
                # `14a9097c`, B=64 234.3 / 259.5 us `70eb9fd4` / `8e544db4`) and spills since its load order: dropped
                + [dict(grid="strided", BV=bv, num_warps=nw) for bv, nw in ((64, 8), (128, 4))]
                # o from the state before the update (kda_decode._update_columns' EARLY_O), at the fastest configs
                # of each kind in the sweep of 8f00376
                + [dict(grid=g, BV=bv, num_warps=nw, early_o=True)
                   for g, bv, nw in (("strided", 128, 4), ("adjacent", 32, 1), ("adjacent", 32, 2),
                                     ("adjacent", 16, 4), ("strided", 32, 2), ("strided", 64, 4))])


# A config's bf16 output against the default's: another fp32 summation order flips the rounding of a few elements
# by one bf16 ulp (2^-8 relative; at B=64 relative RMS errors of 3e-5 to 5e-5, run of 5ac699e), which a 1e-5 bound
# called a difference; a wrong column block or state row gives errors of order 1.
DECODE_SWEEP_TOL = 1e-3


def decode_sweep(B: int, device: str = "cuda", keys: set[str] | None = None) -> list[dict]:
    """Our decode step at each config of DECODE_SWEEP, timed as the model runs it (`graph_ms` over 32 layers,
    each with its own state and conv taps), the output checked against the default's. One record per config."""
    from model.triton import kda_decode
    from model.triton.kda_decode import fused_kda_decode
    qkv_raw, taps, conv_w, f, A_log, dt_bias, b_raw, out_gate, norm_w, state = decode_step_inputs(B, device)
    # each timed layer its own state and conv taps (the first layer's are the seeded ones)
    layers = [(state, taps)] + [(torch.randn_like(state), torch.randn_like(taps)) for _ in range(GRAPH_LAYERS - 1)]

    def step(L, cfg):
        return fused_kda_decode(qkv_raw, L[1].clone(), conv_w, f, A_log, dt_bias, b_raw, L[0].clone(),
                                out_gate=out_gate, norm_weight=norm_w, cfg=cfg)

    # the timing graphs update each layer's state and taps in place: outputs are compared from a pristine copy
    first = tuple(t.clone() for t in layers[0])

    def timed(cfg):
        return {"ours_ms": graph_ms([lambda L=L: fused_kda_decode(qkv_raw, L[1], conv_w, f, A_log, dt_bias, b_raw, L[0],
                                                                  out_gate=out_gate, norm_weight=norm_w, cfg=cfg)
                                     for L in layers]),
                "timing": graph_timing(len(layers))}

    params = {"op": "kda_decode_step", "B": B, "T": 1, "H": H, "d": D, "dtype": "bfloat16"}
    return sweep(f"kda_decode_step B={B}", DECODE_SWEEP, kda_decode.DECODE, lambda cfg: (step(first, cfg),), timed,
                 DECODE_SWEEP_TOL, params, device, keys)


def sweep(name: str, configs: list[dict], default: dict, run, timed, tol: float, params: dict,
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
        rec = kernel_record({**params, "sweep": True, "cfg": {**default, **cfg}}, results, reasons, device)
        recs.append(rec)
        log(f"  {name} {cfg}  ours={_ms(results.get('ours_ms'))} ({results.get('timing', '-')})  {rec['verdict']}")
        if not reasons and (best is None or results["ours_ms"] < best[1]):
            best = (cfg, results["ours_ms"])
    if best is not None:
        log(f"  best {name}: {best[0]} {best[1]:.4f} ms")
    return recs


# model.triton.kda_chunk's launch configs, around the default (chunks of 16 on a 1-warp prep since 5665093; chunks of
# 32 on 2 warps before, and still for fp32 inputs, CONFIG["exact"]; the sweep times bf16): the chunk length with
# the prep's warps (but one warp for chunks of 64, which spills 6 KB per thread), the prep's slice, the scan's columns
# and warps; each key's other values are the default's. The sweep of 57b6106 that picked the earlier default tried
# chunks of 64 at 4 and 8 warps, slices of 32 and 64, and the scan at 16 to 64 columns over 4 and 8 warps (records
# cited in model/triton/kda_chunk.py). The pipeline stages of either kernel and the prep's register cap were added at
# 7f31b66 and 5513998 (records cited there too).
CHUNK_SWEEP = ([dict(chunk=c, prep_warps=w) for c in (16, 32, 64) for w in (1, 2, 4) if (c, w) != (64, 1)]
               + [dict(slice=s) for s in (32, 128)]
               + [dict(scan_bv=bv, scan_warps=w, scan_dots=d) for d in ("tf32", "bf16") for bv in (16, 32, 64)
                  for w in (4, 8)]
               + [dict(prep_dots="bf16", prep_warps=w) for w in (1, 2, 4)]
               + [dict(scan_stages=n) for n in (1, 2, 4)] + [dict(prep_stages=n) for n in (1, 2)]
               + [dict(prep_maxnreg=r, prep_stages=n) for r in (128, 168) for n in (1, 3)])
# bf16 outputs of two configs differ by the order of fp32 sums and tf32 roundings (relative RMS about 1e-3 against
# fp64, tests/test_triton_kda.py); a wrong block or missing term gives errors of order 1
CHUNK_SWEEP_TOL = 1e-2


def chunk_sweep(T: int, rep_ms: int, device: str = "cuda", keys: set[str] | None = None) -> list[dict]:
    """Our chunk prefill at each config of CHUNK_SWEEP (do_bench: a kernel pair of milliseconds), output and final
    state checked against the default config's. One record per config."""
    from model.triton.kda_chunk import CONFIG, chunk_kda_fwd
    q, k, v, g, beta, h0 = chunk_inputs(T, device)

    def run(cfg):
        return chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True, cfg=cfg)

    params = {"op": "chunk_kda", "B": 1, "T": T, "H": H, "d": D, "dtype": "bfloat16"}
    return sweep(f"chunk_kda T={T}", CHUNK_SWEEP, CONFIG, run,
                 lambda cfg: {"ours_ms": gpu_ms(lambda: run(cfg), rep_ms), "timing": "do_bench"},
                 CHUNK_SWEEP_TOL, params, device, keys)


MLA_LAYERS = 7  # the 48B-A3B's MLA layers: calls per timed graph


def versus(results: dict, reasons: list[str], ours, theirs, tol: float) -> None:
    """The outputs' relative RMS error into results, then `judge_peer`; non-finite output into reasons."""
    results["rel_err_vs_peer"] = rel_err(ours, theirs)
    if not torch.isfinite(ours).all():
        reasons.append("ours produced non-finite values")
    judge_peer(results, reasons, tol)


def mla_fp32_ref(results: dict, reasons: list[str], ours, ref) -> None:
    """Our MLA decode output against the fp32 torch reference `ref`: its relative RMS error into results, a reason
    past 1e-4."""
    results["rel_err_vs_fp32_ref"] = rel_err(ours, ref)
    if not results["rel_err_vs_fp32_ref"] <= 1e-4:
        reasons.append(f"ours differs from the fp32 torch reference: {results['rel_err_vs_fp32_ref']:.3g} > 1e-4")


MLA_SHORTS = (dict(heads=16, BL=32), dict(heads=16, BL=64))  # the SHORT layouts mla_decode_layout times


def mla_layout_case(T: int, device: str = "cuda") -> list[dict]:
    """mla_decode in default_layout for each SHORT of MLA_SHORTS against the all-heads layout, graph-timed."""
    from model import ops
    from model.triton import mla_decode as ml
    g = torch.Generator(device=device).manual_seed(T)
    q_lat = 3 * torch.randn(1, MLA_H, MLA_R, generator=g, device=device)
    q_pe = (3 * torch.randn(1, MLA_H, MLA_P, generator=g, device=device)).to(DTYPE)
    caches = [(torch.randn(1, T, MLA_R, generator=g, device=device).to(DTYPE),
               torch.randn(1, T, MLA_P, generator=g, device=device).to(DTYPE)) for _ in range(MLA_LAYERS)]
    pos, scale, dev = torch.tensor(T - 1, device=device), 192 ** -0.5, torch.device(device)
    split = ml.default_split(T, 1, dev)
    c, k_pe = caches[0]
    ref = ops.mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale)
    recs, peer_ms, saved = [], None, ml.SHORT
    for short in MLA_SHORTS:
        ml.SHORT = short
        layout = ml.default_layout(T, 1, MLA_H, dev)
        params = {"op": "mla_decode_layout", "B": 1, "T": T, "H": MLA_H, "d": MLA_R + MLA_P, "dtype": "bfloat16",
                  "short": short, "split": layout[0], "heads": layout[1], "peer_split": split}
        results, reasons = {"peer": "all-heads", "timing": graph_timing(MLA_LAYERS)}, []
        try:
            o = ml.mla_decode(q_lat, q_pe, c, k_pe, pos, scale)
            o_peer = ml.mla_decode(q_lat, q_pe, c, k_pe, pos, scale, split=split)
            results["ours_ms"] = graph_ms([lambda L=L: ml.mla_decode(q_lat, q_pe, L[0], L[1], pos, scale)
                                           for L in caches])
            if peer_ms is None:
                peer_ms = graph_ms([lambda L=L: ml.mla_decode(q_lat, q_pe, L[0], L[1], pos, scale, split=split)
                                    for L in caches])
            results["peer_ms"] = peer_ms
            mla_fp32_ref(results, reasons, o, ref)
            versus(results, reasons, o, o_peer, 1e-4)
        except Exception as e:  # record the failure, go on with the next layout
            traceback.print_exc()
            reasons.append(f"mla_decode_layout failed: {type(e).__name__}: {e}")
        finally:
            ml.SHORT = saved
        rec = kernel_record(params, results, reasons, device)
        recs.append(rec)
        log(f"  mla_decode_layout T={T:<6d} SHORT={short} -> split={layout[0]} heads={layout[1]}: "
            f"ours={_ms(results.get('ours_ms'))} all-heads(split={split})={_ms(results.get('peer_ms'))} "
            f"(graph, per layer)  {rec['verdict']} {reasons}")
    return recs


MLA_POSITIONS_WARPS = (4, 8)  # the positions kernel's warps that mla_rows_case times


def mla_rows_case(T: int, device: str = "cuda") -> list[dict]:
    """mla_decode with CONFIG's rows = "positions" (ours, at each of MLA_POSITIONS_WARPS; 4 is the default since
    8d33c8b) against "heads" (peer "heads-rows"), both in default_layout, graph-timed over MLA_LAYERS layers'
    calls (each its own cache), batch 1, a buffer of T positions, the query at T-1; each checked against the
    peer's output and the fp32 torch reference. One record per warps; none where the layout's loop step is not
    _BL (SHORT's steps of 32 at short buffers), where both would run the heads-as-rows kernel."""
    from model import ops
    from model.triton import mla_decode as ml
    dev = torch.device(device)
    theirs = dict(rows="heads")
    if ml.plan(T, 1, MLA_H, DTYPE, dev, cfg=dict(rows="positions")).rows != "positions":
        log(f"  mla_decode_rows T={T}: layout {ml.plan(T, 1, MLA_H, DTYPE, dev)} runs the heads-as-rows kernel "
            f"either way; not timed")
        return []
    g = torch.Generator(device=device).manual_seed(T)
    q_lat = 3 * torch.randn(1, MLA_H, MLA_R, generator=g, device=device)
    q_pe = (3 * torch.randn(1, MLA_H, MLA_P, generator=g, device=device)).to(DTYPE)
    caches = [(torch.randn(1, T, MLA_R, generator=g, device=device).to(DTYPE),
               torch.randn(1, T, MLA_P, generator=g, device=device).to(DTYPE)) for _ in range(MLA_LAYERS)]
    pos, scale = torch.tensor(T - 1, device=device), 192 ** -0.5
    c, k_pe = caches[0]
    read = T * (MLA_R + MLA_P) * c.element_size()   # the cache bytes a call reads

    def timed(cfg):
        return graph_ms([lambda L=L: ml.mla_decode(q_lat, q_pe, L[0], L[1], pos, scale, cfg=cfg) for L in caches])

    recs, peer_ms, o_peer, ref = [], None, None, None
    for warps in MLA_POSITIONS_WARPS:
        ours = dict(rows="positions", positions_warps=warps)
        layout = ml.plan(T, 1, MLA_H, DTYPE, dev, cfg=ours)
        params = {"op": "mla_decode_rows", "B": 1, "T": T, "H": MLA_H, "d": MLA_R + MLA_P, "dtype": "bfloat16",
                  "split": layout.split, "heads": layout.heads, "step": layout.step, "warps": warps}
        results, reasons = {"peer": "heads-rows", "timing": graph_timing(MLA_LAYERS)}, []
        try:
            if o_peer is None:
                o_peer = ml.mla_decode(q_lat, q_pe, c, k_pe, pos, scale, cfg=theirs)
                ref = ops.mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale)
                peer_ms = timed(theirs)
            o = ml.mla_decode(q_lat, q_pe, c, k_pe, pos, scale, cfg=ours)
            results["ours_ms"], results["peer_ms"] = timed(ours), peer_ms
            # GB/s over the cache bytes a call reads: against the HBM bandwidth the e2e benchmark measures
            results["gbps"], results["peer_gbps"] = read / results["ours_ms"] / 1e6, read / peer_ms / 1e6
            mla_fp32_ref(results, reasons, o, ref)
            versus(results, reasons, o, o_peer, 1e-4)
        except Exception as e:  # record the failure, go on with the next warps
            traceback.print_exc()
            reasons.append(f"mla_decode_rows failed: {type(e).__name__}: {e}")
        rec = kernel_record(params, results, reasons, device)
        recs.append(rec)
        log(f"  mla_decode_rows T={T:<6d} split={layout.split} heads={layout.heads} warps={warps}: "
            f"positions={_ms(results.get('ours_ms'))} ({results.get('gbps', 0):.0f} GB/s) "
            f"heads={_ms(results.get('peer_ms'))} (graph, per layer)  {rec['verdict']} {reasons}")
    return recs


MOE_TILE_ROWS = 128  # the rows of torch's grouped-GEMM tiles on sm_90 when a problem has more than 128 rows a group


def balanced_counts(n: int, E: int) -> torch.Tensor:
    """n rows over E groups as evenly as they go (the first n % E groups one more)."""
    return torch.full((E,), n // E, dtype=torch.int64) + (torch.arange(E) < n % E)


def first_router(preset: str, device: str):
    """(router, description): the first MoE layer's router of `preset` with the synthetic weights (seed 0) the
    benchmarks' model has, which gives the spread of rows over the experts that the model's prefill MoE sees."""
    from model.config import get_config
    from model.layers import Router
    from model.weights import synthetic_tensor
    cfg = get_config(preset)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    router = Router(cfg).to(device)
    name = f"model.layers.{layer}.block_sparse_moe.gate."
    with torch.no_grad():
        router.weight.copy_(synthetic_tensor(cfg, name + "weight", device=device))
        router.e_score_correction_bias.copy_(synthetic_tensor(cfg, name + "e_score_correction_bias", device=device))
    router.pack_()
    return router, f"model.layers.{layer} of {preset}, synthetic seed 0, inputs N(0, 1)"


def moe_rows_case(T: int, rep_ms: int, device: str = "cuda", preset: str = "48b-a3b") -> dict:
    """The prefill MoE's expert GEMMs (`ops.grouped_mm` gate_up, `ops.silu_mul`, `ops.grouped_mm` down: the
    model's path without the dispatch and combine copies) for T tokens of `preset` at the rows per expert its
    router gives, against the same number of rows balanced across the experts (peer "balanced rows"). The router
    is the first MoE layer's, synthetic weights seed 0 as the benchmarks' model has them, on unit normal inputs.
    The gap is what the spread of rows costs torch's grouped GEMM: each expert's rows fill whole tiles of
    MOE_TILE_ROWS, so a skewed spread pays for padded rows (`tile_rows_wasted`, beside the balanced case's). Ours
    is checked against one torch.mm per expert for the first experts. One `kernel` record."""
    from model import ops
    from model.config import get_config
    cfg = get_config(preset)
    E, Dm, I, K = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token
    router, desc = first_router(preset, device)
    params = {"op": "moe_prefill_rows", "B": 1, "T": T, "H": E, "d": Dm, "dtype": "bfloat16", "I": I, "K": K,
              "router": desc,
              "ours_scope": "grouped gate_up + silu_mul + grouped down at the router's rows per expert",
              "peer_scope": "the same GEMMs with the same number of rows balanced across the experts"}
    results, reasons = {"peer": "balanced rows", "timing": "do_bench"}, []
    try:
        g = torch.Generator(device=device).manual_seed(T)
        x = torch.randn(T, Dm, generator=g, device=device).to(DTYPE)
        idx = router(x)[0]
        counts = torch.bincount(idx.flatten().cpu(), minlength=E)
        cases = {"ours": counts, "peer": balanced_counts(T * K, E)}
        rows = torch.randn(T * K, Dm, generator=g, device=device).to(DTYPE)
        gate_up = (torch.randn(E, 2 * I, Dm, generator=g, device=device) / Dm ** 0.5).to(DTYPE).transpose(1, 2)
        down = (torch.randn(E, Dm, I, generator=g, device=device) / I ** 0.5).to(DTYPE).transpose(1, 2)

        def experts(offs):
            h = ops.grouped_mm(rows, gate_up, offs)
            return ops.grouped_mm(ops.silu_mul(h[:, :I], h[:, I:]), down, offs)

        ends = {side: torch.cumsum(c, 0) for side, c in cases.items()}
        for side, c in cases.items():
            offs = ends[side].to(torch.int32).to(device)
            results[f"{side}_ms"] = gpu_ms(lambda offs=offs: experts(offs), rep_ms)
            results[f"{side}_tile_rows_wasted"] = int((-c % MOE_TILE_ROWS).sum())
        results.update(rows_per_expert_sd=float(counts.float().std()), rows_per_expert_max=int(counts.max()),
                       rows_per_expert_min=int(counts.min()))
        results["speedup"] = results["peer_ms"] / results["ours_ms"]
        y = experts(ends["ours"].to(torch.int32).to(device))
        ref, got = [], []
        for e in range(8):  # the first experts' rows, one torch.mm pair each
            b = int(ends["ours"][e])
            a = b - int(counts[e])
            h = rows[a:b] @ gate_up[e]
            ref.append(ops.silu_mul(h[:, :I], h[:, I:]) @ down[e])
            got.append(y[a:b])
        results["rel_err_vs_per_expert_mm"] = rel_err(torch.cat(got), torch.cat(ref))
        if not results["rel_err_vs_per_expert_mm"] <= 1e-2:
            reasons.append(f"grouped GEMMs differ from per-expert torch.mm: {results['rel_err_vs_per_expert_mm']:.3g}")
    except Exception as e:
        traceback.print_exc()
        reasons.append(f"moe_prefill_rows failed: {type(e).__name__}: {e}")
    rec = kernel_record(params, results, reasons, device)
    log(f"  moe_prefill_rows T={T}: router rows {_ms(results.get('ours_ms'))} ms, balanced "
        f"{_ms(results.get('peer_ms'))} ms; rows per expert sd {results.get('rows_per_expert_sd', float('nan')):.1f}, "
        f"padded rows {results.get('ours_tile_rows_wasted')} against {results.get('peer_tile_rows_wasted')}  "
        f"{rec['verdict']} {reasons}")
    return rec


ABSORB_SWEEP = [dict(BN=bn, BK=bk, num_warps=nw) for bn in (16, 32, 64) for bk in (64, 128)
                for nw in (2, 4, 8)]


def mla_absorb_sweep(device: str = "cuda") -> list[dict]:
    """`mla_absorb` at the MLA decode step's two shapes, each config of ABSORB_SWEEP against the default
    (`mla_decode.ABSORB`, peer "default"), `graph_ms` over MLA_LAYERS layers' kv_b_proj weights, batch 1, the
    output checked against the default's. q: q_nope [1, H, 128] @ W_uk [H, 128, R]; o: o_lat [1, H, R] fp32 @
    W_uv^T (the transposed view, R contiguous)."""
    from model.triton import mla_decode as ml
    g = torch.Generator(device=device).manual_seed(0)
    dn = dv = 128
    ws = [(torch.randn(MLA_H, dn + dv, MLA_R, generator=g, device=device) * MLA_R ** -0.5).to(DTYPE)
          for _ in range(MLA_LAYERS)]
    shapes = {"q": (torch.randn(1, MLA_H, dn, generator=g, device=device).to(DTYPE), [w[:, :dn] for w in ws]),
              "o": (torch.randn(1, MLA_H, MLA_R, generator=g, device=device), [w[:, dn:].transpose(1, 2) for w in ws])}
    recs = []
    for name, (x, layer_ws) in shapes.items():
        ref, default = ml.mla_absorb(x, layer_ws[0]), ml.absorb_config(x.shape[-1])
        peer_ms = graph_ms([lambda w=w: ml.mla_absorb(x, w) for w in layer_ws])
        best = None
        for cfg in ABSORB_SWEEP:
            params = {"op": "mla_absorb", "shape": name, "B": 1, "H": MLA_H, "K": x.shape[-1],
                      "N": layer_ws[0].shape[-1], "dtype": "bfloat16", "sweep": True,
                      "cfg": {**default, **cfg}}
            results, reasons = {"peer": "default", "peer_cfg": default, "peer_ms": peer_ms,
                                "timing": graph_timing(MLA_LAYERS)}, []
            try:
                err = rel_err(ml.mla_absorb(x, layer_ws[0], cfg), ref)
                results["rel_err_vs_default"] = err
                if not err <= 1e-5:
                    reasons.append(f"differs from the default config: relative RMS error {err:.3g}")
                results["ours_ms"] = graph_ms([lambda w=w: ml.mla_absorb(x, w, cfg) for w in layer_ws])
                results["speedup"] = peer_ms / results["ours_ms"]
            except Exception as e:  # a config that fails to compile or run is recorded and skipped
                traceback.print_exc()
                reasons.append(f"{cfg} failed: {type(e).__name__}: {e}")
            rec = kernel_record(params, results, reasons, device)
            recs.append(rec)
            if rec["verdict"] == "VALID" and (best is None or results["ours_ms"] < best[1]):
                best = (cfg, results["ours_ms"])
        log(f"  mla_absorb {name}: default {default} {peer_ms * 1e3:.2f} us; best {best[0] if best else None} "
            f"{best[1] * 1e3 if best else float('nan'):.2f} us (graph, per layer)")
    return recs


def einsum_mla_decode(q_lat, q_pe, c, k_pe, pos, scale):
    """The model's MLA decode attention before the split-K kernel: bf16 einsums over the whole buffer."""
    s = torch.einsum("bhr,blr->bhl", q_lat.to(c.dtype), c).float() + torch.einsum("bhp,blp->bhl", q_pe, k_pe).float()
    valid = torch.arange(c.shape[1], device=c.device) <= pos
    p = torch.softmax((s * scale).masked_fill(~valid, float("-inf")), dim=-1)
    return torch.einsum("bhl,blr->bhr", p.to(c.dtype), c).float()


def mla_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    from model import ops
    from model.triton.mla_decode import mla_decode
    gen = torch.Generator().manual_seed(T)
    q_lat = 3 * torch.randn(1, MLA_H, MLA_R, generator=gen).cuda()
    q_pe = (3 * torch.randn(1, MLA_H, MLA_P, generator=gen)).cuda().to(DTYPE)
    c = torch.randn(1, T, MLA_R, generator=gen).cuda().to(DTYPE)
    k_pe = torch.randn(1, T, MLA_P, generator=gen).cuda().to(DTYPE)
    pos, scale = torch.tensor(T - 1, device=c.device), 192 ** -0.5

    def ours():
        return mla_decode(q_lat, q_pe, c, k_pe, pos, scale)

    o = ours()
    res, reasons = {"ours_ms": gpu_ms(ours, rep_ms)}, []
    res["gbps"] = (c.numel() + k_pe.numel()) * c.element_size() / res["ours_ms"] / 1e6
    mla_fp32_ref(res, reasons, o, ops.mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale))
    if not torch.isfinite(o).all():
        reasons.append("ours produced non-finite values")
    time_peer(lambda: einsum_mla_decode(q_lat, q_pe, c, k_pe, pos, scale),
              lambda out: {"rel_err_vs_peer": rel_err(o, out)}, res, reasons, rep_ms)
    return res, reasons


def conv_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    from model import kda
    from model.triton.conv import CONFIG, causal_conv1d
    x, w, taps = conv_inputs(T)
    y, ref = causal_conv1d(x, w, taps)[0], kda.causal_conv1d(x, w, taps)[0]
    res = {"ours_ms": gpu_ms(lambda: causal_conv1d(x, w, taps), rep_ms),
           "peer_ms": gpu_ms(lambda: kda.causal_conv1d(x, w, taps), rep_ms), "rel_err_vs_peer": rel_err(y, ref),
           "bits_differing": int((y != ref).sum()), "peer": f"torch-{torch.__version__}", "cfg": dict(CONFIG)}
    return res, [] if res["bits_differing"] == 0 else [f"{res['bits_differing']} output elements differ from torch's"]


def conv_inputs(T: int, device: str = "cuda"):
    """x [1, T, 3*H*D], the conv weight and carried taps at the 48B's shapes, in DTYPE."""
    gen = torch.Generator().manual_seed(T)
    C = 3 * H * D
    x = torch.randn(1, T, C, generator=gen).to(device, DTYPE)
    w = (0.5 * torch.randn(C, W, generator=gen)).to(device, DTYPE)
    taps = torch.randn(1, W - 1, C, generator=gen).to(device, DTYPE)
    return x, w, taps


# model.triton.conv's tiles (tokens x channels per program, warps) around the default; each must give the default's
# bits (which are torch's, conv_case checks), so the tolerance is 0
CONV_SWEEP = [dict(BT=32, BC=512, STEP=4, num_warps=4), dict(BT=32, BC=512, STEP=2, num_warps=4),
              dict(BT=32, BC=512, STEP=8, num_warps=4), dict(BT=16, BC=512, STEP=4, num_warps=4),
              dict(BT=64, BC=512, STEP=4, num_warps=4), dict(BT=128, BC=512, STEP=4, num_warps=4),
              dict(BT=32, BC=256, STEP=4, num_warps=2), dict(BT=32, BC=1024, STEP=4, num_warps=4),
              dict(BT=32, BC=1024, STEP=4, num_warps=8), dict(BT=64, BC=1024, STEP=4, num_warps=8)]


def conv_sweep(T: int, rep_ms: int, device: str = "cuda", keys: set[str] | None = None) -> list[dict]:
    """The prefill conv at each tile config of CONV_SWEEP (do_bench). One record per config."""
    from model.triton import conv
    x, w, taps = conv_inputs(T, device)

    def run(cfg):
        return conv.causal_conv1d(x, w, taps, cfg)[:1]

    params = {"op": "causal_conv1d", "B": 1, "T": T, "H": H, "d": D, "dtype": "bfloat16"}
    return sweep(f"causal_conv1d T={T}", CONV_SWEEP, conv.CONFIG, run,
                 lambda cfg: {"ours_ms": gpu_ms(lambda: run(cfg), rep_ms), "timing": "do_bench"}, 0.0, params, device,
                 keys)


def combine_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    from model.triton.moe_combine import moe_combine
    gen = torch.Generator().manual_seed(T)
    K, Dm = 8, 2304
    out = torch.randn(T * K, Dm, generator=gen).cuda().to(DTYPE)
    order = torch.randperm(T * K, generator=gen).cuda()       # row r of out holds pair order[r]
    slot = torch.empty_like(order)
    slot[order] = torch.arange(T * K, device="cuda")
    w = torch.rand(T, K, generator=gen).cuda()
    shared = torch.randn(T, Dm, generator=gen).cuda().to(DTYPE)

    def index_add():  # the combine this replaced
        y = torch.zeros(T, Dm, dtype=torch.float32, device="cuda")
        y.index_add_(0, order // K, out.float() * w.view(-1)[order, None])
        return (y + shared.float()).to(DTYPE)

    y = moe_combine(out, slot.view(T, K), w, shared, DTYPE)
    res = {"ours_ms": gpu_ms(lambda: moe_combine(out, slot.view(T, K), w, shared, DTYPE), rep_ms),
           "peer_ms": gpu_ms(index_add, rep_ms), "rel_err_vs_peer": rel_err(y, index_add()),
           "peer": f"torch-{torch.__version__} index_add"}
    return res, []


# moe_prefill: each fused kernel's tile configs, timed alone against the part of the torch form it replaces
# (results.sweep). The per-thread loads at the default tiles and one other (4ecfe96's sweep picked the defaults:
# records 43a003bc, ce817ad6, 9a20b3e9; 5c8ff18's program order, row tiles fastest, lost: 98de6aaf), then the
# tiles through TMA descriptors at tiles that fit their stages in shared memory, and persistent programs.
_TILES = ("BM", "BN", "BK", "num_warps", "num_stages")
MOE_GATE_UP_SWEEP = ([dict(zip(_TILES, t)) for t in ((64, 256, 64, 8, 3), (128, 128, 64, 8, 4))]
                     + [dict(zip(_TILES, t), tma=True) for t in (
                         (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4))]
                     + [dict(zip(_TILES, t), tma=tma, persistent=True) for t, tma in (
                         ((64, 256, 64, 8, 3), False), ((64, 256, 64, 8, 3), True), ((128, 128, 64, 8, 4), True))])
MOE_DOWN_SWEEP = ([dict(zip(_TILES, t)) for t in ((128, 256, 64, 8, 4), (128, 128, 64, 8, 4))]
                  + [dict(zip(_TILES, t), tma=True) for t in (
                      (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5),
                      (256, 128, 64, 8, 3), (64, 256, 64, 4, 4))]
                  + [dict(zip(_TILES, t), tma=tma, persistent=True) for t, tma in (
                      ((128, 256, 64, 8, 4), False), ((128, 256, 64, 8, 4), True), ((128, 128, 64, 8, 4), True))])


def moe_prefill_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    """The prefill MoE's expert GEMMs for T tokens at the 48B's shapes (256 experts, top-8, D 2304, I 1024, bf16)
    at the rows per expert the model's first router gives (`first_router`), from the same sorted pairs: the fused
    Triton form (`moe_grouped`: dispatch and SwiGLU fused in) against the torch form the model runs (dispatch copy,
    torch's grouped GEMM, silu_mul, grouped GEMM). The sort and the combine, common to both, are left out. The
    sweep times each kernel alone: gate_up (+ dispatch + silu_mul in the torch form) and down."""
    from model import ops
    from model.triton import moe_grouped as mg
    gen = torch.Generator(device="cuda").manual_seed(T)
    K, E, Dm, I = 8, 256, 2304, 1024
    x = torch.randn(T, Dm, generator=gen, device="cuda").to(DTYPE)
    gate_up = (torch.randn(E, 2 * I, Dm, generator=gen, device="cuda") / Dm ** 0.5).to(DTYPE)
    down = (torch.randn(E, Dm, I, generator=gen, device="cuda") / I ** 0.5).to(DTYPE)
    router, desc = first_router("48b-a3b", "cuda")
    order, offs = ops.sort_by_expert(router(x)[0], E)

    def torch_gate_up():
        gu = ops.grouped_mm(ops.moe_dispatch(x, order, K), gate_up.transpose(1, 2), offs)
        return ops.silu_mul(gu[:, :I], gu[:, I:])

    h = torch_gate_up()

    def torch_down(h=h):
        return ops.grouped_mm(h, down.transpose(1, 2), offs)

    def fused(cfg=None):
        return mg.experts(x, order, offs, gate_up, down, K, cfg)

    flops = 2 * T * K * 3 * Dm * I
    ref = torch_down()  # the torch form's output: its down over its own h
    res = {"ours_ms": gpu_ms(fused, rep_ms), "peer_ms": gpu_ms(lambda: torch_down(torch_gate_up()), rep_ms),
           "peer_gate_up_ms": gpu_ms(torch_gate_up, rep_ms), "peer_down_ms": gpu_ms(torch_down, rep_ms),
           "rel_err_vs_peer": rel_err(fused(), ref), "peer": f"torch-{torch.__version__} grouped_mm",
           "router": desc, "cfg": {k: v for k, v in mg.CONFIG.items() if k != "use"},
           "sweep": []}
    cases = [("gate_up", {"gate_up": k}) for k in MOE_GATE_UP_SWEEP] + [("down", {"down": k}) for k in MOE_DOWN_SWEEP]
    for kernel, cfg in cases:
        if kernel == "gate_up":
            run, want = (lambda cfg=cfg: mg.gate_up_silu(x, order, offs, gate_up, K, cfg)), h
        else:
            run, want = (lambda cfg=cfg: mg.down(h, offs, down, cfg)), ref
        try:
            err = rel_err(run(), want)
            res["sweep"].append({"kernel": kernel, "cfg": cfg, "ms": gpu_ms(run, rep_ms), "rel_err_vs_peer": err})
        except Exception as e:  # a config that does not compile or launch is reported, not fatal
            res["sweep"].append({"kernel": kernel, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    res["tflops_ours"], res["tflops_peer"] = (flops / (res[k] * 1e9) for k in ("ours_ms", "peer_ms"))
    log(f"  moe_prefill T={T}: fused {res['ours_ms']:.3f} ms ({res['tflops_ours']:.0f} TFLOP/s), torch form "
        f"{res['peer_ms']:.3f} ms ({res['tflops_peer']:.0f}): gate_up part {res['peer_gate_up_ms']:.3f}, down "
        f"{res['peer_down_ms']:.3f}; sweep:")
    for c in res["sweep"]:
        log(f"    {c['kernel']:8s} {c['cfg']} {c.get('ms', float('nan')):.3f} ms {c.get('error', '')}")
    reasons = [] if res["rel_err_vs_peer"] < 1e-2 else [f"fused output differs from the torch form's: rel_err "
                                                        f"{res['rel_err_vs_peer']:.2e}"]
    reasons += [f"sweep config {c['cfg']} differs from the torch form's: rel_err {c['rel_err_vs_peer']:.2e}"
                for c in res["sweep"] if c.get("rel_err_vs_peer", 0) >= 1e-2]
    return res, reasons


TORCH_PEER_CASES = {"causal_conv1d": conv_case, "moe_combine": combine_case, "moe_prefill": moe_prefill_case}


def run_case(op: str, B: int, T: int, peer, peer_missing: str | None, rep_ms: int, device: str = "cuda") -> dict:
    params = {"op": op, "B": B, "T": T, "H": H, "d": D, "dtype": "bfloat16"}
    if op == "kda_decode_step":
        from model.triton import kda_decode
        params.update(ours_scope="conv-tap update through gated output norm, one launch",
                      peer_scope="fused_recurrent_kda call alone", cfg=dict(kda_decode.DECODE))
    if op == "chunk_kda":
        from model.triton.kda_chunk import CONFIG
        params.update(cfg=dict(CONFIG))
    if op == "mla_decode":
        params.update(H=MLA_H, d=MLA_R + MLA_P, ours_scope="split-K kernel + combine, positions 0..T-1 read",
                      peer_scope="bf16 einsums + softmax over the whole T-position buffer")
    if op in TORCH_PEER_CASES:
        params.update(peer_scope="the torch form the model runs; ours under evaluation" if op == "moe_prefill"
                      else "the torch form this replaces")
    log(f"{op} B={B} T={T} ...")
    try:
        if op == "mla_decode":
            results, reasons = mla_case(T, rep_ms)
        elif op in TORCH_PEER_CASES:
            results, reasons = TORCH_PEER_CASES[op](T, rep_ms)
        else:
            fn = chunk_case if op == "chunk_kda" else decode_case
            results, reasons = fn(T if op == "chunk_kda" else B, peer, rep_ms)
    except Exception as e:  # one failing shape must not end the run
        traceback.print_exc()
        results, reasons = {}, [f"{op} failed: {type(e).__name__}: {e}"]
    results.setdefault("peer", MLA_PEER if op == "mla_decode" else PEER)
    if op in ("chunk_kda", "kda_decode_step"):
        if peer is not None:
            results["peer_version"] = peer[2]
        if peer_missing:
            reasons.append(peer_missing)
    if "peer_ms" in results:
        judge_peer(results, reasons, MLA_PEER_TOL if op == "mla_decode" else PEER_TOL)
    elif not reasons:
        reasons.append("no peer time")
    rec = kernel_record(params, results, reasons, device)
    log(f"  {results}  {rec['verdict']} {reasons}")
    return rec


def _ms(ms) -> str:
    return "-" if ms is None else f"{ms:.4f}"


def summarize(recs: list[dict]) -> None:
    log("summary (GPU ms, do_bench median):")
    for r in recs:
        p, x = r["params"], r["results"]
        ours, theirs = x.get("ours_ms"), x.get("peer_ms")
        line = f"  {p['op']:16s} B={p['B']:<3d} T={p['T']:<6d} ours={_ms(ours)}  {x.get('peer')}={_ms(theirs)}"
        if "speedup" in x:
            line += f"  speedup={x['speedup']:.2f}x  rel_err={x['rel_err_vs_peer']:.2e}"
        log(line + f"  {r['verdict']}")
    for op, key, n, cmp in TARGETS:
        x = next((r["results"] for r in recs
                  if r["params"]["op"] == op and r["params"][key] == n and "speedup" in r["results"]), None)
        if x is not None:
            for how, o, t in (("do_bench", "ours_ms", "peer_ms"), ("graph", "ours_graph_ms", "peer_graph_ms"),
                              ("kernels", "ours_kernel_ms", "peer_kernel_ms")):
                if o in x and t in x:
                    met = x[o] <= x[t] if cmp == "<=" else x[o] < x[t]
                    log(f"  target {op} {key}={n} ({how}): ours {x[o]:.4f} {cmp} {x['peer']} {x[t]:.4f} ms: "
                        f"{'MET' if met else 'MISSED'}")


# ---- MoE decode: router + routing, expert GEMVs -------------------------------------------------------
# 48B-A3B shapes; bf16 experts, fp32 router weight. Peers, in the same run, PyTorch forms of each part: the
# router is the unfused path (x.float(), cuBLAS fp32 GEMM, then `route`); the expert parts gather the chosen
# experts' weights and contract them with einsum (no host sync, as a graph needs), fed the same routing and
# activations, rounding where the kernels round.
MOE_E, MOE_D, MOE_I, MOE_K, MOE_SCALING = 256, 2304, 1024, 8, 2.446
MOE_PEER = "torch-gather-einsum"
NOMINAL_GBPS = 4250.0  # the H200's HBM figure the task is stated against; the measured read ceiling sits beside it
MOE_PARTS = ("moe_router", "moe_gate_up", "moe_down", "moe_layer", "moe_layer_plain", "moe_norm_layer")
# moe_layer_plain's peer: the model's MoE block (ours: router, gate_up and down started early, PDL) against the same three
# launches issued plainly, so that the early starts are measured alone
MOE_PLAIN_PEER = "the same launches without PDL"
# moe_norm_layer: the add+norm before the block and the block, as a decode step runs them (the norm lets the
# router launch as it starts); its peer the same launches with the norm not signalling (the router then overlaps
# only the norm's tail)
MOE_NORM_PEER = "the same launches, the norm not signalling"


def moe_sweep_grid() -> dict[str, list[dict]]:
    """Tile configs the sweep times, per kernel: those whose one-step tile is at most 256 bytes a thread (beyond
    that the loads spill registers)."""
    kp = MOE_K
    return {
        "moe_gate_up": [dict(BLOCK_I=bi, BLOCK_D=bd, num_warps=nw) for bi in (4, 8, 16, 32)
                        for bd in (128, 256, 512) for nw in (4, 8) if 2 * bi * bd * 2 <= 256 * 32 * nw],
        "moe_down": [dict(BLOCK_D=bd, BLOCK_I=bi, num_warps=nw) for bd in (1, 2, 4, 8)
                     for bi in (256, 512, 1024) for nw in (4, 8) if (kp + 1) * bd * bi * 2 <= 256 * 32 * nw],
        # the router also at 1 and 2 warps: the routing after the GEMV is 8 max-reductions over 256 lanes, which
        # within one warp are shuffles, without the shared-memory round trips of a multi-warp reduction
        "moe_router": [dict(BLOCK_E=be, num_warps=nw) for be in (1, 2, 4, 8) for nw in (1, 2, 4, 8)
                       if be * 4096 * 4 <= 512 * 32 * nw],
    }


def torch_gate_up(x, idx, gate_up, sg, su):
    """act [N*(K+1), I] as `moe.expert_gate_up` computes it: silu(w1 x) * (w3 x) per chosen expert, then the
    shared expert; each projection rounded to x's dtype, as F.linear's."""
    N, K = idx.shape
    I = sg.shape[0]
    w = torch.cat([gate_up[idx], torch.cat([sg, su])[None, None].expand(N, 1, 2 * I, -1)], dim=1)
    g, u = torch.einsum("nkod,nd->nko", w, x).split(I, dim=-1)
    return (torch.nn.functional.silu(g) * u).reshape(N * (K + 1), I)


def torch_down(act, idx, w, down, sd):
    """y [N, D] as `moe.expert_down` computes it: each expert's output rounded, weighted and summed in fp32,
    the shared expert (weight 1) added, one rounding."""
    N, K = idx.shape
    a = act.view(N, K + 1, -1)
    out = torch.einsum("nkdi,nki->nkd", down[idx], a[:, :K])
    y = (out.float() * w[..., None]).sum(1) + torch.nn.functional.linear(a[:, K], sd).float()
    return y.to(act.dtype)


class MoeCase:
    """Random weights at the real shapes for GRAPH_LAYERS layers and N tokens. `fns(part, cfg)` gives (ours, peer)
    on the first layer, for the comparison; `calls(part, cfg)` gives both sides' calls over all the layers, for
    timing (graph_ms)."""

    def __init__(self, N: int, device: str = "cuda"):
        import torch.nn.functional as F
        from model.triton import moe
        from model.triton.norms import add_rmsnorm
        g = torch.Generator(device=device).manual_seed(N)
        self.device = device
        E, D, I, K, R = MOE_E, MOE_D, MOE_I, MOE_K, GRAPH_LAYERS

        def rnd(*shape, scale, dtype=DTYPE):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        self.x = rnd(N, D, scale=1.0)
        # the routed experts are shared by the layers (the routers spread the layers over them); each layer has
        # its own router and shared expert
        self.gate_up, self.down = rnd(E, 2 * I, D, scale=D ** -0.5), rnd(E, D, I, scale=I ** -0.5)
        layers = []
        for _ in range(R):
            wr, bias = rnd(E, D, scale=D ** -0.5, dtype=torch.float32), rnd(E, scale=0.01, dtype=torch.float32)
            sg, su, sd = rnd(I, D, scale=D ** -0.5), rnd(I, D, scale=D ** -0.5), rnd(D, I, scale=I ** -0.5)
            idx, w = moe.fused_router(self.x, wr, bias, K, MOE_SCALING, True)
            act = moe.expert_gate_up(self.x, idx, self.gate_up, (sg, su))
            layers.append(dict(wr=wr, bias=bias, sg=sg, su=su, sd=sd, idx=idx, w=w, act=act))
        self.layers = layers
        # bytes a perfect kernel reads from HBM per layer (mean over the layers): each distinct expert's weights
        # once, the shared expert's, the router weight once
        experts = sum(int(torch.unique(L["idx"]).numel()) + 1 for L in layers) / R
        self.bytes = {"moe_router": E * D * 4, "moe_gate_up": round(experts * 2 * I * D * 2),
                      "moe_down": round(experts * D * I * 2)}
        self.bytes["moe_layer"] = sum(self.bytes.values())
        self.bytes["moe_layer_plain"] = self.bytes["moe_layer"]
        # the norm's residual in, residual and normed rows out, and its weight
        self.bytes["moe_norm_layer"] = self.bytes["moe_layer"] + (4 * N * D + D) * self.x.element_size()
        x, gu, dn = self.x, self.gate_up, self.down
        res, nw = rnd(N, D, scale=1.0), rnd(D, scale=1.0)

        def parts(L, cfg):
            return {"moe_router": (lambda: moe.fused_router(x, L["wr"], L["bias"], K, MOE_SCALING, True, cfg),
                                   lambda: moe.route(F.linear(x.float(), L["wr"]), L["bias"], K, MOE_SCALING, True)),
                    "moe_gate_up": (lambda: moe.expert_gate_up(x, L["idx"], gu, (L["sg"], L["su"]), cfg),
                                    lambda: torch_gate_up(x, L["idx"], gu, L["sg"], L["su"])),
                    "moe_down": (lambda: moe.expert_down(L["act"], L["idx"], L["w"], dn, L["sd"], cfg),
                                 lambda: torch_down(L["act"], L["idx"], L["w"], dn, L["sd"])),
                    "moe_layer": (lambda: ours_layer(L), lambda: peer_layer(L)),
                    "moe_layer_plain": (lambda: ours_layer(L), lambda: plain_layer(L)),
                    "moe_norm_layer": (lambda: norm_layer(L, True), lambda: norm_layer(L, False))}

        def ours_layer(L):  # as the model runs it (model.ops.moe)
            return moe.fused_moe_decode(x, L["wr"], L["bias"], K, MOE_SCALING, True, gu, dn, (L["sg"], L["su"], L["sd"]))

        def norm_layer(L, signal):  # the add+norm before the block, then the block (model.layers.DecoderLayer.decode)
            h = add_rmsnorm(x, res, nw, 1e-5, signal=signal)[0]
            return moe.fused_moe_decode(h, L["wr"], L["bias"], K, MOE_SCALING, True, gu, dn, (L["sg"], L["su"], L["sd"]))

        def plain_layer(L):  # the same launches without the early starts
            idx, w = moe.fused_router(x, L["wr"], L["bias"], K, MOE_SCALING, True)
            return moe.expert_down(moe.expert_gate_up(x, idx, gu, (L["sg"], L["su"])), idx, w, dn, L["sd"])

        def peer_layer(L):
            idx, w = moe.route(F.linear(x.float(), L["wr"]), L["bias"], K, MOE_SCALING, True)
            return torch_down(torch_gate_up(x, idx, gu, L["sg"], L["su"]), idx, w, dn, L["sd"])

        self._parts = parts

    def fns(self, part: str, cfg: dict | None = None):
        return self._parts(self.layers[0], cfg)[part]

    def calls(self, part: str, cfg: dict | None = None):
        pairs = [self._parts(L, cfg)[part] for L in self.layers]
        return [o for o, _ in pairs], [p for _, p in pairs]


def moe_compare(part: str, ours, theirs) -> tuple[dict, list[str]]:
    """Outputs of ours vs the peer; the router's must pick the same experts."""
    if part == "moe_router":
        (idx, w), (ridx, rw) = ours, theirs
        o, ro = idx.sort(-1), ridx.sort(-1)
        mismatch = int((o.values != ro.values).any(-1).sum())
        res = {"routing_mismatch_tokens": mismatch,
               "rel_err_vs_peer": rel_err(w.gather(-1, o.indices), rw.gather(-1, ro.indices))}
        return res, [f"router picked other experts than the peer for {mismatch} token(s)"] if mismatch else []
    return {"rel_err_vs_peer": rel_err(ours, theirs)}, []


def moe_measure(case: MoeCase, part: str, cfg: dict | None, rep_ms: int, hbm_gbps: float | None,
                peer_ms: float | None = None) -> tuple[dict, list[str]]:
    """Time ours (and the peer, unless its time is given) on one part; bandwidth against the ideal bytes."""
    ours, theirs = case.fns(part, cfg)
    first, again = ours(), ours()
    res, reasons = moe_compare(part, first, theirs())
    same = all(torch.equal(a, b) for a, b in zip(first, again)) if part == "moe_router" else torch.equal(first, again)
    if not same:
        reasons.append("ours is not deterministic: two runs on the same inputs differ")
    ours_calls, peer_calls = case.calls(part, cfg)
    res["ours_ms"] = graph_ms(ours_calls)
    res["peer_ms"] = peer_ms if peer_ms is not None else graph_ms(peer_calls)
    res["peer"] = {"moe_layer_plain": MOE_PLAIN_PEER, "moe_norm_layer": MOE_NORM_PEER}.get(part, MOE_PEER)
    res["bytes"], res["timing"] = case.bytes[part], graph_timing(GRAPH_LAYERS)
    for who in ("ours", "peer"):
        gbps = case.bytes[part] / (res[f"{who}_ms"] / 1e3) / 1e9
        res[f"{who}_gbps"], res[f"{who}_frac_of_nominal"] = gbps, gbps / NOMINAL_GBPS
        if hbm_gbps:
            res[f"{who}_frac_of_measured"] = gbps / hbm_gbps
    res["measured_read_gbps"] = hbm_gbps
    judge_peer(res, reasons, PEER_TOL)
    return res, reasons


def moe_record(part: str, N: int, cfg: dict | None, results: dict, reasons: list[str], sweep: bool,
               device: str) -> dict:
    from model.triton import moe
    default = {"moe_router": moe.ROUTER, "moe_gate_up": moe.GATE_UP, "moe_down": moe.DOWN}.get(part)
    params = {"kernel": part, "op": "moe_decode", "N": N, "E": MOE_E, "D": MOE_D, "I": MOE_I, "K": MOE_K,
              "shared_experts": 1, "dtype": "bfloat16"}
    if default is not None:
        params["cfg"] = {**default, **(cfg or {})}
    if sweep:
        params["sweep"] = True
    return kernel_record(params, results, reasons, device)


def moe_line(part: str, N: int, cfg, x: dict, rec: dict) -> str:
    c = "" if cfg is None else " " + ",".join(f"{k}={v}" for k, v in cfg.items())
    line = f"  {part:12s} N={N:<2d}{c:40s} ours={_ms(x.get('ours_ms'))}"
    if "ours_gbps" in x:
        line += f" ({x['ours_gbps']:6.0f} GB/s, {x['ours_frac_of_nominal']:.0%} of {NOMINAL_GBPS:.0f}"
        line += f", {x['ours_frac_of_measured']:.0%} of measured)" if "ours_frac_of_measured" in x else ")"
    if "peer_ms" in x:
        line += f"  peer={_ms(x['peer_ms'])} ({x['peer_gbps']:.0f} GB/s)  speedup={x['speedup']:.2f}x"
    return line + f"  {rec['verdict']}"


def run_moe(Ns: list[int], sweep: bool, rep_ms: int, device: str = "cuda") -> list[dict]:
    """The MoE decode kernels at N tokens: each part with its default tiles against the peer, then (sweep) every
    config of `moe_sweep_grid`, the peer's time reused. One `kernel` record per (part, N[, config])."""
    from benchmarks.roofline import measure_read_gbps
    hbm_gbps = measure_read_gbps(device, 1 << 30, 20)
    log(f"moe_decode: measured read ceiling {hbm_gbps:.0f} GB/s (1 GiB x.sum()); nominal {NOMINAL_GBPS:.0f}")
    recs = []
    for N in Ns:
        try:
            case = MoeCase(N, device)
        except Exception as e:  # e.g. out of memory: record it, go on with the next N
            traceback.print_exc()
            why = [f"setup failed: {type(e).__name__}: {e}"]
            recs.append(moe_record("moe_layer", N, None, {"peer": MOE_PEER}, why, False, device))
            continue
        peer_ms = {}
        for part in MOE_PARTS:
            try:
                results, reasons = moe_measure(case, part, None, rep_ms, hbm_gbps)
                peer_ms[part] = results["peer_ms"]
            except Exception as e:  # one failing part must not end the run
                traceback.print_exc()
                results, reasons = {"peer": MOE_PEER}, [f"{part} failed: {type(e).__name__}: {e}"]
            rec = moe_record(part, N, None, results, reasons, False, device)
            log(moe_line(part, N, None, results, rec))
            recs.append(rec)
        if not sweep:
            continue
        for part, cfgs in moe_sweep_grid().items():
            best = None
            for cfg in cfgs:
                try:
                    results, reasons = moe_measure(case, part, cfg, rep_ms, hbm_gbps, peer_ms.get(part))
                except Exception as e:  # a config that fails to compile or run is recorded and skipped
                    traceback.print_exc()
                    results, reasons = {"peer": MOE_PEER}, [f"{part} {cfg} failed: {type(e).__name__}: {e}"]
                rec = moe_record(part, N, cfg, results, reasons, True, device)
                log(moe_line(part, N, cfg, results, rec))
                recs.append(rec)
                if rec["verdict"] == "VALID" and (best is None or results["ours_ms"] < best[1]):
                    best = (cfg, results["ours_ms"])
            if best is not None:
                log(f"  best {part} N={N}: {best[0]} {best[1] * 1e3:.1f} us")
        del case
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return recs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="chunk_kda,kda_decode_step,mla_decode,causal_conv1d,moe_combine",
                    help="comma-separated: chunk_kda, kda_decode_step, mla_decode, moe_decode, mla_decode_layout, "
                         "mla_decode_rows, mla_absorb, moe_prefill_rows, " + ", ".join(TORCH_PEER_CASES))
    ap.add_argument("--chunk-T", type=ints, default=(1024, 8192, 32768))
    ap.add_argument("--decode-B", type=ints, default=(1, 8, 64))
    ap.add_argument("--mla-T", type=ints, default=(1024, 32768, 131072), help="mla_decode contexts (batch 1)")
    ap.add_argument("--prefill-T", type=ints, default=(8192,),
                    help="token counts for the causal_conv1d, moe_combine, moe_prefill_rows and moe_prefill cases")
    ap.add_argument("--moe-N", type=ints, default=(1, 8), help="tokens per MoE decode step (moe_decode)")
    ap.add_argument("--moe-sweep", action="store_true", help="moe_decode: also time every tile config of the grid")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="kda_decode_step: also time every config of DECODE_SWEEP (CUDA-graph timing)")
    ap.add_argument("--chunk-sweep", action="store_true",
                    help="chunk_kda: also time every config of CHUNK_SWEEP at each --chunk-T")
    ap.add_argument("--conv-sweep", action="store_true",
                    help="causal_conv1d: also time every tile config of CONV_SWEEP at each --prefill-T")
    ap.add_argument("--sweep-keys", type=lambda s: set(s.split(",")), default=None,
                    help="comma-separated config keys: the sweeps run only the configs that change nothing else")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")
    args = ap.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    known = {"chunk_kda", "kda_decode_step", "mla_decode", "moe_decode", "mla_decode_layout", "mla_decode_rows",
             "mla_absorb", "moe_prefill_rows", *TORCH_PEER_CASES}
    unknown = set(ops) - known
    if unknown or not ops:
        ap.error(f"--ops: {'unknown ' + str(sorted(unknown)) if unknown else 'names no op'}; the ops: "
                 f"{', '.join(sorted(known))}")
    if args.rep_ms < 1:
        ap.error(f"--rep-ms must be >= 1, got {args.rep_ms}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    peer, peer_missing = None, None
    if {"chunk_kda", "kda_decode_step"} & set(ops):
        peer, peer_missing = load_fla()
        log(f"peer: {f'fla {peer[2]}' if peer else peer_missing}")
    recs = [run_case("chunk_kda", 1, T, peer, peer_missing, args.rep_ms) for T in args.chunk_T if "chunk_kda" in ops]
    if args.chunk_sweep and "chunk_kda" in ops:
        for T in args.chunk_T:
            chunk_sweep(T, args.rep_ms, keys=args.sweep_keys)
    recs += [run_case("kda_decode_step", B, 1, peer, peer_missing, args.rep_ms)
             for B in args.decode_B if "kda_decode_step" in ops]
    if args.decode_sweep and "kda_decode_step" in ops:
        for B in args.decode_B:
            decode_sweep(B, keys=args.sweep_keys)
    recs += [run_case("mla_decode", 1, T, None, None, args.rep_ms) for T in args.mla_T if "mla_decode" in ops]
    recs += [run_case(op, 1, T, None, None, args.rep_ms)
             for T in args.prefill_T for op in TORCH_PEER_CASES if op in ops]
    summarize(recs)
    if args.conv_sweep and "causal_conv1d" in ops:
        for T in args.prefill_T:
            conv_sweep(T, args.rep_ms, keys=args.sweep_keys)
    if "mla_absorb" in ops:
        mla_absorb_sweep()
    if "mla_decode_layout" in ops:
        for T in args.mla_T:
            mla_layout_case(T)
    if "mla_decode_rows" in ops:
        for T in args.mla_T:
            mla_rows_case(T)
    if "moe_prefill_rows" in ops:
        for T in args.prefill_T:
            moe_rows_case(T, args.rep_ms)
    if "moe_decode" in ops:
        run_moe(list(args.moe_N), args.moe_sweep, args.rep_ms)


if __name__ == "__main__":
    main()

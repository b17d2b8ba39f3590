"""Kernel speed: our Triton kernels against a peer on the same inputs, in one process.

    python -m benchmarks.bench_kernels [--ops chunk_kda,kda_decode_step,mla_decode,causal_conv1d,moe_combine]
        [--chunk-T 1024,8192,32768] [--decode-B 1,8,64] [--mla-T 1024,32768,131072] [--prefill-T 8192] [--rep-ms 200]

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
  combine the grouped MoE used before).
Times are medians of `triton.testing.do_bench` (L2 flushed before each call, CUDA events: GPU time, as under
the model's CUDA graph); decode shapes also record back-to-back eager times (host launch cost included).
Outputs are compared in the same run (relative RMS error, fla as the reference). One `kernel` record per shape;
an error in one shape or side becomes an INVALID record and the run goes on. Without fla, ours is still timed
and every record is INVALID with reason "peer unavailable: ...".
"""
from __future__ import annotations

import argparse
import os
import traceback

import torch

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


def gate_inputs(B, T, gen):
    """The model's gate and beta on random activations: g fp32 [B,T,H,D], beta [B,T,H]."""
    from model import kda
    A_log = (torch.rand(H, generator=gen) * 3 - 1).cuda()
    dt_bias = torch.randn(H * D, generator=gen).cuda()
    f = torch.randn(B, T, H * D, generator=gen).cuda().to(DTYPE)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).cuda().to(DTYPE)
    return kda.kda_gate(f, A_log, dt_bias, D), beta


def chunk_case(T: int, peer, rep_ms: int) -> tuple[dict, list[str]]:
    from model.triton.kda_chunk import chunk_kda_fwd
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, T, H, D, generator=gen).cuda().to(DTYPE) for _ in range(3))
    g, beta = gate_inputs(1, T, gen)
    h0 = torch.randn(1, H, D, D, generator=gen).cuda()

    def ours():
        return chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    o, ht = ours()
    res, reasons = {"ours_ms": gpu_ms(ours, rep_ms)}, []
    if not (torch.isfinite(o).all() and torch.isfinite(ht).all()):
        reasons.append("ours produced non-finite values")
    if peer is not None:
        def theirs():
            return peer[0](q, k, v, g, beta, scale=D ** -0.5, initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)

        time_peer(theirs, lambda out: {"rel_err_vs_peer": rel_err(o, out[0]),
                                       "state_rel_err_vs_peer": rel_err(ht, out[1])}, res, reasons, rep_ms)
    return res, reasons


def decode_case(B: int, peer, rep_ms: int) -> tuple[dict, list[str]]:
    from model import kda
    from model.triton.kda_decode import fused_kda_decode
    gen = torch.Generator().manual_seed(B)
    C = 3 * H * D
    qkv_raw = torch.randn(B, C, generator=gen).cuda().to(DTYPE)
    taps = torch.randn(B, W - 1, C, generator=gen).cuda().to(DTYPE)
    conv_w = (0.5 * torch.randn(C, W, generator=gen)).cuda().to(DTYPE)
    f = torch.randn(B, H * D, generator=gen).cuda().to(DTYPE)
    A_log = (torch.rand(H, generator=gen) * 3 - 1).cuda()
    dt_bias = torch.randn(H * D, generator=gen).cuda()
    b_raw = torch.randn(B, H, generator=gen).cuda().to(DTYPE)
    out_gate = torch.randn(B, H * D, generator=gen).cuda().to(DTYPE)
    norm_w = (1 + 0.1 * torch.randn(D, generator=gen)).cuda().to(DTYPE)
    state = torch.randn(B, H, D, D, generator=gen).cuda()
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

    res, reasons = {"ours_ms": gpu_ms(ours, rep_ms), "ours_eager_ms": eager_ms(ours)}, []
    if not torch.isfinite(o).all() or not torch.isfinite(ours()).all():
        reasons.append("ours produced non-finite values")
    if peer is not None:
        s_peer = state.clone()

        def theirs():
            return peer[1](q, k, v, g, beta, scale=D ** -0.5, initial_state=s_peer, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)

        time_peer(theirs, lambda out: {"rel_err_vs_peer": rel_err(o, out[0][:, 0])}, res, reasons, rep_ms,
                  eager=True)
    return res, reasons


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
    res["rel_err_vs_fp32_ref"] = rel_err(o, ops.mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale))
    if not torch.isfinite(o).all():
        reasons.append("ours produced non-finite values")
    if not res["rel_err_vs_fp32_ref"] <= 1e-4:
        reasons.append(f"ours differs from the fp32 torch reference: {res['rel_err_vs_fp32_ref']:.3g} > 1e-4")
    time_peer(lambda: einsum_mla_decode(q_lat, q_pe, c, k_pe, pos, scale),
              lambda out: {"rel_err_vs_peer": rel_err(o, out)}, res, reasons, rep_ms)
    return res, reasons


def conv_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    from model import kda
    from model.triton.conv import causal_conv1d
    gen = torch.Generator().manual_seed(T)
    C = 3 * H * D
    x = torch.randn(1, T, C, generator=gen).cuda().to(DTYPE)
    w = (0.5 * torch.randn(C, W, generator=gen)).cuda().to(DTYPE)
    taps = torch.randn(1, W - 1, C, generator=gen).cuda().to(DTYPE)
    y, ref = causal_conv1d(x, w, taps)[0], kda.causal_conv1d(x, w, taps)[0]
    res = {"ours_ms": gpu_ms(lambda: causal_conv1d(x, w, taps), rep_ms),
           "peer_ms": gpu_ms(lambda: kda.causal_conv1d(x, w, taps), rep_ms), "rel_err_vs_peer": rel_err(y, ref),
           "bits_differing": int((y != ref).sum()), "peer": f"torch-{torch.__version__}"}
    return res, [] if res["bits_differing"] == 0 else [f"{res['bits_differing']} output elements differ from torch's"]


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


TORCH_PEER_CASES = {"causal_conv1d": conv_case, "moe_combine": combine_case}


def run_case(op: str, B: int, T: int, peer, peer_missing: str | None, rep_ms: int) -> dict:
    from records import store
    params = {"op": op, "B": B, "T": T, "H": H, "d": D, "dtype": "bfloat16"}
    if op == "kda_decode_step":
        params.update(ours_scope="conv-tap update through gated output norm, one launch",
                      peer_scope="fused_recurrent_kda call alone")
    if op == "mla_decode":
        params.update(H=MLA_H, d=MLA_R + MLA_P, ours_scope="split-K kernel + combine, positions 0..T-1 read",
                      peer_scope="bf16 einsums + softmax over the whole T-position buffer")
    if op in TORCH_PEER_CASES:
        params.update(peer_scope="the torch form this replaces")
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
        results["speedup"] = results["peer_ms"] / results["ours_ms"]
        tol = MLA_PEER_TOL if op == "mla_decode" else PEER_TOL
        if not results["rel_err_vs_peer"] <= tol:
            reasons.append(f"ours differs from {results['peer']}: relative RMS error {results['rel_err_vs_peer']:.3g} "
                           f"> {tol}")
    elif not reasons:
        reasons.append("no peer time")
    rec = store.make_record("kernel", preset=None, dtype="bfloat16", device=torch.cuda.get_device_name(),
                            weights=None, params=params, results=results,
                            verdict="INVALID" if reasons else "VALID", reasons=reasons)
    store.append(rec)
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
            met = x["ours_ms"] <= x["peer_ms"] if cmp == "<=" else x["ours_ms"] < x["peer_ms"]
            log(f"  target {op} {key}={n}: ours {cmp} {x['peer']}: {'MET' if met else 'MISSED'}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="chunk_kda,kda_decode_step,mla_decode," + ",".join(TORCH_PEER_CASES))
    ap.add_argument("--chunk-T", default="1024,8192,32768")
    ap.add_argument("--decode-B", default="1,8,64")
    ap.add_argument("--mla-T", default="1024,32768,131072", help="mla_decode contexts (batch 1)")
    ap.add_argument("--prefill-T", default="8192", help="token counts for the causal_conv1d and moe_combine cases")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    ops = args.ops.split(",")
    peer, peer_missing = None, None
    if {"chunk_kda", "kda_decode_step"} & set(ops):
        peer, peer_missing = load_fla()
        log(f"peer: {f'fla {peer[2]}' if peer else peer_missing}")
    recs = [run_case("chunk_kda", 1, int(T), peer, peer_missing, args.rep_ms)
            for T in args.chunk_T.split(",") if T and "chunk_kda" in ops]
    recs += [run_case("kda_decode_step", int(B), 1, peer, peer_missing, args.rep_ms)
             for B in args.decode_B.split(",") if B and "kda_decode_step" in ops]
    recs += [run_case("mla_decode", 1, int(T), None, None, args.rep_ms)
             for T in args.mla_T.split(",") if T and "mla_decode" in ops]
    recs += [run_case(op, 1, int(T), None, None, args.rep_ms)
             for T in args.prefill_T.split(",") if T for op in TORCH_PEER_CASES if op in ops]
    summarize(recs)


if __name__ == "__main__":
    main()

"""mla_decode_rows: the positions-as-rows split kernel of `mla_decode` against the heads-as-rows one
(model.triton.mla_decode's CONFIG `rows`), graph-timed per layer at each --mla-T where the layout's loop step lets
both run."""
from __future__ import annotations

import traceback

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import DTYPE
from benchmarks.kernels.mla_decode import MLA_H, MLA_LAYERS, MLA_P, MLA_R, MLA_T, cache_layers, mla_fp32_ref
from benchmarks.kernels.spec import Bench, Sweep
from benchmarks.timing import log

MLA_POSITIONS_WARPS = (4, 8)  # the positions kernel's warps that mla_rows_case times


def layer_inputs(T: int, device: str = "cuda") -> tuple:
    """(q_lat, q_pe, caches, pos, scale) at this module's MLA shapes: MLA_LAYERS caches of T positions."""
    return cache_layers(T, MLA_H, MLA_R, MLA_P, MLA_LAYERS, device)


def mla_rows_case(T: int, device: str = "cuda") -> list[dict]:
    """mla_decode with CONFIG's rows = "positions" (ours, at each of MLA_POSITIONS_WARPS; 4 is the default) against
    "heads" (peer "heads-rows"), both in default_layout, graph-timed over MLA_LAYERS layers' calls (each its own
    cache), batch 1, a buffer of T positions, the query at T-1; each checked against the peer's output and the fp32
    torch reference. One record per warps; none where the layout's loop step is not _BL (SHORT's steps of 32 at
    short buffers), where both would run the heads-as-rows kernel."""
    from model import ops
    from model.triton import mla_decode as ml
    dev = torch.device(device)
    theirs = dict(rows="heads")
    if ml.plan(T, 1, MLA_H, DTYPE, dev, cfg=dict(rows="positions")).rows != "positions":
        log(f"  mla_decode_rows T={T}: layout {ml.plan(T, 1, MLA_H, DTYPE, dev)} runs the heads-as-rows kernel "
            f"either way; not timed")
        return []
    q_lat, q_pe, caches, pos, scale = layer_inputs(T, device)
    c, k_pe = caches[0]
    read = T * (MLA_R + MLA_P) * c.element_size()   # the cache bytes a call reads

    def timed(cfg):
        return common.graph_ms([lambda L=L: ml.mla_decode(q_lat, q_pe, L[0], L[1], pos, scale, cfg=cfg)
                                for L in caches])

    recs, peer_ms, o_peer, ref = [], None, None, None
    for warps in MLA_POSITIONS_WARPS:
        ours = dict(rows="positions", positions_warps=warps)
        layout = ml.plan(T, 1, MLA_H, DTYPE, dev, cfg=ours)
        params = {"op": "mla_decode_rows", "B": 1, "T": T, "H": MLA_H, "d": MLA_R + MLA_P, "dtype": "bfloat16",
                  "split": layout.split, "heads": layout.heads, "step": layout.step, "warps": warps}
        results, reasons = {"peer": "heads-rows", "timing": common.graph_timing(MLA_LAYERS)}, []
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
            common.versus(results, reasons, o, o_peer, 1e-4)
        except Exception as e:  # record the failure, go on with the next warps
            traceback.print_exc()
            reasons.append(f"mla_decode_rows failed: {type(e).__name__}: {e}")
        rec = common.kernel_record(params, results, reasons, device)
        recs.append(rec)
        log(f"  mla_decode_rows T={T:<6d} split={layout.split} heads={layout.heads} warps={warps}: "
            f"positions={common.fmt_ms(results.get('ours_ms'))} ({results.get('gbps', 0):.0f} GB/s) "
            f"heads={common.fmt_ms(results.get('peer_ms'))} (graph, per layer)  {rec['verdict']} {reasons}")
    return recs


BENCH = Bench(
    op="mla_decode_rows", inputs=layer_inputs, ours="model.triton.mla_decode:mla_decode", peer="heads-rows",
    peer_fn=None,
    check="relative RMS error <= 1e-4 against the heads-as-rows kernel's output and the fp32 torch reference",
    tol=1e-4, sizes=MLA_T, study=lambda sizes, rep_ms, swept: [r for T in sizes for r in mla_rows_case(T)],
    sweep=Sweep(lambda: [dict(rows="positions", positions_warps=w) for w in MLA_POSITIONS_WARPS], 1e-4))

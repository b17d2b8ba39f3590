"""mla_decode_layout: `mla_decode` (split kernel + combine) in `default_layout` against the all-heads layout (peer
"all-heads": `default_split`, 32 heads a program), for each SHORT of MLA_SHORTS, `graph_ms` over MLA_LAYERS layers'
calls (each its own cache), batch 1, a buffer of T positions (--mla-T), the query at T-1; ours is checked against
the peer's output and the fp32 torch reference in the same run."""
from __future__ import annotations

import traceback

import torch

from benchmarks.kernels import common
from benchmarks.kernels.mla_decode import MLA_H, MLA_LAYERS, MLA_P, MLA_R, MLA_T, cache_layers, mla_fp32_ref
from benchmarks.kernels.spec import Bench, Sweep
from benchmarks.timing import log

MLA_SHORTS = (dict(heads=16, BL=32), dict(heads=16, BL=64))  # the SHORT layouts mla_decode_layout times


def layer_inputs(T: int, device: str = "cuda") -> tuple:
    """(q_lat, q_pe, caches, pos, scale) at this module's MLA shapes: MLA_LAYERS caches of T positions."""
    return cache_layers(T, MLA_H, MLA_R, MLA_P, MLA_LAYERS, device)


def mla_layout_case(T: int, device: str = "cuda") -> list[dict]:
    """mla_decode in default_layout for each SHORT of MLA_SHORTS against the all-heads layout, graph-timed."""
    import model.triton as mt
    from model import ops
    from model.triton import mla_decode as ml
    q_lat, q_pe, caches, pos, scale = layer_inputs(T, device)
    dev = torch.device(device)
    split = ml.default_split(T, 1, dev)
    c, k_pe = caches[0]
    ref = ops.mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale)
    recs, peer_ms = [], None
    for short in MLA_SHORTS:
        with mt.overrides({"mla_decode.SHORT": short}):
            layout = ml.default_layout(T, 1, MLA_H, dev)
            params = {"op": "mla_decode_layout", "B": 1, "T": T, "H": MLA_H, "d": MLA_R + MLA_P,
                      "dtype": "bfloat16", "short": short, "split": layout[0], "heads": layout[1],
                      "peer_split": split}
            results, reasons = {"peer": "all-heads", "timing": common.graph_timing(MLA_LAYERS)}, []
            try:
                o = ml.mla_decode(q_lat, q_pe, c, k_pe, pos, scale)
                o_peer = ml.mla_decode(q_lat, q_pe, c, k_pe, pos, scale, split=split)
                results["ours_ms"] = common.graph_ms([lambda L=L: ml.mla_decode(q_lat, q_pe, L[0], L[1], pos, scale)
                                                      for L in caches])
                if peer_ms is None:
                    peer_ms = common.graph_ms([lambda L=L: ml.mla_decode(q_lat, q_pe, L[0], L[1], pos, scale,
                                                                         split=split)
                                               for L in caches])
                results["peer_ms"] = peer_ms
                mla_fp32_ref(results, reasons, o, ref)
                common.versus(results, reasons, o, o_peer, 1e-4)
            except Exception as e:  # record the failure, go on with the next layout
                traceback.print_exc()
                reasons.append(f"mla_decode_layout failed: {type(e).__name__}: {e}")
        rec = common.kernel_record(params, results, reasons, device)
        recs.append(rec)
        log(f"  mla_decode_layout T={T:<6d} SHORT={short} -> split={layout[0]} heads={layout[1]}: "
            f"ours={common.fmt_ms(results.get('ours_ms'))} all-heads(split={split})="
            f"{common.fmt_ms(results.get('peer_ms'))} (graph, per layer)  {rec['verdict']} {reasons}")
    return recs


BENCH = Bench(
    op="mla_decode_layout", inputs=layer_inputs, ours="model.triton.mla_decode:mla_decode", peer="all-heads",
    peer_fn=None, check="relative RMS error <= 1e-4 against the all-heads layout's output and the fp32 torch reference",
    tol=1e-4, sizes=MLA_T, study=lambda sizes, rep_ms, swept: [r for T in sizes for r in mla_layout_case(T)],
    sweep=Sweep(lambda: MLA_SHORTS, 1e-4))

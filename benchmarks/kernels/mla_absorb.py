"""mla_absorb: the tile configs of the MLA decode step's absorbed up-projections (`mla_absorb`) against the default
config, graph-timed per layer at the step's two fixed shapes."""
from __future__ import annotations

import traceback

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import DTYPE, rel_err
from benchmarks.kernels.mla_decode import MLA_H, MLA_LAYERS, MLA_R
from benchmarks.kernels.spec import Bench, Size, Sweep
from benchmarks.timing import log

ABSORB_SWEEP = [dict(BN=bn, BK=bk, num_warps=nw) for bn in (16, 32, 64) for bk in (64, 128)
                for nw in (2, 4, 8)]
ABSORB_TOL = 1e-5  # a config's output against the default config's
FIXED = Size(None, (), "the decode step's two shapes, batch 1")


def absorb_inputs(device: str = "cuda") -> dict:
    """Seeded inputs of both shapes over MLA_LAYERS layers' kv_b_proj weights: {"q": (q_nope [1, H, 128], the W_uk
    of each layer [H, 128, R]), "o": (o_lat [1, H, R] fp32, the W_uv^T of each layer: the transposed view, R
    contiguous)}."""
    g = torch.Generator(device=device).manual_seed(0)
    dn = dv = 128
    ws = [(torch.randn(MLA_H, dn + dv, MLA_R, generator=g, device=device) * MLA_R ** -0.5).to(DTYPE)
          for _ in range(MLA_LAYERS)]
    return {"q": (torch.randn(1, MLA_H, dn, generator=g, device=device).to(DTYPE), [w[:, :dn] for w in ws]),
            "o": (torch.randn(1, MLA_H, MLA_R, generator=g, device=device), [w[:, dn:].transpose(1, 2) for w in ws])}


def mla_absorb_sweep(device: str = "cuda") -> list[dict]:
    """`mla_absorb` at the MLA decode step's two shapes, each config of ABSORB_SWEEP against the default
    (`mla_decode.ABSORB`, peer "default"), `graph_ms` over MLA_LAYERS layers' kv_b_proj weights, batch 1, the
    output checked against the default's. q: q_nope [1, H, 128] @ W_uk [H, 128, R]; o: o_lat [1, H, R] fp32 @
    W_uv^T (the transposed view, R contiguous)."""
    from model.triton import mla_decode as ml
    shapes = absorb_inputs(device)
    recs = []
    for name, (x, layer_ws) in shapes.items():
        ref, default = ml.mla_absorb(x, layer_ws[0]), dict(ml.absorb_config(x.shape[-1]))
        peer_ms = common.graph_ms([lambda w=w: ml.mla_absorb(x, w) for w in layer_ws])
        best = None
        for cfg in ABSORB_SWEEP:
            params = {"op": "mla_absorb", "shape": name, "B": 1, "H": MLA_H, "K": x.shape[-1],
                      "N": layer_ws[0].shape[-1], "dtype": "bfloat16", "sweep": True,
                      "cfg": {**default, **cfg}}
            results, reasons = {"peer": "default", "peer_cfg": default, "peer_ms": peer_ms,
                                "timing": common.graph_timing(MLA_LAYERS)}, []
            try:
                err = rel_err(ml.mla_absorb(x, layer_ws[0], cfg), ref)
                results["rel_err_vs_default"] = err
                if not err <= ABSORB_TOL:
                    reasons.append(f"differs from the default config: relative RMS error {err:.3g}")
                results["ours_ms"] = common.graph_ms([lambda w=w: ml.mla_absorb(x, w, cfg) for w in layer_ws])
                results["speedup"] = peer_ms / results["ours_ms"]
            except Exception as e:  # a config that fails to compile or run is recorded and skipped
                traceback.print_exc()
                reasons.append(f"{cfg} failed: {type(e).__name__}: {e}")
            rec = common.kernel_record(params, results, reasons, device)
            recs.append(rec)
            if rec["verdict"] == "VALID" and (best is None or results["ours_ms"] < best[1]):
                best = (cfg, results["ours_ms"])
        log(f"  mla_absorb {name}: default {default} {peer_ms * 1e3:.2f} us; best {best[0] if best else None} "
            f"{best[1] * 1e3 if best else float('nan'):.2f} us (graph, per layer)")
    return recs


BENCH = Bench(
    op="mla_absorb", inputs=absorb_inputs, ours="model.triton.mla_decode:mla_absorb", peer="default",
    peer_fn="model.triton.mla_decode:mla_absorb",
    check="each config's output against the default config's by relative RMS error <= ABSORB_TOL",
    tol=ABSORB_TOL, sizes=FIXED, study=lambda sizes, rep_ms, swept: mla_absorb_sweep(),
    sweep=Sweep(lambda: ABSORB_SWEEP, ABSORB_TOL))

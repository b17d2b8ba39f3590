"""chunk_kda: the KDA chunk prefill, batch 1, fp32 initial state: our `chunk_kda_fwd` against fla's `chunk_kda`, both
L2-normalising q/k in the kernel and taking the same q, k, v, g (log decay, fp32) and beta (after the sigmoid).
do_bench times both sides (a kernel pair of milliseconds); output and final state are compared with fla's.
`--chunk-sweep` times every config of CHUNK_SWEEP at each --chunk-T."""
from __future__ import annotations

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import D, DTYPE, H, PEER, PEER_TOL, rel_err
from benchmarks.kernels.spec import Bench, Size, Sweep

CHUNK_T = Size("--chunk-T", (1024, 8192, 32768))


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
    res, reasons = {"ours_ms": common.gpu_ms(ours, rep_ms)}, []
    if not (torch.isfinite(o).all() and torch.isfinite(ht).all()):
        reasons.append("ours produced non-finite values")
    if peer is not None:
        # fla 0.6.0 autotunes its KDA kernels on keys without T and keeps the result on disk (FLA_CACHE_RESULTS): at
        # this length it may run the config tuned at another (its readings move; "Targets" in docs/RESULTS.md)
        def theirs():
            return peer[0](q, k, v, g, beta, scale=D ** -0.5, initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)

        common.time_peer(theirs, lambda out: {"rel_err_vs_peer": rel_err(o, out[0]),
                                              "state_rel_err_vs_peer": rel_err(ht, out[1])}, res, reasons, rep_ms)
    return res, reasons


# model.triton.kda_chunk's launch configs around the default (bf16 inputs; docs/kernels.md has how the defaults were
# picked): the chunk length with the prep's warps (but one warp for chunks of 64, which spills 6 KB per thread), the
# prep's slice, the scan's columns, warps and dot precision, the prep's dot precision, the pipeline stages of either
# kernel and the prep's register cap; each key's other values are the default's.
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
    return common.sweep(f"chunk_kda T={T}", CHUNK_SWEEP, CONFIG, run,
                        lambda cfg: {"ours_ms": common.gpu_ms(lambda: run(cfg), rep_ms), "timing": "do_bench"},
                        CHUNK_SWEEP_TOL, params, device, keys)


def _params() -> dict:
    import model.triton as mt
    from model.triton.kda_chunk import CONFIG
    return dict(cfg=mt.plain(CONFIG))


BENCH = Bench(
    op="chunk_kda", inputs=chunk_inputs, ours="model.triton.kda_chunk:chunk_kda_fwd", peer=PEER,
    peer_fn="fla.ops.kda:chunk_kda",
    check="output and final state against fla's by relative RMS error (the output's must be <= PEER_TOL)",
    tol=PEER_TOL, sizes=CHUNK_T, case=chunk_case, params=_params, fla=True, default=True,
    sweep=Sweep(lambda: CHUNK_SWEEP, CHUNK_SWEEP_TOL, "--chunk-sweep",
                "chunk_kda: also time every config of CHUNK_SWEEP at each --chunk-T",
                lambda T, rep_ms, keys: chunk_sweep(T, rep_ms, keys=keys)),
    targets=(("T", 8192, "<="),))

"""kda_decode_step: one token per sequence at batch B: our whole step in one launch (conv-tap update, conv + SiLU,
gate, beta, L2 norm, state update, output, gated output RMSNorm) against fla's `fused_recurrent_kda` call alone
(given the post-conv q/k/v, the gate and beta, L2 norm in its kernel). The issue's target compares exactly these.

Timed by do_bench and back to back (eager: the host's launch cost included), by `graph_ms` over GRAPH_LAYERS layers'
states in one graph (`ours_graph_ms`, `peer_graph_ms`: as the model's decode graph runs them; unlike do_bench it
tells ~10 us kernels apart) and by the profiler (`ours_kernel_ms`, `peer_kernel_ms`: the kernels' own device time).
`--decode-sweep` times every config of DECODE_SWEEP, graph-timed, at each --decode-B."""
from __future__ import annotations

import traceback

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import D, DTYPE, H, PEER, PEER_TOL, W, rel_err
from benchmarks.kernels.spec import Bench, Size, Sweep

DECODE_B = Size("--decode-B", (1, 8, 64))


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

    res, reasons = {"ours_ms": common.gpu_ms(ours, rep_ms), "ours_eager_ms": common.eager_ms(ours),
                    "ours_kernel_ms": common.kernel_ms(ours, device), "timing_kernel": common.KERNEL_TIMING}, []
    if not torch.isfinite(o).all() or not torch.isfinite(ours()).all():
        reasons.append("ours produced non-finite values")
    if peer is not None:
        s_peer = state.clone()

        def theirs():
            return peer[1](q, k, v, g, beta, scale=D ** -0.5, initial_state=s_peer, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)

        common.time_peer(theirs, lambda out: {"rel_err_vs_peer": rel_err(o, out[0][:, 0])}, res, reasons, rep_ms,
                         eager=True)
        if "peer_ms" in res:
            res["peer_kernel_ms"] = common.kernel_ms(theirs, device)
    layers = [(state.clone(), taps.clone()) for _ in range(common.GRAPH_LAYERS)]
    res["ours_graph_ms"] = common.graph_ms([lambda L=L: fused_kda_decode(qkv_raw, L[1], conv_w, f, A_log, dt_bias,
                                                                         b_raw, L[0], out_gate=out_gate,
                                                                         norm_weight=norm_w)
                                            for L in layers])
    res["timing_graph"] = common.graph_timing(common.GRAPH_LAYERS)
    if peer is not None and "peer_ms" in res:
        del layers
        try:
            res["peer_graph_ms"] = common.graph_ms([lambda s=s: peer[1](q, k, v, g, beta, scale=D ** -0.5,
                                                                        initial_state=s, output_final_state=True,
                                                                        use_qk_l2norm_in_kernel=True)
                                                    for s in [state.clone() for _ in range(common.GRAPH_LAYERS)]])
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
                # the whole state in one program (the default at every batch); 8 or 16 warps on it were dropped
                # (several times slower, and they spill: docs/kernels.md)
                + [dict(grid="strided", BV=bv, num_warps=nw) for bv, nw in ((64, 8), (128, 4))]
                # o from the state before the update (kda_decode._update_columns' EARLY_O), at the fastest configs
                # of each kind
                + [dict(grid=g, BV=bv, num_warps=nw, early_o=True)
                   for g, bv, nw in (("strided", 128, 4), ("adjacent", 32, 1), ("adjacent", 32, 2),
                                     ("adjacent", 16, 4), ("strided", 32, 2), ("strided", 64, 4))])


# A config's bf16 output against the default's: another fp32 summation order flips the rounding of a few elements
# by one bf16 ulp (2^-8 relative; relative RMS errors of 3e-5 to 5e-5 at B=64), which a 1e-5 bound called a
# difference; a wrong column block or state row gives errors of order 1.
DECODE_SWEEP_TOL = 1e-3


def decode_sweep(B: int, device: str = "cuda", keys: set[str] | None = None) -> list[dict]:
    """Our decode step at each config of DECODE_SWEEP, timed as the model runs it (`graph_ms` over 32 layers,
    each with its own state and conv taps), the output checked against the default's. One record per config."""
    from model.triton import kda_decode
    from model.triton.kda_decode import fused_kda_decode
    qkv_raw, taps, conv_w, f, A_log, dt_bias, b_raw, out_gate, norm_w, state = decode_step_inputs(B, device)
    # each timed layer its own state and conv taps (the first layer's are the seeded ones)
    layers = [(state, taps)] + [(torch.randn_like(state), torch.randn_like(taps))
                                for _ in range(common.GRAPH_LAYERS - 1)]

    def step(L, cfg):
        return fused_kda_decode(qkv_raw, L[1].clone(), conv_w, f, A_log, dt_bias, b_raw, L[0].clone(),
                                out_gate=out_gate, norm_weight=norm_w, cfg=cfg)

    # the timing graphs update each layer's state and taps in place: outputs are compared from a pristine copy
    first = tuple(t.clone() for t in layers[0])

    def timed(cfg):
        return {"ours_ms": common.graph_ms([lambda L=L: fused_kda_decode(qkv_raw, L[1], conv_w, f, A_log, dt_bias,
                                                                         b_raw, L[0], out_gate=out_gate,
                                                                         norm_weight=norm_w, cfg=cfg)
                                            for L in layers]),
                "timing": common.graph_timing(len(layers))}

    params = {"op": "kda_decode_step", "B": B, "T": 1, "H": H, "d": D, "dtype": "bfloat16"}
    return common.sweep(f"kda_decode_step B={B}", DECODE_SWEEP, kda_decode.DECODE, lambda cfg: (step(first, cfg),),
                        timed, DECODE_SWEEP_TOL, params, device, keys)


def _params() -> dict:
    from model.triton import kda_decode
    return dict(ours_scope="conv-tap update through gated output norm, one launch",
                peer_scope="fused_recurrent_kda call alone", cfg=dict(kda_decode.DECODE))


BENCH = Bench(
    op="kda_decode_step", inputs=decode_step_inputs, ours="model.triton.kda_decode:fused_kda_decode", peer=PEER,
    peer_fn="fla.ops.kda:fused_recurrent_kda",
    check="output against fla's by relative RMS error <= PEER_TOL", tol=PEER_TOL, sizes=DECODE_B, size_key="B",
    case=decode_case, params=_params, fla=True, default=True,
    sweep=Sweep(lambda: DECODE_SWEEP, DECODE_SWEEP_TOL, "--decode-sweep",
                "kda_decode_step: also time every config of DECODE_SWEEP (CUDA-graph timing)",
                lambda B, rep_ms, keys: decode_sweep(B, keys=keys)),
    targets=(("B", 1, "<"), ("B", 64, "<")))

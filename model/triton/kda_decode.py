"""One KDA decode step in one Triton launch: the fast twin of composing `model.kda.causal_conv1d`,
`kda_gate`, sigmoid and `recurrent_kda_step` (and, optionally, the gated output RMSNorm).

One program per (sequence, head, block of 32 state columns; 16 from batch 16 on): at batch 1 that is 128
programs, each moving 16 KB of fp32 state in and out.

Optionally (`gate_b_weight`) the step also folds in the f_b and g_b projections that produce the forget-gate
input f and the output gate from f_a(x)|g_a(x) (the batched GEMV of `model.kda.gate_b_proj`, one cuBLAS
launch of ~3.2 us per layer at batch 1 otherwise). Every block needs f for all d channels of its head (the
decay scales every row of its state block), so each block computes them itself: a [d, d] slice of f_b's
weight (32 KB in bf16) read by the head's d/BV blocks, from L2 after the first. Computing f once per head
would need the head's blocks to wait on one another, which at batch 8 and above (more programs than fit on
the GPU at once) can deadlock. The gate is needed only by the finisher's output norm: each block computes
the gate of its own BV columns (a [BV, d] slice, no redundancy, off the finisher's tail) and stores it for
the finisher, as it stores its o.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt


# Launch configs (state columns per program, warps) by batch, from the CUDA-graph-timed sweep of
# `bench_kernels --ops kda_decode_step --decode-sweep` (run of e4977e1): 32 columns up to batch 8 (B=1: 7.1 us
# `11880e09`, 16 columns 7.3 us `9f9fb6a0`; B=8: 21.0 us `5fdaad58` against 22.4 us `9780df3b`), 16 columns from
# LARGE_BATCH on (B=64: 133.9 us `096a1285` against 147.6 us `246945f2`). The sweep measured batches 1, 8 and 64
# only: the switch at 16 is a guess between them.
DECODE = dict(BV=32, num_warps=4)
DECODE_LARGE = dict(BV=16, num_warps=4)
LARGE_BATCH = 16
# Weight columns per step of the folded f_b|g_b GEMV (gate_b_weight): a [d, 32] bf16 tile is 32 values a thread at
# 4 warps.
FOLD_BJ = 32


def decode_config(B: int) -> dict:
    """The launch config for batch B (see above)."""
    return DECODE_LARGE if B >= LARGE_BATCH else DECODE


@triton.jit
def _short_conv(x, taps, conv_w, i_b, ch, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Depthwise causal conv of the current input with the W-1 stored taps, then SiLU, for channels ch.

    Rounds where `causal_conv1d` does: inputs to the weight dtype, the conv and the SiLU results to
    the weight dtype, then to the input dtype. Returns the activation as fp32.
    """
    j = tl.arange(0, WP)
    m_j = (j < W - 1)[:, None]
    old = tl.load(taps + (i_b * (W - 1) + j[:, None]).to(tl.int64) * C + ch[None, :], mask=m_j, other=0.)
    b_x = tl.load(x + i_b.to(tl.int64) * C + ch)
    w_taps = tl.load(conv_w + ch[None, :] * W + j[:, None], mask=m_j, other=0.)
    w_now = tl.load(conv_w + ch * W + (W - 1))
    wdt = conv_w.dtype.element_ty
    xdt = x.dtype.element_ty
    acc = tl.sum(old.to(xdt).to(wdt).to(tl.float32) * w_taps.to(tl.float32), axis=0)
    acc += b_x.to(wdt).to(tl.float32) * w_now.to(tl.float32)
    y = acc.to(wdt).to(tl.float32)
    return (y * tl.sigmoid(y)).to(wdt).to(xdt).to(tl.float32)


@triton.jit(noinline=True)
def _shift_taps(x, taps, i_b, ch0, N: tl.constexpr, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Drop the oldest tap and append the current input (taps hold the last W-1 inputs), for the N
    channels from ch0. Rereads what it moves; a separate function, so that its registers are not
    added to the state update's."""
    j = tl.arange(0, WP)
    ch = ch0 + tl.arange(0, N)
    p_taps = taps + (i_b * (W - 1) + j[:, None]).to(tl.int64) * C + ch[None, :]
    keep = ((j >= 1) & (j < W - 1))[:, None]
    old = tl.load(p_taps, mask=keep, other=0.)
    b_x = tl.load(x + i_b.to(tl.int64) * C + ch)
    tl.debug_barrier()  # every thread has read the rows before any row is overwritten
    tl.store(p_taps - C, old, mask=keep)
    tl.store(taps + (i_b * (W - 1) + W - 2).to(tl.int64) * C + ch, b_x.to(taps.dtype.element_ty))


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20); log1p(z) via log(1+z) * z / ((1+z) - 1) keeps tiny z exact
    z = tl.exp(x)
    one_z = 1. + z
    log1p = tl.where(one_z == 1., z, tl.log(one_z) * z / (one_z - 1.))
    return tl.where(x > 20., x, log1p)


@triton.jit
def _gate_b_rows(x, w, rows, D: tl.constexpr, BJ: tl.constexpr):
    """sum_j w[rows, j] x[j] over j < D in fp32 (w row-major [., D], x in the model dtype): rows of the f_b|g_b
    batched GEMV, as `model.kda.gate_b_proj` computes them before rounding. BJ columns a step bound the
    registers of the weight tile."""
    acc = tl.zeros([rows.shape[0]], tl.float32)
    for j0 in tl.static_range(0, D, BJ):
        j = j0 + tl.arange(0, BJ)
        wt = tl.load(w + rows[:, None] * D + j[None, :]).to(tl.float32)
        acc += tl.sum(wt * tl.load(x + j).to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit(noinline=True)
def _gated_norm_row(p_o, p_gate, norm_w, eps, D: tl.constexpr):
    """o <- rmsnorm(o) * norm_w * sigmoid(gate) in place, for one row of D (o as stored, in its dtype)."""
    cd = tl.arange(0, D)
    o_row = tl.load(p_o + cd, cache_modifier=".cg").to(tl.float32)   # o of other programs: skip L1
    o_row = o_row * tl.rsqrt(tl.sum(o_row * o_row) / D + eps) * tl.load(norm_w + cd).to(tl.float32)
    o_row = o_row * tl.sigmoid(tl.load(p_gate + cd, cache_modifier=".cg").to(tl.float32))  # folded: others' too
    tl.debug_barrier()
    tl.store(p_o + cd, o_row.to(p_o.dtype.element_ty))


@triton.jit
def _kda_decode_kernel(qkv, taps, conv_w, f, A_log, dt_bias, b_raw, state, o, out_gate, norm_w, arrivals, scale, eps,
                   gate_b_w, s_f, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                   BV: tl.constexpr, HAS_NORM: tl.constexpr, FOLD: tl.constexpr, BJ: tl.constexpr):
    """One token of KDA for one (sequence, head) and one block of BV state columns. Grid (B*H, D // BV).

        q, k, v = silu(conv(taps, x))        (per channel; taps shifted in place)
        g = -exp(A_log[h]) * softplus(f + dt_bias);  beta = sigmoid(b_raw)
        q = l2norm(q) * scale;  k = l2norm(k)
        S <- S * exp(g)[:, None];  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    Tiles: the state block S [D, BV] fp32, q and k whole ([D], recomputed by every block of the head:
    a conv of one token is cheap), v and o for the block's BV columns. A block of S needs only its own
    columns of v, so the blocks are independent except for two things done once per head, by the
    head's last block to finish (counted in `arrivals`, which it resets to 0): shifting the q and k
    conv taps, which every block reads, and, with HAS_NORM, replacing o by
    rmsnorm(o) * norm_w * sigmoid(out_gate) (KimiLinearRMSNormGated on the o rounded to the model
    dtype, as the unfused path would see it), which needs the whole row of o.
    FOLD: `f` holds f_a(x)|g_a(x) (row stride s_f) and gate_b_w [2, H*D, D] the f_b and g_b weights; every
    block computes f for the head's D channels and (HAS_NORM) stores to out_gate the gate of its own BV
    columns, each rounded to f's dtype where the batched GEMV rounds.
    """
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    cd = tl.arange(0, D)
    cv = i_v * BV + tl.arange(0, BV)
    C: tl.constexpr = 3 * H * D
    p_s = state + i_bh.to(tl.int64) * D * D + cd[:, None] * D + cv[None, :]
    S = tl.load(p_s)

    b_q = _short_conv(qkv, taps, conv_w, i_b, i_h * D + cd, C, W, WP)
    b_k = _short_conv(qkv, taps, conv_w, i_b, (H + i_h) * D + cd, C, W, WP)
    b_v = _short_conv(qkv, taps, conv_w, i_b, (2 * H + i_h) * D + cv, C, W, WP)
    hd = i_b.to(tl.int64) * H * D + i_h * D
    if FOLD:
        p_fg = f + i_b.to(tl.int64) * s_f
        b_f = _gate_b_rows(p_fg, gate_b_w, i_h * D + cd, D, BJ).to(f.dtype.element_ty).to(tl.float32)
        if HAS_NORM:
            b_gate = _gate_b_rows(p_fg + D, gate_b_w + H * D * D, i_h * D + cv, D, BJ)
            tl.store(out_gate + hd + cv, b_gate.to(out_gate.dtype.element_ty))
    else:
        b_f = tl.load(f + hd + cd).to(tl.float32)
    b_f += tl.load(dt_bias + i_h * D + cd).to(tl.float32)
    b_g = -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * _softplus(b_f)
    b_beta = tl.sigmoid(tl.load(b_raw + i_bh).to(tl.float32))
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)

    S = S * tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(S * b_k[:, None], axis=0))
    S += b_k[:, None] * b_u[None, :]
    b_o = tl.sum(S * b_q[:, None], axis=0)
    p_o = o + i_bh.to(tl.int64) * D
    tl.debug_barrier()  # every load of this block's state landed before any of it is overwritten
    tl.store(p_s, S)
    tl.store(p_o + cv, b_o.to(o.dtype.element_ty))
    _shift_taps(qkv, taps, i_b, (2 * H + i_h) * D + i_v * BV, BV, C, W, WP)  # this block's own v channels

    # Report in once every thread of this block is done with the q/k taps and has stored its o (and gate)
    # (acq_rel atomic); the last of the head's blocks to report finishes the head.
    tl.debug_barrier()
    if tl.atomic_add(arrivals + i_bh, 1) == D // BV - 1:
        _shift_taps(qkv, taps, i_b, i_h * D, D, C, W, WP)
        _shift_taps(qkv, taps, i_b, (H + i_h) * D, D, C, W, WP)
        if HAS_NORM:
            _gated_norm_row(p_o, out_gate + hd, norm_w, eps, D)
        tl.atomic_xchg(arrivals + i_bh, 0)


def fused_kda_decode(qkv_raw, conv_taps, conv_weight, f, A_log, dt_bias, b_raw, state, scale=None, *,
                     out_gate=None, norm_weight=None, norm_eps=1e-5, gate_b_weight=None, cfg: dict | None = None):
    """One KDA decode step for B sequences, one launch (one program per sequence, head and block of 32
    state columns; a counter buffer per device (`model.triton.arrival_counters`) lets the last block of
    each head finish it: one decode step at a time per device).

    qkv_raw [B, 3*H*d]: the q|k|v projections before the conv (model dtype).
    conv_taps [B, W-1, 3*H*d]: the last W-1 projection inputs, updated in place.
    conv_weight [3*H*d, W]: depthwise conv weights, column W-1 multiplies the current token.
    f [B, H*d]: f_b(f_a(x)), before the gate; A_log [H] (any shape with H elements); dt_bias [H*d];
    b_raw [B, H]: b_proj(x) before the sigmoid; state [B, H, d, d] fp32, updated in place.
    scale defaults to d^-0.5. With norm_weight [d] (and out_gate [B, H*d], g_b(g_a(x)) before the
    sigmoid), the output is the gated RMSNorm of o, as `model.triton.norms.gated_rmsnorm` computes it.
    With gate_b_weight [2, H*d, d] (f_b's and g_b's weights stacked), f is f_a(x)|g_a(x) [B, 2*d] (rows may be
    strided: a view of the packed input projection) and the kernel computes f and the gate from it, as
    `model.kda.gate_b_proj` does; out_gate is then not passed.
    Returns o [B, H, d] in qkv_raw's dtype.
    """
    if state.ndim != 4 or state.shape[2] != state.shape[3]:
        raise ValueError(f"fused_kda_decode: state must be [B, H, d, d], got {tuple(state.shape)}")
    B, H, D, _ = state.shape
    C = 3 * H * D
    if state.dtype != torch.float32:
        raise TypeError(f"fused_kda_decode: state must be fp32 (updated in place), got {state.dtype}")
    if not state.is_contiguous():
        raise ValueError("fused_kda_decode: state must be contiguous (it is updated in place)")
    if D < 16 or D > 128 or D & (D - 1):
        raise ValueError(f"fused_kda_decode: head dim must be a power of two in [16, 128], got {D}")
    if qkv_raw.shape != (B, C):
        raise ValueError(f"fused_kda_decode: qkv_raw must be [B, 3*H*d] = {(B, C)}, got {tuple(qkv_raw.shape)}")
    if conv_weight.ndim != 2 or conv_weight.shape[0] != C or conv_weight.shape[1] < 2:
        raise ValueError(f"fused_kda_decode: conv_weight must be [3*H*d, W] = [{C}, W >= 2], "
                         f"got {tuple(conv_weight.shape)}")
    W = conv_weight.shape[1]
    if conv_taps.shape != (B, W - 1, C) or not conv_taps.is_contiguous():
        raise ValueError(f"fused_kda_decode: conv_taps must be contiguous [B, W-1, 3*H*d] = {(B, W - 1, C)} "
                         f"(updated in place), got {tuple(conv_taps.shape)}")
    fold = gate_b_weight is not None
    if fold:
        if gate_b_weight.shape != (2, H * D, D) or f.shape != (B, 2 * D) or f.stride(-1) != 1:
            raise ValueError(f"fused_kda_decode: with gate_b_weight [2, H*d, d] = {(2, H * D, D)}, f must be "
                             f"f_a|g_a [B, 2*d] = {(B, 2 * D)} with unit column stride, got "
                             f"{tuple(gate_b_weight.shape)} and {tuple(f.shape)}")
        if out_gate is not None:
            raise ValueError("fused_kda_decode: with gate_b_weight the kernel computes the gate: pass no out_gate")
        if norm_weight is not None:
            out_gate = mt.empty(B, H * D, dtype=f.dtype, device=state.device)   # written by the kernel
    elif f.shape != (B, H * D):
        raise ValueError(f"fused_kda_decode: f must be [B, H*d] = {(B, H * D)}, got {tuple(f.shape)}")
    if A_log.numel() != H or dt_bias.numel() != H * D:
        raise ValueError(f"fused_kda_decode: A_log needs {H} values and dt_bias {H * D}, "
                         f"got {A_log.numel()} and {dt_bias.numel()}")
    if b_raw.shape != (B, H):
        raise ValueError(f"fused_kda_decode: b_raw must be [B, H] = {(B, H)}, got {tuple(b_raw.shape)}")
    if (norm_weight is None) != (out_gate is None):
        raise ValueError("fused_kda_decode: pass norm_weight and out_gate together (or neither)")
    if norm_weight is not None and (norm_weight.shape != (D,) or out_gate.shape != (B, H * D)):
        raise ValueError(f"fused_kda_decode: norm_weight must be [{D}] and out_gate [{B}, {H * D}], "
                         f"got {tuple(norm_weight.shape)} and {tuple(out_gate.shape)}")
    tensors = [qkv_raw, conv_taps, conv_weight, f, A_log, dt_bias, b_raw, state]
    tensors += [] if norm_weight is None else [out_gate, norm_weight]
    tensors += [gate_b_weight] if fold else []
    for x in tensors:
        if x.device != state.device:
            raise ValueError(f"fused_kda_decode: all tensors must be on {state.device}, one is on {x.device}")
    mt.require_runnable(_kda_decode_kernel, state.device)

    scale = D ** -0.5 if scale is None else float(scale)
    qkv_raw, conv_weight, A_log, dt_bias, b_raw = (
        x.contiguous() for x in (qkv_raw, conv_weight, A_log.reshape(H), dt_bias.reshape(H * D), b_raw))
    if fold:
        gate_b_weight = gate_b_weight.contiguous()
    else:
        f = f.contiguous()
    if norm_weight is not None:
        out_gate, norm_weight = out_gate.contiguous(), norm_weight.contiguous()
    o = mt.empty(B, H, D, dtype=qkv_raw.dtype, device=state.device)
    c = {**decode_config(B), **(cfg or {})}
    BV = min(D, c["BV"])
    _kda_decode_kernel[(B * H, D // BV)](qkv_raw, conv_taps, conv_weight, f, A_log, dt_bias, b_raw, state, o,
                                     out_gate, norm_weight, mt.arrival_counters(state.device, B * H),
                                     scale, float(norm_eps), gate_b_weight, f.stride(0), H=H, D=D, W=W,
                                     WP=triton.next_power_of_2(W - 1), BV=BV, HAS_NORM=norm_weight is not None,
                                     FOLD=fold, BJ=min(D, FOLD_BJ), num_warps=c["num_warps"])
    return o

"""One KDA decode step in one Triton launch: the fast twin of composing `model.kda.causal_conv1d`, `kda_gate`,
sigmoid and `recurrent_kda_step` (and, optionally, the gated output RMSNorm).

One program per (sequence, head, block of BV state columns); the head's last block to finish (an arrival counter)
shifts the conv taps and normalises o. With BV = D, the default, a head is one program and needs no counter. Every
load is issued before anything waits on one. Grids, load order and measured configs: docs/kernels.md#kda-decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.common import rms_normalize, softplus

# Launch config (state columns per program, warps, grid, o from the state before the update). BV = D: fastest at
# batch 1, 8 and 64 on the H200 in CUDA-graph-timed sweeps; see docs/kernels.md#kda-decode-launch-config.
DECODE = mt.LaunchConfig("kda_decode.DECODE", BV=128, num_warps=4, grid="strided", early_o=False)
# "strided": a head's blocks B*H programs apart; "adjacent": a head's blocks on consecutive programs (fla's order)
GRIDS = ("strided", "adjacent")


@triton.jit
def _tap(acc, p_x, p_w, xdt: tl.constexpr, wdt: tl.constexpr):
    """acc + x * w for one tap: x (a stored tap or the current input) to the input dtype, then to the weight dtype."""
    return acc + tl.load(p_x).to(xdt).to(wdt).to(tl.float32) * tl.load(p_w).to(tl.float32)


@triton.jit
def _silu_rounded(acc, xdt: tl.constexpr, wdt: tl.constexpr):
    y = acc.to(wdt).to(tl.float32)
    return (y * tl.sigmoid(y)).to(wdt).to(xdt).to(tl.float32)


@triton.jit
def _qkv_conv(x, S_X, taps, conv_w, i_b, ch_q, ch_k, ch_v, C: tl.constexpr, W: tl.constexpr):
    """Depthwise causal conv of the current input with the W-1 stored taps, then SiLU, for the q, k and v channels,
    as fp32, rounded where `causal_conv1d` rounds. One tap at a time (a [taps, channels] tile would impose its layout
    on the state block), the three convs sharing each tap's step so that all loads issue first."""
    wdt: tl.constexpr = conv_w.dtype.element_ty
    xdt: tl.constexpr = x.dtype.element_ty
    acc_q = tl.zeros(ch_q.shape, tl.float32)
    acc_k = tl.zeros(ch_k.shape, tl.float32)
    acc_v = tl.zeros(ch_v.shape, tl.float32)
    for j in tl.static_range(W - 1):
        row = taps + (i_b * (W - 1) + j).to(tl.int64) * C
        acc_q = _tap(acc_q, row + ch_q, conv_w + ch_q * W + j, xdt, wdt)
        acc_k = _tap(acc_k, row + ch_k, conv_w + ch_k * W + j, xdt, wdt)
        acc_v = _tap(acc_v, row + ch_v, conv_w + ch_v * W + j, xdt, wdt)
    row = x + i_b.to(tl.int64) * S_X
    acc_q = _tap(acc_q, row + ch_q, conv_w + ch_q * W + (W - 1), xdt, wdt)
    acc_k = _tap(acc_k, row + ch_k, conv_w + ch_k * W + (W - 1), xdt, wdt)
    acc_v = _tap(acc_v, row + ch_v, conv_w + ch_v * W + (W - 1), xdt, wdt)
    return _silu_rounded(acc_q, xdt, wdt), _silu_rounded(acc_k, xdt, wdt), _silu_rounded(acc_v, xdt, wdt)


@triton.jit
def _tap_lanes(i_h, i_v, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, QK: tl.constexpr):
    """The channels (and lane mask) of the conv taps that block i_v of head i_h moves: its own v channels and, with
    QK, the head's q and k channels (lanes of 4*D: q, k, the block's v, then masked)."""
    if QK:
        lane = tl.arange(0, 4 * D)
        grp = lane // D
        if BV == D:  # the head's whole v (a block that holds the head): no offsets or masks within a group
            ch = (grp * H + i_h) * D + lane % D
            m_ch = grp < 3
        else:
            ch = (grp * H + i_h) * D + tl.where(grp == 2, i_v * BV, 0) + lane % D
            m_ch = (grp < 2) | ((grp == 2) & (lane % D < BV))
    else:
        lane = tl.arange(0, BV)
        ch = (2 * H + i_h) * D + i_v * BV + lane
        m_ch = lane < BV
    return ch, m_ch


@triton.jit(noinline=True)
def _finish_block(x, S_X, taps, i_b, i_h, i_v, p_o, p_gate, norm_w, eps, H: tl.constexpr, D: tl.constexpr,
                  BV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, QK: tl.constexpr, NORM: tl.constexpr):
    """After a block's state and o are stored: shift the taps of `_tap_lanes`' channels and, with NORM, replace the
    row of o at p_o by its gated norm; all read before anything is written. Not inlined: its registers stay apart."""
    C: tl.constexpr = 3 * H * D
    ch, m_ch = _tap_lanes(i_h, i_v, H, D, BV, QK)
    j = tl.arange(0, WP)
    p_taps = taps + (i_b * (W - 1) + j[:, None]).to(tl.int64) * C + ch[None, :]
    keep = ((j >= 1) & (j < W - 1))[:, None] & m_ch[None, :]   # rows 1 .. W-2 stay, each one row up
    old = tl.load(p_taps, mask=keep, other=0.)
    b_x = tl.load(x + i_b.to(tl.int64) * S_X + ch, mask=m_ch)
    if NORM:
        cd = tl.arange(0, D)
        o_row = tl.load(p_o + cd, cache_modifier=".cg").to(tl.float32)   # o of other programs: skip L1
        gate = tl.load(p_gate + cd).to(tl.float32)
        w = tl.load(norm_w + cd).to(tl.float32)
    tl.debug_barrier()  # every thread has read the taps (and o) before any of them is overwritten
    tl.store(p_taps - C, old, mask=keep)
    tl.store(taps + (i_b * (W - 1) + W - 2).to(tl.int64) * C + ch, b_x.to(taps.dtype.element_ty), mask=m_ch)
    if NORM:
        tl.store(p_o + cd, _gated_norm(o_row, gate, w, eps, D).to(p_o.dtype.element_ty))


@triton.jit
def _gated_norm(o_row, gate, w, eps, D: tl.constexpr):
    """rmsnorm(o) * w * sigmoid(gate) for one whole row of D values (fp32 in and out; o as stored)."""
    return tl.reshape(rms_normalize(o_row[None, :], D, eps), [D]) * w * tl.sigmoid(gate)


@triton.jit
def _head_inputs(b_q, b_k, b_f, a_log, b_raw, scale):
    """What every column block of a head needs: q = l2norm(q) * scale, k = l2norm(k), the decay exp(g) with
    g = -exp(A_log) * softplus(f + dt_bias) ([D] each), and beta = sigmoid(b_raw)."""
    b_g = -tl.exp(a_log) * softplus(b_f)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q, b_k, tl.exp(b_g), tl.sigmoid(b_raw)


@triton.jit
def _update_columns(S, b_q, b_k, decay, b_beta, b_v, EARLY_O: tl.constexpr):
    """The delta-rule step on a block of state columns S [D, BV] with their v [BV]: (new S, o [BV]). EARLY_O: o from
    the state before the update, o = S^T (e^g q) + u (k.q), the same value summed in another order."""
    if EARLY_O:
        b_u = b_beta * (b_v - tl.sum(S * (b_k * decay)[:, None], axis=0))
        b_o = tl.sum(S * (b_q * decay)[:, None], axis=0) + b_u * tl.sum(b_k * b_q)
        return S * decay[:, None] + b_k[:, None] * b_u[None, :], b_o
    S = S * decay[:, None]
    b_u = b_beta * (b_v - tl.sum(S * b_k[:, None], axis=0))
    S += b_k[:, None] * b_u[None, :]
    return S, tl.sum(S * b_q[:, None], axis=0)


@triton.jit
def _kda_decode_kernel(qkv, taps, conv_w, f, A_log, dt_bias, b_raw, state, o, out_gate, norm_w, arrivals, scale, eps,
                   S_X, S_F, S_B, S_G,
                   H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
                   HAS_NORM: tl.constexpr, ADJACENT: tl.constexpr, EARLY_O: tl.constexpr):
    """One token of KDA for one (sequence, head) and one block of BV state columns. Grid (B*H, D // BV), or
    (B*H * D // BV,) with ADJACENT.

        q, k, v = silu(conv(taps, x));  g = -exp(A_log[h]) * softplus(f + dt_bias);  beta = sigmoid(b_raw)
        q = l2norm(q) * scale;  k = l2norm(k)
        S <- S * exp(g)[:, None];  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    Every block recomputes q and k whole (cheap for one token) and reads only its own columns of v. The head's last
    block (counted in `arrivals`, which it resets to 0) shifts the q and k taps and, with HAS_NORM, replaces o by
    its gated norm (`_gated_norm`, o rounded to the model dtype first as the unfused path sees it).
    """
    if ADJACENT:
        i_bh = tl.program_id(0) // (D // BV)
        i_v = tl.program_id(0) % (D // BV)
    else:
        i_bh = tl.program_id(0)
        i_v = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    cd = tl.arange(0, D)
    cv = i_v * BV + tl.arange(0, BV)
    C: tl.constexpr = 3 * H * D
    p_s = state + i_bh.to(tl.int64) * D * D + cd[:, None] * D + cv[None, :]
    # Every load before anything waits on one: state and head inputs, a barrier (no load moves above it), conv inputs
    i_b64 = i_b.to(tl.int64)
    S = tl.load(p_s)
    a_log = tl.load(A_log + i_h)
    b_b = tl.load(b_raw + i_b64 * S_B + i_h)
    b_f = tl.load(f + i_b64 * S_F + i_h * D + cd)
    b_dt = tl.load(dt_bias + i_h * D + cd)
    WHOLE: tl.constexpr = BV == D  # one block holds the head: nothing to wait for
    if WHOLE and HAS_NORM:
        b_gate = tl.load(out_gate + i_b64 * S_G + i_h * D + cv)
        b_nw = tl.load(norm_w + cv)
    tl.debug_barrier()
    b_q, b_k, b_v = _qkv_conv(qkv, S_X, taps, conv_w, i_b, i_h * D + cd, (H + i_h) * D + cd, (2 * H + i_h) * D + cv,
                              C, W)
    b_q, b_k, decay, b_beta = _head_inputs(b_q, b_k, b_f.to(tl.float32) + b_dt.to(tl.float32), a_log.to(tl.float32),
                                           b_b.to(tl.float32), scale)
    S, b_o = _update_columns(S, b_q, b_k, decay, b_beta, b_v, EARLY_O)
    p_o = o + i_bh.to(tl.int64) * D
    if WHOLE and HAS_NORM:  # the whole row of o is here: normalise it before it is stored
        b_o = _gated_norm(b_o.to(o.dtype.element_ty).to(tl.float32), b_gate.to(tl.float32), b_nw.to(tl.float32), eps, D)
    tl.debug_barrier()  # every load of this block's state (and taps) landed before any of it is overwritten
    tl.store(p_s, S)
    tl.store(p_o + cv, b_o.to(o.dtype.element_ty))

    p_gate = out_gate + i_b64 * S_G + i_h * D if HAS_NORM else p_o   # p_o: a pointer no NORM=False call reads
    if WHOLE:  # o was normalised in registers
        _finish_block(qkv, S_X, taps, i_b, i_h, i_v, p_o, p_gate, norm_w, eps, H, D, BV, W, WP, True, False)
    else:
        # Report in (acq_rel atomic) once this block is done with the taps and has stored its o. The last block
        # finishes the head (the q and k taps, and the row of o); every block moves its own v taps.
        tl.debug_barrier()
        if tl.atomic_add(arrivals + i_bh, 1) == D // BV - 1:
            _finish_block(qkv, S_X, taps, i_b, i_h, i_v, p_o, p_gate, norm_w, eps, H, D, BV, W, WP, True, HAS_NORM)
            tl.atomic_xchg(arrivals + i_bh, 0)
        else:
            _finish_block(qkv, S_X, taps, i_b, i_h, i_v, p_o, p_gate, norm_w, eps, H, D, BV, W, WP, False, False)


def fused_kda_decode(qkv_raw, conv_taps, conv_weight, f, A_log, dt_bias, b_raw, state, scale=None, *,
                     out_gate=None, norm_weight=None, norm_eps=1e-5, cfg: dict | None = None):
    """One KDA decode step for B sequences in one launch (one at a time per device: the arrival counters are shared).
    `cfg` overrides keys of DECODE. Returns o [B, H, d] in qkv_raw's dtype.

    qkv_raw [B, 3*H*d] (before the conv); conv_taps [B, W-1, 3*H*d] and state [B, H, d, d] fp32, updated in place;
    conv_weight [3*H*d, W]; f [B, H*d]; A_log [H]; dt_bias [H*d]; b_raw [B, H]. With norm_weight [d] and out_gate
    [B, H*d], o is normalised as `model.triton.norms.gated_rmsnorm` does. scale defaults to d^-0.5.
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
    if f.shape != (B, H * D):
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
    for x in tensors:
        if x.device != state.device:
            raise ValueError(f"fused_kda_decode: all tensors must be on {state.device}, one is on {x.device}")
    mt.require_runnable(_kda_decode_kernel, state.device)

    scale = D ** -0.5 if scale is None else float(scale)
    # rows read in place through their stride (a copy only where a row's own values are not contiguous)
    qkv_raw, f, b_raw = (mt.rows(x, x.shape[1]) for x in (qkv_raw, f, b_raw))
    conv_weight, A_log, dt_bias = (x.contiguous() for x in (conv_weight, A_log.reshape(H), dt_bias.reshape(H * D)))
    if norm_weight is not None:
        out_gate, norm_weight = mt.rows(out_gate, H * D), norm_weight.contiguous()
    o = mt.empty(B, H, D, dtype=qkv_raw.dtype, device=state.device)
    c = mt.launch_config("fused_kda_decode", DECODE, cfg)
    if c["grid"] not in GRIDS:
        raise ValueError(f"fused_kda_decode: grid must be one of {GRIDS}, got {c['grid']!r}")
    BV = min(D, c["BV"])
    args = (qkv_raw, conv_taps, conv_weight, f, A_log, dt_bias, b_raw, state, o, out_gate, norm_weight)
    meta = dict(H=H, D=D, W=W, WP=triton.next_power_of_2(W - 1), BV=BV, HAS_NORM=norm_weight is not None,
                num_warps=c["num_warps"])
    adjacent = c["grid"] == "adjacent"
    _kda_decode_kernel[(B * H * (D // BV),) if adjacent else (B * H, D // BV)](
        *args, mt.arrival_counters(state.device, B * H), scale, float(norm_eps), qkv_raw.stride(0), f.stride(0),
        b_raw.stride(0), 0 if out_gate is None else out_gate.stride(0), **meta, ADJACENT=adjacent,
        EARLY_O=bool(c["early_o"]))
    return o


mt.seal(__name__)

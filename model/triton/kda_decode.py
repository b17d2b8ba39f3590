"""One KDA decode step in one Triton launch: the fast twin of composing `model.kda.causal_conv1d`,
`kda_gate`, sigmoid and `recurrent_kda_step` (and, optionally, the gated output RMSNorm).

One program per (sequence, head, block of BV state columns), laid out by the config's `grid`, the head's last
  block to finish shifting the q and k conv taps and normalising o (at batch 1 and BV=32: 128 programs, each
  moving 16 KB of fp32 state in and out). "strided" numbers the programs head-fastest, so the D/BV blocks of
  one head's state run B*H programs apart (at batch 64, in different waves: each reads 4*BV bytes of every
  512-byte row while the rest of the row waits for a later wave); "adjacent" numbers them block-fastest, so a
  head's blocks run together and read its 64 KB of state as one region (fla's fused_recurrent grid order).
A third grid, one program per (sequence, head) walking its column blocks with the next ones' loads in flight,
was measured slower at every batch and removed (graph-timed, run of 5ac699e: B=64 106.7 us at best `18270871`
against 87.7 us `a392ce5f`; B=1 11.2 us `3ee662cc` against 6.8 us `cea96aa3`).
With BV = D a head is one program in either grid: no counter, o normalised in registers and stored once, the taps
shifted by the same program. At D = 128 that is 32 programs at batch 1, each moving the head's 64 KB; the default
at every batch (see DECODE below).
Load order. Each program issues every load before anything waits on one: the state and the head's gate, beta and
norm inputs, a barrier, then the q, k and v conv inputs (`_qkv_conv`). Left to the compiler, the loads were four
DRAM round trips one after another (offline sm_90 SASS of b93633d: the state's after the first use of q's conv
inputs, k's behind a layout conversion's barrier, the gate's after the q and k norms, v's after those). The same
operations in another order gave the kernel before it's bf16 bits and other fp32 bits (an unrecorded comparison on
the H200 at batch 1, 8 and 64; the GPU tests hold both dtypes to the references). Graph-timed, B=1 went from 7.05
us `4ff7892a` to 6.02 us `d888cefc` (fla's call 5.34 in the same run), and one program per head became the fastest
config at B=64 too (75.9 us `a677c29a`, the 32-column "adjacent" default of before 88.8 `042c2fd8`, fla 87.6 in the
run's vs-peer case `b28e18a3`).
Two orderings were measured and removed before that (graph-timed sweep of 00fa6bf): a whole head reading its conv taps
with the other loads and writing them at the end, instead of the second round trip of the tap shift (`_finish_block`)
(B=1 6.96 us `5226d884` against 6.90 `5e1caee4`; B=64 89.8 against 92.4 us, `729f6ad9` / `ba38b11b`, one sample each,
and not the default there), and the counter path storing its state block after reporting in, so that the release waits
for o alone (B=1 at best 6.77 us `5c33123d` against 6.84 `c28f6baa`; B=64 86.0 against 87.4 us at the default,
`ac80b39c` / `f541a781`). After it (sweep of 8f00376), o taken from the state before the update, o = S^T (e^g q) + u
(k.q), so that neither reduction over S waits for the other: 120 fewer instructions a thread (offline SASS) and no
faster (B=1 6.20 us `276aab53` against 6.02 `903f1119`; B=64 75.92 against 75.87, `167cd85d` / `5c2d7236`).
Also measured and removed (run of 9cd1aaa): the step launched early (PDL) after the model's projections, its state,
taps and weights read before griddepcontrol.wait. Timed after the projections (32 layers, each its projections
then the step, less the projections alone) it took 7.00 us against 6.72 plain, fla's call 6.17 (B=1, `292191df`).
The counter path's tail since c2959e6: after the atomic, the last block reads the q and k taps and the row of o
together and writes both (one round trip; before, the taps' round trip, then the o row's), and each block moves its
own v taps, the others after reporting in. Meant to bring the split configs under one program a head at batch 1,
where the whole-head program moves 64 KB of state each way through each of 32 SMs. Level with it, not under it:
5.97 us at best (32 columns, one warp, adjacent, early_o; `43c0b5c6`) against 6.02 (`05fb11f6`), sweep of 2a19018.
A cluster of CTAs a head (num_ctas=2, the norm's sum through distributed shared memory) does not compile in Triton
3.6 (its CTA planning fails on this kernel's reductions; a test holds that, so that a Triton that builds it shows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.norms import _rms_normalize


# Launch config (state columns per program, warps, grid), from the CUDA-graph-timed sweeps of `bench_kernels --ops
# kda_decode_step --decode-sweep`. Before one program per head existed: 32 columns up to batch 8 and 16 from batch 16
# (run of e4977e1: B=1 7.1 us `11880e09`; B=64 133.9 us `096a1285`), then 32 columns over 2 warps on the "adjacent"
# grid at B=64 (run of 5ac699e: 87.7 us `a392ce5f`). The sweep of ddeba4c made one program per head (BV = D = 128: no
# arrival counter, the norm in registers) the default below batch 16 (B=1 6.8 us `d47cc52c`, B=8 14.4 us
# `28ff9e21`) but not at 64 (92.9 us `465c195f` against 86.4 `1b454e24`). Since the load order above, it is the
# fastest config at B=1 (6.03 us `71bf57c0`; next 6.54 `e2e8de7f`) and at B=64 (75.9 us `a677c29a`; next 81.8
# `30edaf14`), sweep of ca2d42f, and again at B=1, 8 and 64 in the sweep of 8f00376 (6.02 us `903f1119`, 12.87 us
# `55c8e108`, 75.87 us `5c2d7236`). One config for every batch.
DECODE = dict(BV=128, num_warps=4, grid="strided", early_o=False)
GRIDS = ("strided", "adjacent")  # see the module docstring


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
    """Depthwise causal conv of the current input with the W-1 stored taps, then SiLU, for the q, k and v
    channels ch_q, ch_k, ch_v; returns the three activations as fp32.

    Rounds where `causal_conv1d` does: inputs to the weight dtype, the conv and the SiLU results to the weight
    dtype, then to the input dtype. One tap at a time, in vectors shaped like the channels: a [taps, channels]
    tile would get a layout of its own, which Triton then imposed on the state block these channels meet (seen
    at 32 columns: a round trip of the whole block through shared memory). The three convs share each tap's
    step, so that all their loads are issued before the first result is converted to the state's layout (through
    shared memory, behind a barrier the compiler moves no load above; see the kernel).
    """
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
    """The channels (and lane mask) of the conv taps that the block of columns i_v of head i_h moves: its own v
    channels and, with QK, the head's q and k channels (as lanes of 4*D: q, k, the block's BV of v, then masked)."""
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
    """What a block does after its state and o are stored: drop the oldest conv tap and append the current input,
    for the channels of `_tap_lanes` (taps hold the last W-1 inputs), and with NORM replace the row of D o values at
    p_o (o as stored, in its dtype) by rmsnorm(o) * norm_w * sigmoid(gate). Everything is read before anything is
    written: one round trip. Rereads what it moves; a separate function, so that its registers are not added to the
    state update's."""
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
def _softplus(x):
    # torch's softplus (threshold 20); log1p(z) via log(1+z) * z / ((1+z) - 1) keeps tiny z exact. Both
    # where-branches are computed, so neither may divide 0 by 0 or inf by inf (NaNs that are discarded, but
    # that numpy in the interpreter warns about): exp of min(x, 20), as past 20 x itself is returned, and the
    # divisor 1 where 1 + z rounds to 1, as z itself is returned there.
    z = tl.exp(tl.minimum(x, 20.))
    one_z = 1. + z
    small = one_z == 1.
    log1p = tl.where(small, z, tl.log(one_z) * z / tl.where(small, 1., one_z - 1.))
    return tl.where(x > 20., x, log1p)


@triton.jit
def _gated_norm(o_row, gate, w, eps, D: tl.constexpr):
    """rmsnorm(o) * w * sigmoid(gate) for one whole row of D values (fp32 in, fp32 out; o as stored): the norm
    kernel's `_rms_normalize` on o as a one-row tile."""
    return tl.reshape(_rms_normalize(o_row[None, :], D, eps), [D]) * w * tl.sigmoid(gate)


@triton.jit
def _head_inputs(b_q, b_k, b_f, a_log, b_raw, scale):
    """From the head's loaded inputs, what every column block of it needs: q = l2norm(q) * scale, k = l2norm(k)
    (q and k after the conv and SiLU), the decay exp(g), g = -exp(A_log) * softplus(f + dt_bias) ([D] each), and
    beta = sigmoid(b_raw)."""
    b_g = -tl.exp(a_log) * _softplus(b_f)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q, b_k, tl.exp(b_g), tl.sigmoid(b_raw)


@triton.jit
def _update_columns(S, b_q, b_k, decay, b_beta, b_v, EARLY_O: tl.constexpr):
    """The delta-rule step on a block of state columns S [D, BV] with their v [BV]: (new S, o [BV]).
    EARLY_O: o from the state before the update, o = S^T (e^g q) + u (k.q) (the same value, summed in another
    order), so that neither reduction over S waits for the other."""
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
    with ADJACENT (B*H * D // BV,), the blocks of a head on consecutive program ids.

        q, k, v = silu(conv(taps, x))        (per channel; taps shifted in place)
        g = -exp(A_log[h]) * softplus(f + dt_bias);  beta = sigmoid(b_raw)
        q = l2norm(q) * scale;  k = l2norm(k)
        S <- S * exp(g)[:, None];  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    Tiles: the state block S [D, BV] fp32, q and k whole ([D], recomputed by every block of the head:
    a conv of one token is cheap), v and o for the block's BV columns. A block of S needs only its own
    columns of v, so the blocks are independent except for two things done once per head, by the
    head's last block to finish (counted in `arrivals`, which it resets to 0): shifting the conv taps
    (the q and k taps, which every block reads, and with them the v taps), and, with HAS_NORM, replacing o by
    rmsnorm(o) * norm_w * sigmoid(out_gate) (KimiLinearRMSNormGated on the o rounded to the model
    dtype, as the unfused path would see it), which needs the whole row of o. With BV = D a head is one
    block: it normalises o in registers, stores it once and shifts the taps, with no counter.
    The rows of qkv, f, b_raw and out_gate are S_X, S_F, S_B, S_G elements apart (at batch > 1 the model's q|k|v
    and b_raw are column slices of its packed projection's output, read in place).
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
    # Every load before anything waits on one ("Load order" in the module docstring): the state and the head's
    # inputs, then a barrier, which the compiler moves no load above and which waits for no load (a load is waited
    # for only where its register is read), then the conv's inputs.
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
        # Report in once every thread of this block is done with the taps and has stored its o (acq_rel atomic).
        # The last of the head's blocks to report finishes the head: the q and k taps, which every block read, and
        # with HAS_NORM the row of o, read together (one round trip after the atomic's). Every block moves its own
        # v taps, which no other block reads; the others after reporting in, off the last block's path.
        tl.debug_barrier()
        if tl.atomic_add(arrivals + i_bh, 1) == D // BV - 1:
            _finish_block(qkv, S_X, taps, i_b, i_h, i_v, p_o, p_gate, norm_w, eps, H, D, BV, W, WP, True, HAS_NORM)
            tl.atomic_xchg(arrivals + i_bh, 0)
        else:
            _finish_block(qkv, S_X, taps, i_b, i_h, i_v, p_o, p_gate, norm_w, eps, H, D, BV, W, WP, False, False)


def fused_kda_decode(qkv_raw, conv_taps, conv_weight, f, A_log, dt_bias, b_raw, state, scale=None, *,
                     out_gate=None, norm_weight=None, norm_eps=1e-5, cfg: dict | None = None):
    """One KDA decode step for B sequences, one launch (one program per sequence, head and block of BV
    state columns; a counter buffer per device (`model.triton.arrival_counters`) lets the last block of
    each head finish it: one decode step at a time per device). `cfg` overrides keys of DECODE:
    BV (state columns per block), num_warps, grid (one of GRIDS, see the module docstring), early_o (o from the
    state before the update, `_update_columns`).

    qkv_raw [B, 3*H*d]: the q|k|v projections before the conv (model dtype). qkv_raw, f, b_raw and out_gate are
    read in place when each row's values are contiguous, whatever the stride between rows (column slices of a
    wider tensor: the model's packed projections), else copied first.
    conv_taps [B, W-1, 3*H*d]: the last W-1 projection inputs, updated in place.
    conv_weight [3*H*d, W]: depthwise conv weights, column W-1 multiplies the current token.
    f [B, H*d]: f_b(f_a(x)), before the gate; A_log [H] (any shape with H elements); dt_bias [H*d];
    b_raw [B, H]: b_proj(x) before the sigmoid; state [B, H, d, d] fp32, updated in place.
    scale defaults to d^-0.5. With norm_weight [d] (and out_gate [B, H*d], g_b(g_a(x)) before the
    sigmoid), the output is the gated RMSNorm of o, as `model.triton.norms.gated_rmsnorm` computes it.
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

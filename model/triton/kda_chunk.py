"""Chunked KDA prefill in Triton: the fast twin of `model.kda.chunk_kda` (forward only).

Two kernels, both per (batch, head):

1. `_chunk_prep_kernel`, one program per chunk of BT=64 tokens, all chunks in parallel. It does
   everything that does not need the state: q/k L2 norm, the cumulative log decay G, the intra-chunk
   matrices Akk/Aqk, the UT-transform solve T = (I + Akk)^-1, and folds the results into five
   per-chunk operands of the state recurrence (fp32, [B*H, NT*BT, D] so a chunk is one contiguous slab):
       w  = T (beta k e^G)            u  = T (beta v)
       qw = q e^G - Aqk w             ou = Aqk u
       kd = k e^(G_last - G)          eglast = e^G_last
2. `_chunk_scan_kernel`, one program per V-block, walking the chunks in order with the fp32 state
   S [K, BV] in registers:
       v_new = u - w S;   o = qw S + ou   (= q e^G S + Aqk v_new);   S <- eglast * S + kd^T v_new

Decays are only ever formed as exp of a non-positive number (see the prep kernel), so gates near 0,
at -5 or at -1000 neither overflow nor produce NaN. Matmuls run on tensor cores with fp32 operands:
`tf32x3` (about fp32 accuracy) for fp32 inputs, `tf32` for bf16/fp16 inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt

CHUNK = 64
_LOG2_CHUNK = 6


@triton.jit
def _segment_cumsum(x, SEG: tl.constexpr, BT: tl.constexpr, K: tl.constexpr, REVERSE: tl.constexpr):
    """Cumulative sum of x [BT, K] down the rows, restarting at every aligned block of SEG rows."""
    if SEG == 1:
        y = x
    else:
        y = tl.reshape(tl.cumsum(tl.reshape(x, (BT // SEG, SEG, K)), axis=1, reverse=REVERSE), (BT, K))
    return y


@triton.jit
def _load_gates(g_row0, n_live, SHIFT: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """g of the chunk's rows SHIFT .. SHIFT+BT-1 as [BT, K] fp32; zero past the chunk and past T.

    Reloaded where needed (L1/L2 hits) instead of held across the kernel: registers are the limit here.
    """
    r = tl.arange(0, BT) + SHIFT
    p = g_row0 + r[:, None] * (H * K) + tl.arange(0, K)[None, :]
    return tl.load(p, mask=((r < n_live) & (r < BT))[:, None], other=0.).to(tl.float32)


@triton.jit
def _level_pairs(b_q, b_k, g_row0, n_live, HALF: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                 BT: tl.constexpr, PREC: tl.constexpr):
    """sum_c k_t k_s exp(G_t - G_s) and the same with q_t, over the pairs (t, s) with t in the upper and
    s in the lower half of one 2*HALF-block of rows ([BT, BT] each, zero elsewhere).

    With r the last row of that lower half, exp(G_t - G_s) = exp(g_{r+1} + ... + g_t) * exp(g_{s+1} + ... + g_r):
    both factors <= 1, one per row, so the pairs are one tl.dot.
    """
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    upper = ((r // HALF) % 2 == 1)[:, None]
    into = _segment_cumsum(_load_gates(g_row0, n_live, 0, H, K, BT), HALF, BT, K, False)   # g_{r+1} + ... + g_t
    g_next = tl.where((r % HALF == HALF - 1)[:, None], 0., _load_gates(g_row0, n_live, 1, H, K, BT))
    out_of = _segment_cumsum(g_next, HALF, BT, K, True)                                     # g_{s+1} + ... + g_r
    decay = tl.exp(tl.where(upper, into, out_of))
    k_col = tl.where(upper, 0., b_k * decay)
    pair = (r[:, None] // (2 * HALF)) == (c[None, :] // (2 * HALF))
    A_kk = tl.where(pair, tl.dot(tl.where(upper, b_k * decay, 0.), tl.trans(k_col), input_precision=PREC), 0.)
    A_qk = tl.where(pair, tl.dot(tl.where(upper, b_q * decay, 0.), tl.trans(k_col), input_precision=PREC), 0.)
    return A_kk, A_qk


@triton.jit
def _chunk_prep_kernel(q, k, v, g, beta, w, qw, kd, u, ou, eglast, T, NT, scale,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       LOG2_BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    """Per-chunk, state-free part of chunked KDA. Grid (NT, B*H); one program = one chunk of one head.

    Tiles: q, k, g as [BT, K] and v as [BT, V] fp32 in registers; Akk, Aqk, T as [BT, BT].
    Rows past T load as zeros (g = 0, beta = 0), which makes every output row there exactly zero, so
    the scan kernel never needs a mask.

    Intra-chunk pairs s < t are visited by the highest bit in which t and s differ: at level `half`
    (1, 2, ..., 32 for BT=64) t lies in the upper and s in the lower half of the same 2*half-block
    (`_level_pairs`: one tl.dot per level, decays as products of two factors <= 1). The exponents are
    sums over the rows they span (segmented scans), not differences of the chunk-long prefix sum G:
    after a gate of -1000 that difference would have lost its low digits. Every pair s < t belongs
    to exactly one level; the diagonal q_t.k_t (Aqk only) is added last.

    The same levels solve T = (I + Akk)^-1 by block doubling: with Tb the inverse of the
    block-diagonal part (blocks of `half`) and L the pairs of this level (lower-left block of each
    2*half-block), the inverse with blocks of 2*half is Tb - Tb L Tb. Starting from Tb = I, six
    levels give the full 64x64 inverse; every step is an exact 2x2 block inverse, no series.
    """
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    ck = tl.arange(0, K)
    cv = tl.arange(0, V)
    t = i_t * BT + r
    live = t < T
    # scalar base of the chunk's first row + int32 tile offsets: lets the loads vectorise
    row0 = (i_b.to(tl.int64) * T + i_t * BT) * H + i_h   # row of the [B*T*H, D] inputs
    n_live = T - i_t * BT
    g_row0 = g + row0 * K
    qk_off = r[:, None] * (H * K) + ck[None, :]

    b_q = tl.load(q + row0 * K + qk_off, mask=live[:, None], other=0.).to(tl.float32)
    b_k = tl.load(k + row0 * K + qk_off, mask=live[:, None], other=0.).to(tl.float32)
    b_beta = tl.load(beta + row0 + r * H, mask=live, other=0.).to(tl.float32)
    if L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    b_q = b_q * scale

    Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    Tm = (r[:, None] == c[None, :]).to(tl.float32)
    for lvl in tl.static_range(LOG2_BT):
        # (1 << lvl) goes straight into a constexpr parameter: a name bound to it would become a tensor
        A_lvl, Aqk_lvl = _level_pairs(b_q, b_k, g_row0, n_live, 1 << lvl, H, K, BT, PREC)
        A_lvl = A_lvl * b_beta[:, None]
        Aqk += Aqk_lvl
        Tm = Tm - tl.dot(tl.dot(Tm, A_lvl, input_precision=PREC), Tm, input_precision=PREC)
    Aqk += tl.where(r[:, None] == c[None, :], tl.sum(b_q * b_k, axis=1)[:, None], 0.)

    G = tl.cumsum(_load_gates(g_row0, n_live, 0, H, K, BT), axis=0)   # g_1 + ... + g_t
    e_G = tl.exp(G)
    G_last = tl.sum(tl.where((r == BT - 1)[:, None], G, 0.), axis=0)   # padded rows add g = 0
    b_v = tl.load(v + row0 * V + r[:, None] * (H * V) + cv[None, :], mask=live[:, None], other=0.).to(tl.float32)
    b_w = tl.dot(Tm, b_k * (b_beta[:, None] * e_G), input_precision=PREC)
    b_u = tl.dot(Tm, b_v * b_beta[:, None], input_precision=PREC)
    b_qw = b_q * e_G - tl.dot(Aqk, b_w, input_precision=PREC)
    b_ou = tl.dot(Aqk, b_u, input_precision=PREC)
    # exp(g_{t+1} + ... + g_last), summed from the end: no difference of long prefix sums
    b_kd = b_k * tl.exp(tl.cumsum(_load_gates(g_row0, n_live, 1, H, K, BT), axis=0, reverse=True))

    slab = (i_bh.to(tl.int64) * NT + i_t) * BT          # first row of this chunk in the [B*H, NT*BT, D] outputs
    k_off = r[:, None] * K + ck[None, :]
    v_off = r[:, None] * V + cv[None, :]
    tl.store(w + slab * K + k_off, b_w)
    tl.store(qw + slab * K + k_off, b_qw)
    tl.store(kd + slab * K + k_off, b_kd)
    tl.store(u + slab * V + v_off, b_u)
    tl.store(ou + slab * V + v_off, b_ou)
    tl.store(eglast + (i_bh.to(tl.int64) * NT + i_t) * K + ck, tl.exp(G_last))


@triton.jit
def _chunk_scan_kernel(w, qw, kd, u, ou, eglast, h0, ht, o, T, NT,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """Inter-chunk recurrence and output. Grid (V // BV, B*H); one program = one head's V-block.

    The fp32 state block S [K, BV] stays in registers while the program walks the NT chunks in order;
    per chunk it reads the prep kernel's w, qw, kd [BT, K], u, ou [BT, BV] and eglast [K]:
        v_new = u - w S;   o = qw S + ou;   S <- eglast[:, None] * S + kd^T v_new
    (three tl.dot per chunk). The final S is the final state.
    """
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, BT)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    state_off = ck[:, None] * V + cv[None, :]
    head = i_bh.to(tl.int64) * K * V
    k_off = r[:, None] * K + ck[None, :]
    v_off = r[:, None] * V + cv[None, :]

    S = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + head + state_off)
    # a while loop: Triton 3.6's interpreter cannot iterate range() over a runtime bound (NumPy >= 2.4)
    n = 0
    while n < NT:
        slab = (i_bh.to(tl.int64) * NT + n) * BT
        b_w = tl.load(w + slab * K + k_off)
        b_qw = tl.load(qw + slab * K + k_off)
        b_kd = tl.load(kd + slab * K + k_off)
        b_u = tl.load(u + slab * V + v_off)
        b_ou = tl.load(ou + slab * V + v_off)
        b_eg = tl.load(eglast + (i_bh.to(tl.int64) * NT + n) * K + ck)

        v_new = b_u - tl.dot(b_w, S, input_precision=PREC)
        b_o = b_ou + tl.dot(b_qw, S, input_precision=PREC)
        t = n * BT + r
        p_o = o + ((i_b.to(tl.int64) * T + n * BT) * H + i_h) * V + r[:, None] * (H * V) + cv[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None])
        S = S * b_eg[:, None] + tl.dot(tl.trans(b_kd), v_new, input_precision=PREC)
        n += 1
    if STORE_HT:
        tl.store(ht + head + state_off, S)


def _check_head_dim(name: str, d: int) -> None:
    if d < 16 or d > 128 or d & (d - 1):
        raise ValueError(f"chunk_kda_fwd: {name} head dim must be a power of two in [16, 128], got {d}")


def chunk_kda_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, l2norm_qk=True):
    """Chunked KDA forward; same layout and meaning as `model.kda.chunk_kda`.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (float dtypes; g is the log decay, <= 0);
    initial_state [B, H, K, V] (cast to fp32) or None. Any T >= 0. q and k are L2-normalised inside
    when l2norm_qk; scale defaults to K^-0.5.
    Returns (o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32, or None when not asked for).
    """
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"chunk_kda_fwd: q, k, g must share one [B, T, H, K] shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"chunk_kda_fwd: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta.shape != (B, T, H):
        raise ValueError(f"chunk_kda_fwd: beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    _check_head_dim("key", K)
    _check_head_dim("value", V)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise TypeError(f"chunk_kda_fwd: {name} must be a float tensor, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"chunk_kda_fwd: {name} is on {x.device}, q on {q.device}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"chunk_kda_fwd: initial_state must be [B, H, K, V] = {(B, H, K, V)}, "
                         f"got {tuple(initial_state.shape)}")
    mt.require_runnable(_chunk_prep_kernel, q.device)
    scale = K ** -0.5 if scale is None else float(scale)
    h0 = None if initial_state is None else initial_state.to(device=q.device, dtype=torch.float32).contiguous()
    o = mt.empty(B, T, H, V, dtype=v.dtype, device=q.device)
    ht = mt.empty(B, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    if T == 0:
        if ht is not None and h0 is not None:
            ht.copy_(h0)
        elif ht is not None:
            ht.zero_()
        return o, ht

    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    NT = triton.cdiv(T, CHUNK)
    BH, dev = B * H, q.device
    w, qw, kd = (mt.empty(BH, NT * CHUNK, K, dtype=torch.float32, device=dev) for _ in range(3))
    u, ou = (mt.empty(BH, NT * CHUNK, V, dtype=torch.float32, device=dev) for _ in range(2))
    eglast = mt.empty(BH, NT, K, dtype=torch.float32, device=dev)
    prec = "tf32x3" if v.dtype == torch.float32 else "tf32"
    _chunk_prep_kernel[(NT, BH)](q, k, v, g, beta, w, qw, kd, u, ou, eglast, T, NT, scale,
                                 H=H, K=K, V=V, BT=CHUNK, LOG2_BT=_LOG2_CHUNK, L2NORM=bool(l2norm_qk),
                                 PREC=prec, num_warps=8)
    # more V-blocks when there are few heads, so the sequential scan still fills the GPU
    BV = min(V, 32 if BH < 128 else 64)
    _chunk_scan_kernel[(V // BV, BH)](w, qw, kd, u, ou, eglast, h0, ht, o, T, NT,
                                      H=H, K=K, V=V, BT=CHUNK, BV=BV, HAS_H0=h0 is not None,
                                      STORE_HT=ht is not None, PREC=prec, num_warps=4, num_stages=1)
    return o, ht

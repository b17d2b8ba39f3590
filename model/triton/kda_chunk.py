"""Chunked KDA prefill in Triton: the fast twin of `model.kda.chunk_kda` (forward only).

Two kernels, both per (batch, head):

1. `_kda_chunk_prep_kernel`, one program per chunk of BT=64 tokens, all chunks in parallel. It does
   everything that does not need the state: q/k L2 norm, the intra-chunk matrices Akk/Aqk with their
   pairwise decays, the UT-transform solve T = (I + Akk)^-1, and folds the results into five per-chunk
   operands of the state recurrence ([B*H, NT*BT, D] so a chunk is one contiguous slab; fp32 for fp32
   inputs, bf16 for bf16/fp16 inputs, see "Precision" below):
       w  = T (beta k e^G)            u  = T (beta v)              (G: cumulative log decay in the chunk)
       qw = q e^G - Aqk w             ou = Aqk u
       kd = k e^(G_last - G)          eglast = e^G_last
2. `_kda_chunk_scan_kernel`, one program per (head, V-block of 32), walking the chunks in order with the
   fp32 state S [K, BV] in registers:
       v_new = u - w S;   o = qw S + ou   (= q e^G S + Aqk v_new);   S <- eglast * S + kd^T v_new

Precision. Decays are only ever formed as exp of a non-positive sum of the gates a span covers (see
`_level_pairs`), never as a difference of long prefix sums, so gates near 0, at -5 or at -1000 neither
overflow nor lose digits. Matmuls run on tensor cores with fp32 operands: `tf32x3` (about fp32
accuracy) for fp32 inputs, `tf32` for bf16/fp16 inputs. For bf16/fp16 inputs two roundings are added,
each far below what the inputs already carry (bf16: relative 2^-9):
- the span sums of gates are one tf32 dot: each gate rounded to relative 2^-11, all terms of one sign,
  so a span sum E <= 0 is off by at most 2^-11 |E| and its decay e^E by at most 2^-11 |E| e^E
  <= 2^-11 / e = 1.8e-4 (absolute, for a factor <= 1);
- w, qw, kd, u, ou are stored as bf16 (relative 2^-9, as fla stores w and u); the state stays fp32.
Tiles and warps were picked by timing on the H200 (T=8192, 32 heads of 128, bf16): the prep kernel at
64-column slices and 4 warps took 1.39 ms against 1.91 ms at 8 warps, though at 4 warps it spills about
1.2 KB per thread (264 B at 8 warps); the scan kernel spills 16 B. tests/test_triton_kda.py bounds both
(compiled offline with Triton's bundled ptxas).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt

CHUNK = 64
_LOG2_CHUNK = 6
_SLICE = 64  # columns of q, k, g, v the prep kernel holds at a time
_BV = 32     # state columns per scan program
_PREP_WARPS = 4  # see the module docstring: faster than 8 although it spills more
_BC = 16     # rows of a sub-block of prep="blocked"
_LOG2_BC = 4
_INTRA_SLICE = 16  # columns per step of the intra kernel: compiled for sm_90, 32 spills 176 B, 16 none
_INTRA_WARPS = 4
_WY_WARPS = 4
PREPS = ("level", "blocked")
PREP = "level"  # the default prep path of chunk_kda_fwd, see the module docstring
_SCAN_WARPS = 8


@triton.jit
def _load_rows(p0, n_live, SHIFT: tl.constexpr, STRIDE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """Rows SHIFT .. SHIFT+BT-1 of a chunk, BK columns from p0, as fp32 [BT, BK]; zero past the chunk and T."""
    r = tl.arange(0, BT) + SHIFT
    p = p0 + r[:, None] * STRIDE + tl.arange(0, BK)[None, :]
    return tl.load(p, mask=((r < n_live) & (r < BT))[:, None], other=0.).to(tl.float32)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 x as dtype, bf16 rounded to nearest even by hand: CUDA rounds so, Triton's interpreter
    truncates, and the CPU tests should see the GPU's error, not a bias."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _level_pairs(q_s, k_s, g_s, half, BT: tl.constexpr, PREC: tl.constexpr):
    """Partial sums (over this K slice) of sum_c k_t k_s exp(G_t - G_s) and the same with q_t, for the
    pairs (t, s) with t in the upper and s in the lower half of one 2*half-block of rows; zero elsewhere.

    With r the last row of that lower half, exp(G_t - G_s) = exp(g_{r+1} + ... + g_t) * exp(g_{s+1} + ... + g_r):
    both factors <= 1, one per row, so the pairs of a level are one tl.dot. Each exponent is the sum of
    the gates it spans, taken as a 0/1-masked product with g (PREC: tf32x3 is fp32-accurate, tf32 is
    bounded in the module docstring; a -1000 gate outside the span contributes an exact 0), never as a
    difference of long prefix sums, which would lose its low digits after a gate of -1000.
    """
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    upper = (r // half) % 2 == 1
    same_half = (r[:, None] // half) == (c[None, :] // half)
    spans = same_half & tl.where(upper[:, None], c[None, :] <= r[:, None], c[None, :] > r[:, None])
    decay = tl.exp(tl.dot(spans.to(tl.float32), g_s, input_precision=PREC))
    k_row = tl.where(upper[:, None], k_s * decay, 0.)
    q_row = tl.where(upper[:, None], q_s * decay, 0.)
    k_col = tl.trans(tl.where(upper[:, None], 0., k_s * decay))
    pair = (r[:, None] // (2 * half)) == (c[None, :] // (2 * half))
    A_kk = tl.where(pair, tl.dot(k_row, k_col, input_precision=PREC), 0.)
    A_qk = tl.where(pair, tl.dot(q_row, k_col, input_precision=PREC), 0.)
    return A_kk, A_qk


@triton.jit
def _row_factors(q0, k0, n_live, scale, S_Q: tl.constexpr, S_K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 K: tl.constexpr, L2NORM: tl.constexpr):
    """Row factors (f_q, f_k) [BT] of a chunk: q_t * f_q[t] is q's row t L2-normalised times scale (or just
    times scale without L2NORM), k_t * f_k[t] likewise without scale. Streams [BT, BK] column slices."""
    f_q = tl.zeros([BT], dtype=tl.float32) + scale
    f_k = tl.zeros([BT], dtype=tl.float32) + 1.
    if L2NORM:
        ss_q = tl.zeros([BT], dtype=tl.float32)
        ss_k = tl.zeros([BT], dtype=tl.float32)
        for kk in range(0, K, BK):
            q_s = _load_rows(q0 + kk, n_live, 0, S_Q, BT, BK)
            k_s = _load_rows(k0 + kk, n_live, 0, S_K, BT, BK)
            ss_q += tl.sum(q_s * q_s, axis=1)
            ss_k += tl.sum(k_s * k_s, axis=1)
        f_q = f_q / tl.sqrt(ss_q + 1e-6)
        f_k = f_k / tl.sqrt(ss_k + 1e-6)
    return f_q, f_k


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, LOG2_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for A [BT, BT] strictly lower triangular, by block doubling: with Tb the inverse of the
    block-diagonal part (blocks of `half`) and L the lower-left block of each 2*half-block of A, the inverse
    with blocks of 2*half is Tb - Tb L Tb; from Tb = I, LOG2_BT levels give the whole inverse, every step
    an exact 2x2 block inverse (no series)."""
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    Tm = (r[:, None] == c[None, :]).to(tl.float32)
    for lvl in range(LOG2_BT):
        half = 1 << lvl
        coupling = (r[:, None] // (2 * half) == c[None, :] // (2 * half)) & (r[:, None] // half != c[None, :] // half)
        L = tl.where(coupling, A, 0.)
        Tm = Tm - tl.dot(tl.dot(Tm, L, input_precision=PREC), Tm, input_precision=PREC)
    return Tm


@triton.jit
def _chunk_outputs(q0, k0, g0, v0, f_q, f_k, b_beta, Tm, Aqk, w, qw, kd, u, ou, eglast, slab, chunk, n_live,
                   S_Q: tl.constexpr, S_K: tl.constexpr, S_V: tl.constexpr, S_G: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """The five operands of the state recurrence from T = (I + Akk)^-1 and Aqk ([BT, BT] fp32), per slice:
    w = T (beta k e^G), qw = q e^G - Aqk w, kd = k e^(G_last - G) (the exponent summed from the end of the
    chunk), eglast = e^G_last; per V slice: u = T (beta v), ou = Aqk u. `slab` is the chunk's first row of
    the [B*H, NT*BT, D] outputs, `chunk` its index into the [B*H*NT, K] eglast."""
    r = tl.arange(0, BT)
    cb = tl.arange(0, BK)
    for kk in range(0, K, BK):
        q_s = _load_rows(q0 + kk, n_live, 0, S_Q, BT, BK) * f_q[:, None]
        k_s = _load_rows(k0 + kk, n_live, 0, S_K, BT, BK) * f_k[:, None]
        G = tl.cumsum(_load_rows(g0 + kk, n_live, 0, S_G, BT, BK), axis=0)  # g_1 + ... + g_t
        e_G = tl.exp(G)
        b_w = tl.dot(Tm, k_s * (b_beta[:, None] * e_G), input_precision=PREC)
        out = r[:, None] * K + kk + cb[None, :]
        tl.store(w + slab * K + out, _rounded(b_w, w.dtype.element_ty))
        tl.store(qw + slab * K + out, _rounded(q_s * e_G - tl.dot(Aqk, b_w, input_precision=PREC), qw.dtype.element_ty))
        # g_{t+1} + ... + g_last, summed from the end (not G_last - G_t)
        to_end = tl.cumsum(_load_rows(g0 + kk, n_live, 1, S_G, BT, BK), axis=0, reverse=True)
        tl.store(kd + slab * K + out, _rounded(k_s * tl.exp(to_end), kd.dtype.element_ty))
        G_last = tl.sum(tl.where((r == BT - 1)[:, None], G, 0.), axis=0)  # padded rows add g = 0
        tl.store(eglast + chunk * K + kk + cb, tl.exp(G_last))
    for vv in range(0, V, BK):
        b_u = tl.dot(Tm, _load_rows(v0 + vv, n_live, 0, S_V, BT, BK) * b_beta[:, None], input_precision=PREC)
        out = r[:, None] * V + vv + cb[None, :]
        tl.store(u + slab * V + out, _rounded(b_u, u.dtype.element_ty))
        tl.store(ou + slab * V + out, _rounded(tl.dot(Aqk, b_u, input_precision=PREC), ou.dtype.element_ty))


@triton.jit
def _kda_chunk_prep_kernel(q, k, v, g, beta, w, qw, kd, u, ou, eglast, T, NT, scale,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       LOG2_BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                       S_Q: tl.constexpr, S_K: tl.constexpr, S_V: tl.constexpr, S_G: tl.constexpr):
    """Per-chunk, state-free part of chunked KDA in one kernel (prep="level"). Grid (NT, B*H); one program =
    one chunk of one head.

    q, k, v, g are read as one row of H heads per token (heads packed, D contiguous) with the row strides
    S_Q, S_K, S_V, S_G (elements), B*T rows evenly spaced; beta is [B*T, H] contiguous.

    Only the [BT, BT] matrices Akk, Aqk and T stay in registers; q, k, g, v are streamed in [BT, BK]
    column slices (L1-resident rereads). Rows past T load as zeros (g = 0, beta = 0), which makes every
    output row there exactly zero, so the scan kernel never needs a mask.

    1. row norms of q and k (L2 norm; q also times scale);
    2. Akk (times beta) and Aqk: the pairs s < t are visited by the highest bit in which t and s
       differ, one tl.dot per level and slice (`_level_pairs`); the diagonal q_t.k_t is added to Aqk;
    3. T = (I + Akk)^-1 by block doubling over the same levels (`_unit_lower_inverse`);
    4. the outputs (`_chunk_outputs`).
    """
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    live = i_t * BT + r < T
    n_live = T - i_t * BT
    tok0 = i_b.to(tl.int64) * T + i_t * BT              # chunk's first token of the B*T rows
    slab = (i_bh.to(tl.int64) * NT + i_t) * BT          # chunk's first row of the [B*H, NT*BT, D] outputs
    # this head's first column in the chunk's first row of q, k, g, v
    q0, k0, g0 = q + tok0 * S_Q + i_h * K, k + tok0 * S_K + i_h * K, g + tok0 * S_G + i_h * K
    v0 = v + tok0 * S_V + i_h * V
    b_beta = tl.load(beta + tok0 * H + i_h + r * H, mask=live, other=0.).to(tl.float32)
    f_q, f_k = _row_factors(q0, k0, n_live, scale, S_Q, S_K, BT, BK, K, L2NORM)

    Akk = tl.zeros([BT, BT], dtype=tl.float32)
    Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for kk in range(0, K, BK):
        q_s = _load_rows(q0 + kk, n_live, 0, S_Q, BT, BK) * f_q[:, None]
        k_s = _load_rows(k0 + kk, n_live, 0, S_K, BT, BK) * f_k[:, None]
        g_s = _load_rows(g0 + kk, n_live, 0, S_G, BT, BK)
        for lvl in range(LOG2_BT):  # a loop, not unrolled: one level's tiles live at a time
            A_kk, A_qk = _level_pairs(q_s, k_s, g_s, 1 << lvl, BT, PREC)
            Akk += A_kk
            Aqk += A_qk
        Aqk += tl.where(r[:, None] == c[None, :], tl.sum(q_s * k_s, axis=1)[:, None], 0.)
    Tm = _unit_lower_inverse(Akk * b_beta[:, None], BT, LOG2_BT, PREC)
    _chunk_outputs(q0, k0, g0, v0, f_q, f_k, b_beta, Tm, Aqk, w, qw, kd, u, ou, eglast, slab,
                   i_bh.to(tl.int64) * NT + i_t, n_live, S_Q, S_K, S_V, S_G, K, V, BT, BK, PREC)


@triton.jit
def _intra_block(q0, k0, g0, n_live, B0: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                 LOG2_BC: tl.constexpr, PREC: tl.constexpr, S_Q: tl.constexpr, S_K: tl.constexpr,
                 S_G: tl.constexpr):
    """One block of BC rows (B0 .. B0+BC-1 of the chunk), one slice of BK columns from q0, k0, g0 (q, k
    raw: the row norms, scale and beta are applied to the finished blocks): the slice's partial sums of
    the diagonal blocks of Akk and Aqk and of the rows' squares, and the factors the block brings to the
    off-diagonal blocks, with the end of the block before it (row B0-1) as the reference row of the spans
    that reach into it:
        qe = q e^L, ke = k e^L          (L_t = g_B0 + ... + g_t, the span from the reference row to t)
        kc = k e^R                      (R_s = g_(s+1) + ... + g_(B0+BC-1), from s to this block's end)
        gsum = g_B0 + ... + g_(B0+BC-1) (per channel; the block's whole span)
    All are sums of gates of one sign (tl.cumsum / tl.sum in fp32, never a difference), so every factor is
    exp of a non-positive span sum, <= 1."""
    r = B0 + tl.arange(0, BC)
    rn = r + 1
    ck = tl.arange(0, BK)
    live = r < n_live
    q_b = tl.load(q0 + r[:, None] * S_Q + ck[None, :], mask=live[:, None], other=0.).to(tl.float32)
    k_b = tl.load(k0 + r[:, None] * S_K + ck[None, :], mask=live[:, None], other=0.).to(tl.float32)
    g_b = tl.load(g0 + r[:, None] * S_G + ck[None, :], mask=live[:, None], other=0.).to(tl.float32)
    # row s+1 of the block (zero past its end): R is summed from the block's end, not as gsum - L
    g_n = tl.load(g0 + rn[:, None] * S_G + ck[None, :], mask=((rn < B0 + BC) & (rn < n_live))[:, None],
                  other=0.).to(tl.float32)
    Akk = tl.zeros([BC, BC], dtype=tl.float32)
    Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    for lvl in range(LOG2_BC):
        A_kk, A_qk = _level_pairs(q_b, k_b, g_b, 1 << lvl, BC, PREC)
        Akk += A_kk
        Aqk += A_qk
    i = tl.arange(0, BC)
    Aqk += tl.where(i[:, None] == i[None, :], tl.sum(q_b * k_b, axis=1)[:, None], 0.)
    e_L = tl.exp(tl.cumsum(g_b, axis=0))
    kc = k_b * tl.exp(tl.cumsum(g_n, axis=0, reverse=True))
    return (q_b * e_L, k_b * e_L, kc, tl.sum(g_b, axis=0), Akk, Aqk,
            tl.sum(q_b * q_b, axis=1), tl.sum(k_b * k_b, axis=1))


@triton.jit
def _block_factors(beta0, n_live, scale, ss_q, ss_k, B0: tl.constexpr, H: tl.constexpr, BC: tl.constexpr,
                   L2NORM: tl.constexpr):
    """(f_q, f_k, beta) [BC] of rows B0 .. B0+BC-1: the factors of the raw q, k rows (see `_row_factors`)."""
    r = B0 + tl.arange(0, BC)
    b_beta = tl.load(beta0 + r * H, mask=r < n_live, other=0.).to(tl.float32)
    if L2NORM:
        return scale / tl.sqrt(ss_q + 1e-6), 1. / tl.sqrt(ss_k + 1e-6), b_beta
    return tl.zeros([BC], dtype=tl.float32) + scale, tl.zeros([BC], dtype=tl.float32) + 1., b_beta


@triton.jit
def _store_block(p, X, I: tl.constexpr, J: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Block (I, J) of a [BT, BT] matrix at p (row-major), rounded to p's dtype."""
    i = tl.arange(0, BC)
    tl.store(p + (I * BC + i)[:, None] * BT + J * BC + i[None, :], _rounded(X, p.dtype.element_ty))


@triton.jit
def _kda_chunk_intra_kernel(q, k, g, beta, Ti, Aq, T, NT, scale,
                            H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                            BK: tl.constexpr, LOG2_BC: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                            S_Q: tl.constexpr, S_K: tl.constexpr, S_G: tl.constexpr):
    """First half of prep="blocked": T = (I + Akk)^-1 and Aqk of one chunk by BC x BC blocks, written as
    the lower block triangles of [B*H, NT*BT, BT] (upper blocks are never written nor read). Grid (NT, B*H).

    The chunk is four blocks of BC = 16 rows; the ten lower blocks of Akk and of Aqk are summed over
    slices of BK columns (`_intra_block`; small slices keep the 16 x 16 dots' operands, which every warp
    holds whole, out of register spills), then scaled by the row norms, scale and beta.
    Diagonal blocks: the level pairs of the old kernel (`_level_pairs`) within 16 rows (four levels of
    16-row dots instead of six levels of 64 x 64 dots). Off-diagonal block (i, j), j < i: with the
    reference row B0_i - 1 inside every span (s, t] (s in block j, t in block i),
        exp(g_(s+1) + ... + g_t) = e^(L_i[t]) * e^(gsum_(j+1) + ... + gsum_(i-1)) * e^(R_j[s]),
    every factor <= 1, so the block is one 16 x 16 dot of qe_i (ke_i) with kc_j per slice.
    Inverse by blocks (forward substitution): T_ii = (I + A_ii)^-1 (`_unit_lower_inverse` at 16), and
    T_ij = -T_ii sum_(m=j..i-1) A_im T_mj, exact, no series.
    """
    tl.static_assert(BT == 4 * BC)
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    n_live = T - i_t * BT
    tok0 = i_b.to(tl.int64) * T + i_t * BT
    slab = (i_bh.to(tl.int64) * NT + i_t) * BT
    q0, k0, g0 = q + tok0 * S_Q + i_h * K, k + tok0 * S_K + i_h * K, g + tok0 * S_G + i_h * K
    b0 = beta + tok0 * H + i_h
    Ti += slab * BT
    Aq += slab * BT

    # Two passes over the column slices, Akk's blocks then Aqk's: one set of ten accumulators lives at a time
    # (both at once spill). Each pass uses only its half of `_intra_block`'s results; the rest compiles away.
    z = tl.zeros([BC, BC], dtype=tl.float32)
    zr = tl.zeros([BC], dtype=tl.float32)
    A00, A10, A11, A20, A21, A22, A30, A31, A32, A33 = z, z, z, z, z, z, z, z, z, z
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3 = zr, zr, zr, zr, zr, zr, zr, zr   # the rows' squares
    for kk in range(0, K, BK):
        _, ke0, kc0, gs0, a, _, x, y = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 0 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        A00, sq0, sk0 = A00 + a, sq0 + x, sk0 + y
        _, ke1, kc1, gs1, a, _, x, y = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 1 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        A11, sq1, sk1 = A11 + a, sq1 + x, sk1 + y
        A10 += tl.dot(ke1, tl.trans(kc0), input_precision=PREC)
        _, ke2, kc2, gs2, a, _, x, y = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 2 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        A22, sq2, sk2 = A22 + a, sq2 + x, sk2 + y
        A21 += tl.dot(ke2, tl.trans(kc1), input_precision=PREC)
        A20 += tl.dot(ke2 * tl.exp(gs1)[None, :], tl.trans(kc0), input_precision=PREC)
        _, ke3, kc3, gs3, a, _, x, y = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 3 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        A33, sq3, sk3 = A33 + a, sq3 + x, sk3 + y
        A32 += tl.dot(ke3, tl.trans(kc2), input_precision=PREC)
        A31 += tl.dot(ke3 * tl.exp(gs2)[None, :], tl.trans(kc1), input_precision=PREC)
        A30 += tl.dot(ke3 * tl.exp(gs1 + gs2)[None, :], tl.trans(kc0), input_precision=PREC)

    fq0, fk0, bt0 = _block_factors(b0, n_live, scale, sq0, sk0, 0 * BC, H, BC, L2NORM)
    fq1, fk1, bt1 = _block_factors(b0, n_live, scale, sq1, sk1, 1 * BC, H, BC, L2NORM)
    fq2, fk2, bt2 = _block_factors(b0, n_live, scale, sq2, sk2, 2 * BC, H, BC, L2NORM)
    fq3, fk3, bt3 = _block_factors(b0, n_live, scale, sq3, sk3, 3 * BC, H, BC, L2NORM)
    # Akk_ij[t, s] *= beta_t f_k[t] f_k[s];  Aqk_ij[t, s] *= f_q[t] f_k[s]
    c0, c1, c2, c3 = fk0[None, :], fk1[None, :], fk2[None, :], fk3[None, :]
    kr1, kr2, kr3 = (bt1 * fk1)[:, None], (bt2 * fk2)[:, None], (bt3 * fk3)[:, None]
    T00 = _unit_lower_inverse(A00 * (bt0 * fk0)[:, None] * c0, BC, LOG2_BC, PREC)
    T11 = _unit_lower_inverse(A11 * kr1 * c1, BC, LOG2_BC, PREC)
    A10 = A10 * kr1 * c0
    T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=PREC), input_precision=PREC)
    T22 = _unit_lower_inverse(A22 * kr2 * c2, BC, LOG2_BC, PREC)
    A20, A21 = A20 * kr2 * c0, A21 * kr2 * c1
    T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=PREC), input_precision=PREC)
    T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision=PREC) + tl.dot(A21, T10, input_precision=PREC),
                  input_precision=PREC)
    T33 = _unit_lower_inverse(A33 * kr3 * c3, BC, LOG2_BC, PREC)
    A30, A31, A32 = A30 * kr3 * c0, A31 * kr3 * c1, A32 * kr3 * c2
    T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=PREC), input_precision=PREC)
    T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision=PREC) + tl.dot(A32, T21, input_precision=PREC),
                  input_precision=PREC)
    T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision=PREC) + tl.dot(A31, T10, input_precision=PREC)
                  + tl.dot(A32, T20, input_precision=PREC), input_precision=PREC)
    _store_block(Ti, T00, 0, 0, BT, BC)
    _store_block(Ti, T10, 1, 0, BT, BC)
    _store_block(Ti, T11, 1, 1, BT, BC)
    _store_block(Ti, T20, 2, 0, BT, BC)
    _store_block(Ti, T21, 2, 1, BT, BC)
    _store_block(Ti, T22, 2, 2, BT, BC)
    _store_block(Ti, T30, 3, 0, BT, BC)
    _store_block(Ti, T31, 3, 1, BT, BC)
    _store_block(Ti, T32, 3, 2, BT, BC)
    _store_block(Ti, T33, 3, 3, BT, BC)

    Q00, Q10, Q11, Q20, Q21, Q22, Q30, Q31, Q32, Q33 = z, z, z, z, z, z, z, z, z, z
    for kk in range(0, K, BK):
        qe0, _, kc0, gs0, _, b, _, _ = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 0 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        Q00 += b
        qe1, _, kc1, gs1, _, b, _, _ = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 1 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        Q11 += b
        Q10 += tl.dot(qe1, tl.trans(kc0), input_precision=PREC)
        qe2, _, kc2, gs2, _, b, _, _ = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 2 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        Q22 += b
        Q21 += tl.dot(qe2, tl.trans(kc1), input_precision=PREC)
        Q20 += tl.dot(qe2 * tl.exp(gs1)[None, :], tl.trans(kc0), input_precision=PREC)
        qe3, _, kc3, gs3, _, b, _, _ = _intra_block(q0 + kk, k0 + kk, g0 + kk, n_live, 3 * BC, BC, BK, LOG2_BC,
                                                    PREC, S_Q, S_K, S_G)
        Q33 += b
        Q32 += tl.dot(qe3, tl.trans(kc2), input_precision=PREC)
        Q31 += tl.dot(qe3 * tl.exp(gs2)[None, :], tl.trans(kc1), input_precision=PREC)
        Q30 += tl.dot(qe3 * tl.exp(gs1 + gs2)[None, :], tl.trans(kc0), input_precision=PREC)
    qr0, qr1, qr2, qr3 = fq0[:, None], fq1[:, None], fq2[:, None], fq3[:, None]
    _store_block(Aq, Q00 * qr0 * c0, 0, 0, BT, BC)
    _store_block(Aq, Q10 * qr1 * c0, 1, 0, BT, BC)
    _store_block(Aq, Q11 * qr1 * c1, 1, 1, BT, BC)
    _store_block(Aq, Q20 * qr2 * c0, 2, 0, BT, BC)
    _store_block(Aq, Q21 * qr2 * c1, 2, 1, BT, BC)
    _store_block(Aq, Q22 * qr2 * c2, 2, 2, BT, BC)
    _store_block(Aq, Q30 * qr3 * c0, 3, 0, BT, BC)
    _store_block(Aq, Q31 * qr3 * c1, 3, 1, BT, BC)
    _store_block(Aq, Q32 * qr3 * c2, 3, 2, BT, BC)
    _store_block(Aq, Q33 * qr3 * c3, 3, 3, BT, BC)


@triton.jit
def _kda_chunk_wy_kernel(q, k, v, g, beta, Ti, Aq, w, qw, kd, u, ou, eglast, T, NT, scale,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         BK: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                         S_Q: tl.constexpr, S_K: tl.constexpr, S_V: tl.constexpr, S_G: tl.constexpr):
    """Second half of prep="blocked": the recurrence's operands (`_chunk_outputs`) from the T and Aqk that
    `_kda_chunk_intra_kernel` wrote (their lower block triangles; the rest loads as 0). Grid (NT, B*H)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, BT)
    n_live = T - i_t * BT
    tok0 = i_b.to(tl.int64) * T + i_t * BT
    slab = (i_bh.to(tl.int64) * NT + i_t) * BT
    q0, k0, g0 = q + tok0 * S_Q + i_h * K, k + tok0 * S_K + i_h * K, g + tok0 * S_G + i_h * K
    v0 = v + tok0 * S_V + i_h * V
    b_beta = tl.load(beta + tok0 * H + i_h + r * H, mask=r < n_live, other=0.).to(tl.float32)
    f_q, f_k = _row_factors(q0, k0, n_live, scale, S_Q, S_K, BT, BK, K, L2NORM)
    tri = (r[None, :] // BC) <= (r[:, None] // BC)
    at = slab * BT + r[:, None] * BT + r[None, :]
    Tm = tl.load(Ti + at, mask=tri, other=0.).to(tl.float32)
    Aqk = tl.load(Aq + at, mask=tri, other=0.).to(tl.float32)
    _chunk_outputs(q0, k0, g0, v0, f_q, f_k, b_beta, Tm, Aqk, w, qw, kd, u, ou, eglast, slab,
                   i_bh.to(tl.int64) * NT + i_t, n_live, S_Q, S_K, S_V, S_G, K, V, BT, BK, PREC)


@triton.jit
def _kda_chunk_scan_kernel(w, qw, kd, u, ou, eglast, h0, ht, o, T, NT,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """Inter-chunk recurrence and output. Grid (V // BV, B*H); one program = one head's V-block.

    The fp32 state block S [K, BV] stays in registers while the program walks the NT chunks in order;
    per chunk it reads the prep kernel's w, qw, kd [BT, K], u, ou [BT, BV] (fp32 or bf16) and eglast [K]:
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
    # Each iteration ends by loading the next chunk (the last one rereads itself, unused): the loads
    # are loop-carried, which measured faster and spills less than loading at the top of the body.
    # A while loop: Triton 3.6's interpreter cannot iterate range() over a runtime bound (NumPy >= 2.4).
    slab = i_bh.to(tl.int64) * NT * BT
    b_w = tl.load(w + slab * K + k_off)  # fp32 or bf16, widened where used
    b_qw = tl.load(qw + slab * K + k_off)
    b_kd = tl.load(kd + slab * K + k_off)
    b_u = tl.load(u + slab * V + v_off)
    b_ou = tl.load(ou + slab * V + v_off)
    b_eg = tl.load(eglast + i_bh.to(tl.int64) * NT * K + ck)
    n = 0
    while n < NT:
        v_new = b_u.to(tl.float32) - tl.dot(b_w.to(tl.float32), S, input_precision=PREC)
        b_o = b_ou.to(tl.float32) + tl.dot(b_qw.to(tl.float32), S, input_precision=PREC)
        t = n * BT + r
        p_o = o + ((i_b.to(tl.int64) * T + n * BT) * H + i_h) * V + r[:, None] * (H * V) + cv[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None])
        S = S * b_eg[:, None] + tl.dot(tl.trans(b_kd.to(tl.float32)), v_new, input_precision=PREC)
        nxt = tl.minimum(n + 1, NT - 1)
        slab = (i_bh.to(tl.int64) * NT + nxt) * BT
        b_w = tl.load(w + slab * K + k_off)
        b_qw = tl.load(qw + slab * K + k_off)
        b_kd = tl.load(kd + slab * K + k_off)
        b_u = tl.load(u + slab * V + v_off)
        b_ou = tl.load(ou + slab * V + v_off)
        b_eg = tl.load(eglast + (i_bh.to(tl.int64) * NT + nxt) * K + ck)
        n += 1
    if STORE_HT:
        tl.store(ht + head + state_off, S)


def _check_head_dim(name: str, d: int) -> None:
    if d < 16 or d > 128 or d & (d - 1):
        raise ValueError(f"chunk_kda_fwd: {name} head dim must be a power of two in [16, 128], got {d}")


def _token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, row stride): x [B, T, H, D] as the prep kernel reads it, per token one row of H heads of D
    contiguous values, the B*T rows evenly spaced. A column slice of a wider [B, T, C] tensor qualifies
    (q, k, v are slices of the conv output) and is read in place, through its row stride; else a copy."""
    B, T, H, D = x.shape
    row = x.stride(1) if T > 1 else x.stride(0)  # a size-1 dim's stride says nothing
    if x.stride(3) == 1 and (H == 1 or x.stride(2) == D) and (B == 1 or x.stride(0) == T * row):
        return x, row
    return x.contiguous(), H * D


def chunk_kda_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, l2norm_qk=True,
                  prep=None):
    """Chunked KDA forward; same layout and meaning as `model.kda.chunk_kda`.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (float dtypes; g is the log decay, <= 0);
    initial_state [B, H, K, V] (cast to fp32) or None. Any T >= 0. q and k are L2-normalised inside
    when l2norm_qk; scale defaults to K^-0.5. prep picks the state-free stage, "level" (one kernel) or
    "blocked" (two kernels by 16-row blocks), see the module docstring; None means PREP.
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
    prep = PREP if prep is None else prep
    if prep not in PREPS:
        raise ValueError(f"chunk_kda_fwd: prep must be one of {PREPS}, got {prep!r}")
    mt.require_runnable(_kda_chunk_prep_kernel, q.device)
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

    (q, s_q), (k, s_k), (v, s_v), (g, s_g) = (_token_rows(x) for x in (q, k, v, g))
    beta = beta.contiguous()
    NT = triton.cdiv(T, CHUNK)
    BH, dev = B * H, q.device
    exact = torch.float32 in (q.dtype, k.dtype, v.dtype)  # see "Precision" in the module docstring
    prec, store = ("tf32x3", torch.float32) if exact else ("tf32", torch.bfloat16)
    w, qw, kd = (mt.empty(BH, NT * CHUNK, K, dtype=store, device=dev) for _ in range(3))
    u, ou = (mt.empty(BH, NT * CHUNK, V, dtype=store, device=dev) for _ in range(2))
    eglast = mt.empty(BH, NT, K, dtype=torch.float32, device=dev)
    if prep == "level":
        _kda_chunk_prep_kernel[(NT, BH)](q, k, v, g, beta, w, qw, kd, u, ou, eglast, T, NT, scale,
                                         H=H, K=K, V=V, BT=CHUNK, BK=min(_SLICE, K, V), LOG2_BT=_LOG2_CHUNK,
                                         L2NORM=bool(l2norm_qk), PREC=prec, S_Q=s_q, S_K=s_k, S_V=s_v, S_G=s_g,
                                         num_warps=_PREP_WARPS)
    else:
        Ti, Aq = (mt.empty(BH, NT * CHUNK, CHUNK, dtype=store, device=dev) for _ in range(2))
        _kda_chunk_intra_kernel[(NT, BH)](q, k, g, beta, Ti, Aq, T, NT, scale, H=H, K=K, BT=CHUNK, BC=_BC,
                                          BK=min(_INTRA_SLICE, K), LOG2_BC=_LOG2_BC, L2NORM=bool(l2norm_qk), PREC=prec,
                                          S_Q=s_q, S_K=s_k, S_G=s_g, num_warps=_INTRA_WARPS)
        _kda_chunk_wy_kernel[(NT, BH)](q, k, v, g, beta, Ti, Aq, w, qw, kd, u, ou, eglast, T, NT, scale,
                                       H=H, K=K, V=V, BT=CHUNK, BC=_BC, BK=min(_SLICE, K, V),
                                       L2NORM=bool(l2norm_qk), PREC=prec, S_Q=s_q, S_K=s_k, S_V=s_v, S_G=s_g,
                                       num_warps=_WY_WARPS)
    BV = min(V, _BV)
    _kda_chunk_scan_kernel[(V // BV, BH)](w, qw, kd, u, ou, eglast, h0, ht, o, T, NT,
                                          H=H, K=K, V=V, BT=CHUNK, BV=BV, HAS_H0=h0 is not None,
                                          STORE_HT=ht is not None, PREC=prec, num_warps=_SCAN_WARPS, num_stages=1)
    return o, ht

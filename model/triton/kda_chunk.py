"""Chunked KDA prefill (forward only), the fast twin of `model.kda.chunk_kda`. A prep kernel, one program per chunk of
BT tokens, forms everything that needs no state (the intra-chunk pair matrices, their UT-transform inverse, and five
per-chunk operands of the state recurrence); a scan kernel, one program per (head, block of value columns), walks the
chunks in order with the fp32 state in registers. Every decay is formed as exp of a non-positive span of gates, so
no gate overflows or loses digits. The algorithm, precision bounds and measured configs: docs/kernels.md#kda-chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.common import rounded

# Launch config: chunks of 16 on a one-warp prep kernel were fastest at 8k tokens on the H200
# (docs/kernels.md#kda-chunk-launch-config). `exact`: the keys fp32 inputs take instead, as Triton 3.6 builds their
# tf32x3 dots at chunks of 16 on one warp wrong for sm_90 (test_gpu_chunk_fp32_fault_at_chunks_of_16 watches it).
CONFIG = mt.LaunchConfig("kda_chunk.CONFIG", chunk=16, slice=64, prep_warps=1, scan_bv=32, scan_warps=4,
                         prep_dots="bf16", scan_dots="bf16", prep_stages=3, prep_maxnreg=None, scan_stages=3,
                         exact=dict(chunk=32, prep_warps=2))


@triton.jit
def _load_rows(p0, n_live, STRIDE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The BT rows of a chunk, BK columns from p0, as fp32 [BT, BK]; zero past T."""
    r = tl.arange(0, BT)
    p = p0 + r[:, None] * STRIDE + tl.arange(0, BK)[None, :]
    return tl.load(p, mask=(r < n_live)[:, None], other=0.).to(tl.float32)


LOG2E = tl.constexpr(1.4426950408889634)  # the gates enter the kernel's sums times log2(e), so each decay is one 2^x


@triton.jit
def _exp2(x, COMPILED: tl.constexpr):
    """2^x. Compiled: one `ex2.approx.ftz`, without tl.exp2's fix-up for subnormal results (a decay below 2^-126
    only ever multiplies values of order 1 into sums, so 0 serves). Interpreted: tl.exp2."""
    if COMPILED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.exp2(x)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, BF16_DOTS: tl.constexpr, COMPILED: tl.constexpr):
    """a @ b with fp32 accumulation. BF16_DOTS: both operands rounded to bf16 (the interpreter, whose bf16 tl.dot is
    wrong in Triton 3.6, dots those values as fp32 in IEEE); else fp32 operands in PREC."""
    if BF16_DOTS:
        if COMPILED:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        return tl.dot(rounded(a.to(tl.float32), tl.bfloat16, False).to(tl.float32),
                      rounded(b.to(tl.float32), tl.bfloat16, False).to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _level_pairs(q_s, k_s, g_s, half, BT: tl.constexpr, PREC: tl.constexpr, BF16_DOTS: tl.constexpr,
                 COMPILED: tl.constexpr):
    """Partial sums (over this K slice) of sum_c k_t k_s exp(G_t - G_s) and the same with q_t, for the pairs (t, s)
    with t in the upper and s in the lower half of one 2*half-block of rows; zero elsewhere.

    With r the last row of that lower half, exp(G_t - G_s) = exp(g_{r+1} + ... + g_t) * exp(g_{s+1} + ... + g_r):
    two factors <= 1, one per row, so a level's pairs are one tl.dot; each exponent a 0/1-masked product with g.
    """
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    upper = (r // half) % 2 == 1
    same_half = (r[:, None] // half) == (c[None, :] // half)
    spans = same_half & tl.where(upper[:, None], c[None, :] <= r[:, None], c[None, :] > r[:, None])
    decay = _exp2(tl.dot(spans.to(tl.float32), g_s, input_precision=PREC), COMPILED)  # g_s in log2 units
    # the products of the wrong halves are dropped from the [BT, BT] results, not masked from the operands
    k_d = k_s * decay
    k_col = tl.trans(k_d)
    pair = ((r[:, None] // (2 * half)) == (c[None, :] // (2 * half))) & upper[:, None] & ((c // half) % 2 == 0)[None, :]
    A_kk = tl.where(pair, _dot(k_d, k_col, PREC, BF16_DOTS, COMPILED), 0.)
    A_qk = tl.where(pair, _dot(q_s * decay, k_col, PREC, BF16_DOTS, COMPILED), 0.)
    return A_kk, A_qk


@triton.jit
def _kda_chunk_prep_kernel(q, k, v, g, beta, w, qw, kd, u, ou, eglast, T, NT, scale,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       LOG2_BT: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                       S_Q: tl.constexpr, S_K: tl.constexpr, S_V: tl.constexpr, S_G: tl.constexpr,
                       BF16_DOTS: tl.constexpr, COMPILED: tl.constexpr):
    """Per-chunk, state-free part of chunked KDA. Grid (NT, B*H); one program = one chunk of one head.

    q, k, v, g: a row of H heads per token (row strides S_*), streamed in [BT, BK] column slices; beta [B*T, H].
    Rows past T load as zeros, so their outputs are zero and the scan needs no mask.

    1. Akk, Aqk from the raw q and k by levels (`_level_pairs`), the row norms applied at the end;
    2. T = (I + Akk)^-1 by block doubling over the same levels (T <- T - T L T, an exact 2x2 block inverse a step);
    3. per slice: w = T (beta k e^G), qw = q e^G - Aqk w, kd = k e^(G_last - G), eglast = e^G_last; per V slice:
       u = T (beta v), ou = Aqk u. The sums of gates are tl.dots with 0/1 matrices, not tl.cumsum.
    """
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    cb = tl.arange(0, BK)
    live = i_t * BT + r < T
    n_live = T - i_t * BT
    tok0 = i_b.to(tl.int64) * T + i_t * BT              # chunk's first token of the B*T rows
    slab = (i_bh.to(tl.int64) * NT + i_t) * BT          # chunk's first row of the [B*H, NT*BT, D] outputs
    # this head's first column in the chunk's first row of q, k, g, v
    q0, k0, g0 = q + tok0 * S_Q + i_h * K, k + tok0 * S_K + i_h * K, g + tok0 * S_G + i_h * K
    v0 = v + tok0 * S_V + i_h * V
    b_beta = tl.load(beta + tok0 * H + i_h + r * H, mask=live, other=0.).to(tl.float32)

    ss_q = tl.zeros([BT], dtype=tl.float32)
    ss_k = tl.zeros([BT], dtype=tl.float32)
    Akk = tl.zeros([BT, BT], dtype=tl.float32)
    Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for kk in range(0, K, BK):
        q_s = _load_rows(q0 + kk, n_live, S_Q, BT, BK)
        k_s = _load_rows(k0 + kk, n_live, S_K, BT, BK)
        g_s = _load_rows(g0 + kk, n_live, S_G, BT, BK) * LOG2E
        ss_q += tl.sum(q_s * q_s, axis=1)
        ss_k += tl.sum(k_s * k_s, axis=1)
        for lvl in range(LOG2_BT):  # a loop, not unrolled: one level's tiles live at a time
            A_kk, A_qk = _level_pairs(q_s, k_s, g_s, 1 << lvl, BT, PREC, BF16_DOTS, COMPILED)
            Akk += A_kk
            Aqk += A_qk
        Aqk += tl.where(r[:, None] == c[None, :], tl.sum(q_s * k_s, axis=1)[:, None], 0.)
    # row factors, applied to the sums above and to q, k below: q_t * f_q[t], k_t * f_k[t]
    f_q = tl.zeros([BT], dtype=tl.float32) + scale
    f_k = tl.zeros([BT], dtype=tl.float32) + 1.
    if L2NORM:
        f_q = f_q / tl.sqrt(ss_q + 1e-6)
        f_k = f_k / tl.sqrt(ss_k + 1e-6)
    Akk = Akk * (f_k * b_beta)[:, None] * f_k[None, :]
    Aqk = Aqk * f_q[:, None] * f_k[None, :]

    Tm = (r[:, None] == c[None, :]).to(tl.float32)
    for lvl in range(LOG2_BT):
        half = 1 << lvl
        coupling = (r[:, None] // (2 * half) == c[None, :] // (2 * half)) & (r[:, None] // half != c[None, :] // half)
        L = tl.where(coupling, Akk, 0.)
        Tm = Tm - tl.dot(tl.dot(Tm, L, input_precision=PREC), Tm, input_precision=PREC)

    # the prefix sums of the gates as tl.dots with 0/1 matrices in PREC: a tensor-core pass, not a shuffle ladder
    incl = (c[None, :] <= r[:, None]).to(tl.float32)   # row t: g_0 + ... + g_t
    after = (c[None, :] > r[:, None]).to(tl.float32)   # row t: g_{t+1} + ... + g_{BT-1}
    for kk in range(0, K, BK):
        q_s = _load_rows(q0 + kk, n_live, S_Q, BT, BK) * f_q[:, None]
        k_s = _load_rows(k0 + kk, n_live, S_K, BT, BK) * f_k[:, None]
        g_s = _load_rows(g0 + kk, n_live, S_G, BT, BK) * LOG2E
        e_G = _exp2(tl.dot(incl, g_s, input_precision=PREC), COMPILED)
        out = r[:, None] * K + kk + cb[None, :]
        b_w = _dot(Tm, k_s * (b_beta[:, None] * e_G), PREC, BF16_DOTS, COMPILED)
        tl.store(w + slab * K + out, rounded(b_w, w.dtype.element_ty, COMPILED))
        tl.store(qw + slab * K + out,
                 rounded(q_s * e_G - _dot(Aqk, b_w, PREC, BF16_DOTS, COMPILED), qw.dtype.element_ty, COMPILED))
        # g_{t+1} + ... + g_last summed as such (not G_last - G_t)
        to_end = tl.dot(after, g_s, input_precision=PREC)
        tl.store(kd + slab * K + out, rounded(k_s * _exp2(to_end, COMPILED), kd.dtype.element_ty, COMPILED))
        # e^G_last is e_G's last row (padded rows add g = 0)
        tl.store(eglast + (i_bh.to(tl.int64) * NT + i_t) * K + kk + cb[None, :] + 0 * r[:, None], e_G,
                 mask=(r == BT - 1)[:, None])
    for vv in range(0, V, BK):
        b_u = _dot(Tm, _load_rows(v0 + vv, n_live, S_V, BT, BK) * b_beta[:, None], PREC, BF16_DOTS, COMPILED)
        out = r[:, None] * V + vv + cb[None, :]
        tl.store(u + slab * V + out, rounded(b_u, u.dtype.element_ty, COMPILED))
        tl.store(ou + slab * V + out,
                 rounded(_dot(Aqk, b_u, PREC, BF16_DOTS, COMPILED), ou.dtype.element_ty, COMPILED))


@triton.jit
def _scan_chunk(S, n, w, qw, kd, u, ou, eglast, o, T, NT, i_bh,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                PREC: tl.constexpr, BF16_DOTS: tl.constexpr, COMPILED: tl.constexpr):
    """Chunk n of the scan for head i_bh (of B*H): loads its operands, stores its o, returns the state after it."""
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, BT)
    ck = tl.arange(0, K)
    cv = tl.program_id(0) * BV + tl.arange(0, BV)
    slab = (i_bh.to(tl.int64) * NT + n) * BT
    b_w = tl.load(w + slab * K + r[:, None] * K + ck[None, :])  # fp32 or bf16, widened where used
    b_qw = tl.load(qw + slab * K + r[:, None] * K + ck[None, :])
    b_kd = tl.load(kd + slab * K + r[:, None] * K + ck[None, :])
    b_u = tl.load(u + slab * V + r[:, None] * V + cv[None, :])
    b_ou = tl.load(ou + slab * V + r[:, None] * V + cv[None, :])
    b_eg = tl.load(eglast + (i_bh.to(tl.int64) * NT + n) * K + ck)
    v_new = b_u.to(tl.float32) - _dot(b_w, S, PREC, BF16_DOTS, COMPILED)
    b_o = b_ou.to(tl.float32) + _dot(b_qw, S, PREC, BF16_DOTS, COMPILED)
    t = n * BT + r
    p_o = o + ((i_b.to(tl.int64) * T + n * BT) * H + i_h) * V + r[:, None] * (H * V) + cv[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None])
    return S * b_eg[:, None] + _dot(tl.trans(b_kd), v_new, PREC, BF16_DOTS, COMPILED)


@triton.jit
def _kda_chunk_scan_kernel(w, qw, kd, u, ou, eglast, h0, ht, o, T, NT,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr,
                       BF16_DOTS: tl.constexpr, COMPILED: tl.constexpr, STAGES: tl.constexpr):
    """Inter-chunk recurrence and output. Grid (V // BV, B*H); one program = one head's V-block.

    The fp32 state block S [K, BV] stays in registers while the program walks the NT chunks in order:
        v_new = u - w S;   o = qw S + ou;   S <- eglast[:, None] * S + kd^T v_new
    Compiled, a software-pipelined loop (the next STAGES - 1 chunks' loads in flight); interpreted, a while loop
    (Triton 3.6's interpreter cannot iterate range() over a runtime bound with NumPy >= 2.4).
    """
    i_bh = tl.program_id(1)
    ck = tl.arange(0, K)
    cv = tl.program_id(0) * BV + tl.arange(0, BV)
    state_off = ck[:, None] * V + cv[None, :]
    head = i_bh.to(tl.int64) * K * V

    S = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + head + state_off)
    if COMPILED:
        for n in tl.range(0, NT, num_stages=STAGES):
            S = _scan_chunk(S, n, w, qw, kd, u, ou, eglast, o, T, NT, i_bh,
                            H, K, V, BT, BV, PREC, BF16_DOTS, COMPILED)
    else:
        n = 0
        while n < NT:
            S = _scan_chunk(S, n, w, qw, kd, u, ou, eglast, o, T, NT, i_bh,
                            H, K, V, BT, BV, PREC, BF16_DOTS, COMPILED)
            n += 1
    if STORE_HT:
        tl.store(ht + head + state_off, S)


def _check_head_dim(name: str, d: int) -> None:
    if d < 16 or d > 128 or d & (d - 1):
        raise ValueError(f"chunk_kda_fwd: {name} head dim must be a power of two in [16, 128], got {d}")


def _token_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, row stride): x [B, T, H, D] as the prep kernel reads it, one row of H heads a token, the B*T rows evenly
    spaced; a column slice of a wider tensor (q, k, v of the conv output) is read in place, else copied."""
    B, T, H, D = x.shape
    row = x.stride(1) if T > 1 else x.stride(0)  # a size-1 dim's stride says nothing
    if x.stride(3) == 1 and (H == 1 or x.stride(2) == D) and (B == 1 or x.stride(0) == T * row):
        return x, row
    return x.contiguous(), H * D


def chunk_kda_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, l2norm_qk=True,
                  cfg: dict | None = None):
    """Chunked KDA forward, with `model.kda.chunk_kda`'s layout and meaning: q, k, g [B, T, H, K]; v [B, T, H, V];
    beta [B, T, H]; initial_state [B, H, K, V] or None; any T >= 0. `cfg` overrides keys of CONFIG.
    Returns (o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 or None)."""
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
    c = mt.launch_config("chunk_kda_fwd", CONFIG, cfg)
    exact = torch.float32 in (q.dtype, k.dtype, v.dtype)  # fp32 operands in tf32x3, and CONFIG["exact"]
    if exact:
        c = {**c, **{key: val for key, val in c["exact"].items() if key not in (cfg or {})}}
    BT = c["chunk"]
    if BT not in (16, 32, 64):
        raise ValueError(f"chunk_kda_fwd: cfg chunk must be 16, 32 or 64, got {BT!r}")
    for key in ("prep_dots", "scan_dots"):
        if c[key] not in ("tf32", "bf16"):
            raise ValueError(f"chunk_kda_fwd: cfg {key} must be 'tf32' or 'bf16', got {c[key]!r}")
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
    NT = triton.cdiv(T, BT)
    BH, dev = B * H, q.device
    prec, store = ("tf32x3", torch.float32) if exact else ("tf32", torch.bfloat16)
    w, qw, kd = (mt.empty(BH, NT * BT, K, dtype=store, device=dev) for _ in range(3))
    u, ou = (mt.empty(BH, NT * BT, V, dtype=store, device=dev) for _ in range(2))
    eglast = mt.empty(BH, NT, K, dtype=torch.float32, device=dev)
    _kda_chunk_prep_kernel[(NT, BH)](q, k, v, g, beta, w, qw, kd, u, ou, eglast, T, NT, scale,
                                     H=H, K=K, V=V, BT=BT, BK=min(c["slice"], K, V), LOG2_BT=BT.bit_length() - 1,
                                     L2NORM=bool(l2norm_qk), PREC=prec, S_Q=s_q, S_K=s_k, S_V=s_v, S_G=s_g,
                                     BF16_DOTS=not exact and c["prep_dots"] == "bf16",
                                     COMPILED=mt.compiled(_kda_chunk_prep_kernel), num_warps=c["prep_warps"],
                                     num_stages=c["prep_stages"], maxnreg=c["prep_maxnreg"])
    BV = min(V, c["scan_bv"])
    _kda_chunk_scan_kernel[(V // BV, BH)](w, qw, kd, u, ou, eglast, h0, ht, o, T, NT,
                                          H=H, K=K, V=V, BT=BT, BV=BV, HAS_H0=h0 is not None,
                                          STORE_HT=ht is not None, PREC=prec,
                                          BF16_DOTS=not exact and c["scan_dots"] == "bf16",
                                          COMPILED=mt.compiled(_kda_chunk_scan_kernel), STAGES=c["scan_stages"],
                                          num_warps=c["scan_warps"])
    return o, ht


mt.seal(__name__)

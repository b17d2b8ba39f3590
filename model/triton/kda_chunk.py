"""Chunked KDA prefill in Triton: the fast twin of `model.kda.chunk_kda` (forward only).

Two kernels, both per (batch, head):

1. `_kda_chunk_prep_kernel`, one program per chunk of BT tokens (CONFIG: 16; 32 for fp32 inputs), all chunks in
   parallel. It does everything that does not need the state: q/k L2 norm, the intra-chunk matrices Akk/Aqk with their
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
overflow nor lose digits. Matmuls run on tensor cores. fp32 inputs take fp32 operands in `tf32x3` (about fp32
accuracy) throughout. bf16/fp16 inputs add roundings, each of the order of what the inputs already carry (bf16:
relative 2^-9):
- every sum of gates (the levels' spans, and the outputs' G and g_{t+1} + ... + g_last) is one tl.dot of the gates
  with a 0/1 matrix, in tf32: each gate rounded to relative 2^-11, all terms of one sign,
  so a span sum E <= 0 is off by at most 2^-11 |E| and its decay e^E by at most 2^-11 |E| e^E
  <= 2^-11 / e = 1.8e-4 (absolute, for a factor <= 1); the inverse T = (I + Akk)^-1 is also formed in tf32;
- w, qw, kd, u, ou are stored as bf16 (relative 2^-9, as fla stores w and u); the state stays fp32;
- the other dots take bf16 operands (relative 2^-9 each) with fp32 accumulation, as fla's do: in the prep
  kernel the pair matrices Akk, Aqk and the products with T and Aqk, in the scan S and v_new (the state carried
  from chunk to chunk stays fp32). CONFIG prep_dots / scan_dots = "tf32" give them fp32 operands in tf32
  instead; tests/test_triton_kda.py holds both to the same tolerances against fp64.
Chunk length, tiles and warps were first picked by timing on the H200 (32 heads of 128, bf16; `bench_kernels
--chunk-sweep`, prep and scan together, run of 57b6106): chunks of 32 with a 2-warp prep kernel, 1.446 ms at
8192 tokens `d1ca4e4e` and 5.708 ms at 32768 `e9e0afa8`, against 1.991 / 7.773 ms for chunks of 64 with
64-column slices over 4 warps `a574b62f` / `730ed1df`, the best at 64 (8 warps: 2.51 ms `267b4e17`). At 32
the prep kernel's dots are a quarter the size and its levels five; the scan walks twice the chunks and the
pair still costs less. At 1024 tokens the same order (0.197 against 0.265 ms, `98547fda`, `2e567ce7`). The
prep kernel's register spills at the default stay under 512 B per thread and the scan kernel's under 16 B, the
bounds tests/test_triton_kda.py holds them to (compiled offline with Triton's bundled ptxas).
The bf16 dot operands (prep_dots, scan_dots, see "Precision") were timed in the sweep of feabbe1 at 8192
tokens, one key at a time from the tf32 default above (1.441 ms `13b829a1`; fla 1.292 in the same run
`e9b5044e`): the scan with bf16 dots 1.244 ms at 4 warps `5565f1f0` (1.353 at 8 `59808207`, 1.281 with 16
columns `783d7feb`), the prep with bf16 dots 1.388 ms `31f08412`. Both are the default now; the pair together
was not in that sweep, and the benchmark's default case times it.
The scan's walk is software-pipelined (scan_stages): a chunk's loads wait on nothing of the chunk before, so
Triton's pipeliner brings the next chunks' w, qw, kd, u, ou into shared memory while this one computes; unpipelined,
each chunk's loads were issued after the state update and their latency sat on the walk's critical path. At 8192
tokens (sweep of 5513998, prep and scan together): three stages 0.969 ms `e3b5c28d`, four 0.974 `4f956d9b`, two
1.140 `cbc8bf87`, one (no prefetch) 1.170 `eb32d5e5`; the loop before, its loads at the end of the body, took
1.194 ms in the run of 014c1f5 `873e35a9`.
In the whole 48B bf16 prefill at 8192 tokens, two stages took 1.035x the time of three (paired median of 6 rounds,
1.003 to 1.091, the same bits, `c23af6ea`).
A register cap on the prep kernel (prep_maxnreg) trades spills for programs per SM: 168 registers with one stage
timed 0.913 ms `4f83b312`, at the default three stages 0.944 `2b2d393c` (128 registers: 1.071 `c15cba20`), but in
the whole prefill 168 registers at three stages took 1.007x the default's time (0.87 to 1.06, `1834c076`), so the
default leaves the compiler's 255.
The gates' prefix sums as tl.dots (632606e; before it, tl.cumsum and a masked row-sum for G_last, and the levels'
[BT, BK] operands masked rather than their [BT, BT] products): chunk_kda at 8192 tokens 0.886 ms against fla's 1.075
in the same run `796fe3f3`, at 32768 3.461 against 4.146 `f2cebdd7`, at 1024 0.156 against 0.999 `2ba02f4f`. In the
whole 48B bf16 prefill, in interleaved rounds against the prep kernel of 0a1039e swapped in (a scratch arm of
`benchmarks.bench_ab`, see the records' note), the old kernel took 1.0055x the new one's time at 8k (6 rounds,
0.990 to 1.098, `8b3e7312`) and 1.014x at 32k (0.982 to 1.043, `c49d394a`); both at the power cap. Those records
say INVALID by bench_ab's logits tolerance, which is set for launch configs: any change of KDA's rounding moves the
random-weight model's 8k logits by about 0.1 relative RMS (0.099 here; chunks of 16 0.0993 `70993f22`, the scan's
dots in tf32 0.0992 `6b20d374`). The levels' change alone, on the old prefix sums, was slower than the kernel
before (an unrecorded same-process comparison); the tiles and warps above were swept before both changes and not
since.
Every decay as one ex2.approx.ftz (85165b7, first tried as 55d3449): the gates scaled by log2(e) before their sums,
where tl.exp adds a log2(e) multiply and a three-instruction fix-up a value for subnormal results (`_exp2`; offline
sm_90 SASS: 3,656 static instructions from 4,008, the levels loop 533 a pass from 687). chunk_kda at 8192 tokens
0.796 ms against fla's 1.523 in the same run (`19d79f0d`; fla read 1.075 in the run of `796fe3f3`, its autotuning
differs from box to box). In the whole 48B bf16 prefill, in interleaved rounds of `benchmarks.bench_ab` with
632606e's kernel as the other arm (`--variant old=kda_chunk@632606e`), 632606e's kernel took 1.023x this one's time
at 8k (12 rounds, paired ratios 0.981 to 1.165, medians 126.28 against 124.05 ms, `7326a885`; 8 rounds in another
run 1.042, `f67292a8`; 6 rounds through a scratch arm before, 1.015, `a8f8b1cb`) and 1.013x at 32k (0.988 to 1.039,
`ec925427`), at the power cap throughout. At 32768 tokens 3.104 ms against fla's 6.087 (`94983965`); in the 8k
prefill's decomposition the prep kernel takes 12.54 ms a step, 15.22 before (`c8897391`, `63426479`).
Chunks of 16 on a one-warp prep kernel (the default since 5665093): after the ex2 decays the sweep of f037866 at 8192
tokens timed them at 0.690 ms `b3982dc0` against 0.796 for the chunks of 32 on two warps before (`4c26e0b3`, fla
1.079 in the same run); at 16, two warps 0.832 `c3ad162e`, four 1.166; at 32, one warp 1.377, four 1.090; at 64 the
best 1.090 `4d69ecd6`. Against fla's output the relative RMS error is 4.8e-3 in o and 2.8e-3 in the final state
(`cd6de7ec`), 4.6e-3 and 2.4e-3 at the chunks of 32 (`4c26e0b3`). In the whole 48B bf16 prefill (`bench_ab`, 10
interleaved rounds, at the power cap) the old config took 1.028x this one's time at 8k (paired ratios 0.980 to 1.138,
`28a9b4d1`) and 1.022x at 32k (0.993 to 1.042, `6b168f25`); those records say INVALID by bench_ab's launch-config
logits tolerance (2e-2), which a change of KDA's rounding exceeds (4.9e-2 and 3.8e-2 here). Around the new default
(sweep of 5665093): the scan's four stages 0.666 ms `31723a44` against 0.690 `cd6de7ec`, and no faster in the whole
prefill (1.003x at 8k `60e5827a`, 1.0025x at 32k `d59e78cc`, the same bits), so three stay; slices of 32 0.765, of
128 0.817; the scan's other tiles 0.689 to 2.85. fp32 inputs keep chunks of 32 on two warps (CONFIG "exact").
Measured and removed: a "blocked" prep (the pairs inside 16-row sub-blocks by a walk of decay products instead
of the four small levels' tl.dots, their inverse by forward substitution) was slower at every length and
config: 8192 tokens 2.81 ms at best `31edc9ae`, 3.24 ms at the default tiles `50b812e5`. The dots of the small
levels are cheaper than the elementwise work that replaces them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt

# Launch config: the chunk length (BT, a power of two in [16, 64]), the prep kernel's column slice and warps, the
# scan kernel's state columns per program and warps, the dot operands of either kernel for bf16/fp16 inputs
# (see "Precision"; fp32 inputs always take tf32x3), the prep's pipeline stages and register cap (None: the
# compiler's), the scan's pipeline stages. See the module docstring for how they were picked. `exact`: the keys that
# fp32 inputs take instead (unless `cfg` names them): compiled by Triton 3.6 for the H200, the prep kernel's tf32x3
# dots at chunks of 16 on one warp come out wrong (relative RMS error 0.4 to 0.7 against the torch chunked form in
# tests/test_triton_kda.py's real-shape fp32 cases, device call 2 of session 24; in call 3's unrecorded check at
# 1000 tokens, 16 on four warps also wrong, 16 on two and 32 on one or two right). The interpreter agrees with fp64
# at every chunk length, and bf16 inputs, whose dots take bf16 or tf32 operands, pass compiled; so fp32 keeps the
# config it had before, chunks of 32 on two warps. test_gpu_chunk_fp32_fault_at_chunks_of_16 watches the fault.
CONFIG = dict(chunk=16, slice=64, prep_warps=1, scan_bv=32, scan_warps=4, prep_dots="bf16", scan_dots="bf16",
              prep_stages=3, prep_maxnreg=None, scan_stages=3, exact=dict(chunk=32, prep_warps=2))


@triton.jit
def _load_rows(p0, n_live, STRIDE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The BT rows of a chunk, BK columns from p0, as fp32 [BT, BK]; zero past T."""
    r = tl.arange(0, BT)
    p = p0 + r[:, None] * STRIDE + tl.arange(0, BK)[None, :]
    return tl.load(p, mask=(r < n_live)[:, None], other=0.).to(tl.float32)


@triton.jit
def _rounded(x, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 x as dtype, rounded to nearest even: compiled, by the GPU's own conversion; interpreted, bf16 by hand,
    as Triton's interpreter truncates and the CPU tests should see the GPU's error, not a bias."""
    if dtype == tl.bfloat16 and not COMPILED:
        b = x.to(tl.uint32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


LOG2E = tl.constexpr(1.4426950408889634)  # the gates enter the kernel's sums times log2(e), so each decay is one 2^x


@triton.jit
def _exp2(x, COMPILED: tl.constexpr):
    """2^x. Compiled: one `ex2.approx.ftz` (MUFU.EX2), where tl.exp2 and tl.exp add three instructions a value to
    keep subnormal results (a decay below 2^-126 only ever multiplies values of order 1 into bf16 or fp32 sums, so
    0 serves); the same approximation otherwise. Interpreted: tl.exp2."""
    if COMPILED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.exp2(x)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, BF16_DOTS: tl.constexpr, COMPILED: tl.constexpr):
    """a @ b with fp32 accumulation on tensor cores (see "Precision"). BF16_DOTS: both operands rounded to bf16 (to
    nearest even); under the interpreter, whose bf16 tl.dot is wrong in Triton 3.6, the same bf16 values as fp32 in
    an IEEE dot (the same exact products, summed in another order). Else fp32 operands in PREC."""
    if BF16_DOTS:
        if COMPILED:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        return tl.dot(_rounded(a.to(tl.float32), tl.bfloat16, False).to(tl.float32),
                      _rounded(b.to(tl.float32), tl.bfloat16, False).to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _level_pairs(q_s, k_s, g_s, half, BT: tl.constexpr, PREC: tl.constexpr, BF16_DOTS: tl.constexpr,
                 COMPILED: tl.constexpr):
    """Partial sums (over this K slice) of sum_c k_t k_s exp(G_t - G_s) and the same with q_t, for the
    pairs (t, s) with t in the upper and s in the lower half of one 2*half-block of rows; zero elsewhere.

    With r the last row of that lower half, exp(G_t - G_s) = exp(g_{r+1} + ... + g_t) * exp(g_{s+1} + ... + g_r):
    both factors <= 1, one per row, so the pairs of a level are one tl.dot. Each exponent is the sum of
    the gates it spans, taken as a 0/1-masked product with g (PREC: tf32x3 is fp32-accurate, tf32 is
    bounded in the module docstring; a -1000 gate outside the span contributes an exact 0), never as a
    difference of long prefix sums, which would lose its low digits after a gate of -1000. g_s holds the
    gates times log2(e), so each factor is one 2^x (`_exp2`).
    """
    r = tl.arange(0, BT)
    c = tl.arange(0, BT)
    upper = (r // half) % 2 == 1
    same_half = (r[:, None] // half) == (c[None, :] // half)
    spans = same_half & tl.where(upper[:, None], c[None, :] <= r[:, None], c[None, :] > r[:, None])
    decay = _exp2(tl.dot(spans.to(tl.float32), g_s, input_precision=PREC), COMPILED)  # g_s in log2 units
    # every row scaled by its own half's factor; the products of the wrong halves are dropped from the [BT, BT]
    # results, not the [BT, BK] operands masked: half the selects, and the same value for every pair kept
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

    q, k, v, g are read as one row of H heads per token (heads packed, D contiguous) with the row strides
    S_Q, S_K, S_V, S_G (elements), B*T rows evenly spaced; beta is [B*T, H] contiguous.

    Only the [BT, BT] matrices Akk, Aqk and T stay in registers; q, k, g, v are streamed in [BT, BK]
    column slices (L1-resident rereads), which keeps the kernel out of register spills. Rows past T load
    as zeros (g = 0, beta = 0), which makes every output row there exactly zero, so the scan kernel
    never needs a mask.

    1. Akk and Aqk from the raw q and k, with the row norms of q and k summed in the same pass and applied
       at the end (A[t, s] * f[t] * f_k[s]: L2 norm, q also times scale; Akk also times beta). The pairs s < t
       are visited by the highest bit in which t and s differ, one tl.dot per level and slice
       (`_level_pairs`); the diagonal q_t.k_t is added to Aqk;
    2. T = (I + Akk)^-1 by block doubling over the same levels: with Tb the inverse of the
       block-diagonal part (blocks of `half`) and L the pairs of level `half` (lower-left block of
       each 2*half-block), the inverse with blocks of 2*half is Tb - Tb L Tb; from Tb = I, LOG2_BT levels
       give the full BT x BT inverse, every step an exact 2x2 block inverse (no series);
    3. per slice: w = T (beta k e^G), qw = q e^G - Aqk w, kd = k e^(G_last - G) (the exponent summed
       from the end of the chunk), eglast = e^G_last; per V slice: u = T (beta v), ou = Aqk u. The sums of
       gates are tl.dots with 0/1 matrices (see "Precision"), not tl.cumsum.
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

    # the prefix sums of the gates as tl.dots with 0/1 matrices in PREC (see "Precision"): a tensor-core pass where
    # tl.cumsum's scan took a ladder of shuffles (offline sm_90 SASS: 2,258 instructions a slice before, 1,219 after)
    incl = (c[None, :] <= r[:, None]).to(tl.float32)   # row t: g_0 + ... + g_t
    after = (c[None, :] > r[:, None]).to(tl.float32)   # row t: g_{t+1} + ... + g_{BT-1}
    for kk in range(0, K, BK):
        q_s = _load_rows(q0 + kk, n_live, S_Q, BT, BK) * f_q[:, None]
        k_s = _load_rows(k0 + kk, n_live, S_K, BT, BK) * f_k[:, None]
        g_s = _load_rows(g0 + kk, n_live, S_G, BT, BK) * LOG2E
        e_G = _exp2(tl.dot(incl, g_s, input_precision=PREC), COMPILED)
        out = r[:, None] * K + kk + cb[None, :]
        b_w = _dot(Tm, k_s * (b_beta[:, None] * e_G), PREC, BF16_DOTS, COMPILED)
        tl.store(w + slab * K + out, _rounded(b_w, w.dtype.element_ty, COMPILED))
        tl.store(qw + slab * K + out,
                 _rounded(q_s * e_G - _dot(Aqk, b_w, PREC, BF16_DOTS, COMPILED), qw.dtype.element_ty, COMPILED))
        # g_{t+1} + ... + g_last summed as such (not G_last - G_t)
        to_end = tl.dot(after, g_s, input_precision=PREC)
        tl.store(kd + slab * K + out, _rounded(k_s * _exp2(to_end, COMPILED), kd.dtype.element_ty, COMPILED))
        # e^G_last is e_G's last row (padded rows add g = 0)
        tl.store(eglast + (i_bh.to(tl.int64) * NT + i_t) * K + kk + cb[None, :] + 0 * r[:, None], e_G,
                 mask=(r == BT - 1)[:, None])
    for vv in range(0, V, BK):
        b_u = _dot(Tm, _load_rows(v0 + vv, n_live, S_V, BT, BK) * b_beta[:, None], PREC, BF16_DOTS, COMPILED)
        out = r[:, None] * V + vv + cb[None, :]
        tl.store(u + slab * V + out, _rounded(b_u, u.dtype.element_ty, COMPILED))
        tl.store(ou + slab * V + out,
                 _rounded(_dot(Aqk, b_u, PREC, BF16_DOTS, COMPILED), ou.dtype.element_ty, COMPILED))


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

    The fp32 state block S [K, BV] stays in registers while the program walks the NT chunks in order;
    per chunk it reads the prep kernel's w, qw, kd [BT, K], u, ou [BT, BV] (fp32 or bf16) and eglast [K]:
        v_new = u - w S;   o = qw S + ou;   S <- eglast[:, None] * S + kd^T v_new
    (three dots per chunk, `_dot`: with BF16_DOTS, S and v_new enter them rounded to bf16, as in fla's scan; the
    carried S stays fp32). The final S is the final state.
    Compiled, the walk is Triton's software-pipelined loop: it loads the next STAGES - 1 chunks into shared memory
    while this one computes (1: no prefetch, each chunk's loads wait for the chunk before). Interpreted, a while
    loop (Triton 3.6's interpreter cannot iterate range() over a runtime bound with NumPy >= 2.4); both run
    `_scan_chunk`, the same arithmetic.
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
    """(x, row stride): x [B, T, H, D] as the prep kernel reads it, per token one row of H heads of D
    contiguous values, the B*T rows evenly spaced. A column slice of a wider [B, T, C] tensor qualifies
    (q, k, v are slices of the conv output) and is read in place, through its row stride; else a copy."""
    B, T, H, D = x.shape
    row = x.stride(1) if T > 1 else x.stride(0)  # a size-1 dim's stride says nothing
    if x.stride(3) == 1 and (H == 1 or x.stride(2) == D) and (B == 1 or x.stride(0) == T * row):
        return x, row
    return x.contiguous(), H * D


def chunk_kda_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, l2norm_qk=True,
                  cfg: dict | None = None):
    """Chunked KDA forward; same layout and meaning as `model.kda.chunk_kda`.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (float dtypes; g is the log decay, <= 0);
    initial_state [B, H, K, V] (cast to fp32) or None. Any T >= 0. q and k are L2-normalised inside
    when l2norm_qk; scale defaults to K^-0.5.
    `cfg` overrides keys of CONFIG (for the benchmark's sweep).
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
    c = mt.launch_config("chunk_kda_fwd", CONFIG, cfg)
    exact = torch.float32 in (q.dtype, k.dtype, v.dtype)  # see "Precision" in the module docstring
    if exact:  # see CONFIG
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

"""MLA decode over the latent cache ("flash-decoding"), and the absorbed up-projections around it: the fast
twins of `model.ops.mla_decode_attention_torch` and of the torch form in `model.ops.mla_absorb`. Forward only, fp32 math.

`mla_decode`: one query per head and sequence against cache positions 0..pos (pos a device scalar). The
positions are cut into fixed-length splits, one program per (sequence, split), all heads at once (the cache
is shared by the heads, so each latent row is read from memory once): scores [H, BL] = q_lat c^T + q_pe k_pe^T,
online softmax, acc [H, R] += p c. Each program writes its unnormalised acc and its (max, sum) to a fp32
workspace; a second kernel merges the splits. The grid is fixed by the buffer's length (CUDA-graph safe), but
programs whose split starts past pos return at once and nothing past pos is loaded, so the cost follows pos.
Short buffers, which that layout would spread over only a few SMs (at 1k positions ~8 programs), are cut
finer (`SHORT`): the heads into groups, one program per (head group, sequence, split), and the positions
into shorter splits of smaller tiles; the workspace layout, and so the combine, stay the same.
Two split kernels compute the same thing (`CONFIG["rows"]`, see `plan`): `_mla_decode_split_kernel`, the heads as
the products' rows, and `_mla_decode_positions_kernel`, the cache positions as the rows, which makes them
warpgroup MMAs on sm_90 (bf16 caches at steps of 64 positions).

Precision: the cache is bf16 (or fp32), q_lat and p are fp32. tl.dot of bf16 operands multiplies exactly (a
product of two bf16 is exact in fp32) and accumulates in fp32, so the fp32 operand is split into a bf16 head
and a bf16 tail (x = hi + lo + O(2^-17 |x|)) and dotted twice: fp32-accurate scores and p @ c at twice the
bf16 MMA cost, far cheaper than fp32 (IEEE) dots, which run on the FMA units. An fp32 cache takes IEEE dots.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.norms import _rms_normalize

# The split kernel's tile and launch. sm_90 build at 32 heads x 512, specialised as the model's launch is (its
# strides multiples of 16; tests/test_triton_kda.py sm90_spills): BL=64 with 8 warps takes 205 registers and no
# spills, and Triton's pipeliner turns the cache loads into async copies, three stages deep (220 KB of shared
# memory); BL=32 takes 210 registers, no spills; 4 warps spill 488 bytes. The [32, 512] fp32 accumulator alone is
# 64 registers a thread. (Built without the launch's int specialisation, as this note first was, the loads stay
# synchronous and the counts differ: 229 registers at BL=64.)
_BL = 64  # cache positions per loop step
_WARPS = 8
# The layout for short buffers: `heads` heads a program and loop steps of `BL` positions (splits of down to
# 2 * BL), taken when the buffer's splits of the standard layout at its shortest (MIN_SPLIT), with the heads
# grouped, still fit on the SMs at once. sm_90 launched builds, 16 heads x 512: 156 registers at BL=32 (8 warps),
# no spills; BL=64: 158 to 166 by split (8 warps; 4 warps spill 8 bytes). At 1k positions: 34 programs (17 splits
# of 64, 2 head groups) against 8. None: the standard layout at every length.
# Where the split is two or more of _BL, the loop takes steps of _BL even in head groups: fewer, longer steps.
# Graph-timed per layer on the H200 (16 heads a program, `bench_kernels --ops mla_decode_layout`): at 1056
# positions splits of 64 in steps of 32 take 11.8 us `0f2d6f68` (of 128 in steps of 64: 12.8 us `8607c857`); at
# 8192 splits of 128 take 20.5 us in steps of 32 `9607ca09`, 17.2 us in steps of 64 `396ad3e7`; all heads 22.0.
SHORT: dict | None = dict(heads=16, BL=32)
# An fp32 cache takes IEEE dots of fp32 tiles: at BL=64 they need 377 KB of shared memory (sm_90 has 227 KB;
# the H200 refused the launch), at 16 positions 150 KB with no spills at 8 warps.
_BL_FP32 = 16


@triton.jit
def _dot_bf16(a, b, acc, MMA: tl.constexpr):
    """acc + a @ b of bf16 tiles (exact products, fp32 sums); MMA=False (the interpreter, whose bf16 tl.dot is wrong
    in Triton 3.6) dots the same values as fp32 in IEEE."""
    if MMA:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _dot_f32(a, b, acc, B_IS_BF16: tl.constexpr, MMA: tl.constexpr):
    """acc + a @ b for fp32 or bf16 `a`, to fp32 accuracy: with bf16 `b`, an fp32 `a` takes its bf16 head and
    tail in two exact-product dots (`_dot_bf16`), a bf16 `a` (the bf16 model's q_pe) one, its tail being zero;
    fp32 `b` takes one IEEE dot."""
    if B_IS_BF16:
        if a.dtype == tl.bfloat16:
            return _dot_bf16(a, b, acc, MMA)
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        return _dot_bf16(lo, b, _dot_bf16(hi, b, acc, MMA), MMA)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _split_span(pos_ptr, i_s, SPLIT: tl.constexpr):
    """Split i_s's positions [start, end): from i_s * SPLIT to the split's end or pos, whichever is first (empty
    for a split that starts past pos)."""
    start = i_s * SPLIT
    return start, tl.minimum(start + SPLIT, tl.load(pos_ptr).to(tl.int32) + 1)


@triton.jit
def _group_heads(i_g, H: tl.constexpr, HG: tl.constexpr, HP: tl.constexpr):
    """Head group i_g's heads as HP lanes, and which lanes are heads."""
    if HG >= H:
        h = tl.arange(0, HP)  # one group: no head offset (a runtime one costs ~20 registers at 32 heads)
    else:
        h = i_g * HG + tl.arange(0, HP)
    return h, (tl.arange(0, HP) < HG) & (h < H)


@triton.jit
def _mla_decode_split_kernel(q_lat, q_pe, c, k_pe, pos_ptr, o_part, m_part, l_part, qk_scale,
                             s_qpe_b, s_qpe_h, s_c_b, s_c_l, s_kpe_b, s_kpe_l,
                             H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, HG: tl.constexpr,
                             HP: tl.constexpr, RP: tl.constexpr, PP: tl.constexpr, SPLIT: tl.constexpr,
                             BL: tl.constexpr, BF16: tl.constexpr, MMA: tl.constexpr):
    """One (head group, sequence, split): heads [i_g * HG, (i_g + 1) * HG) (HP >= HG of them in the tiles),
    positions [i_s * SPLIT, min((i_s + 1) * SPLIT, pos + 1)). The head group is the grid's fastest axis, so
    the groups of one split run side by side and all but the first find its cache rows in L2."""
    i_g, i_b, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NS = tl.num_programs(2)
    start, end = _split_span(pos_ptr, i_s, SPLIT)
    if end <= start:
        return  # past the current position: nothing to read; the combine skips this split
    h, m_h = _group_heads(i_g, H, HG, HP)
    r, p = tl.arange(0, RP), tl.arange(0, PP)
    m_r, m_p = r < R, p < P
    q = tl.load(q_lat + (i_b * H + h[:, None]) * R + r[None, :], mask=m_h[:, None] & m_r[None, :], other=0.)
    qp = tl.load(q_pe + i_b * s_qpe_b + h[:, None] * s_qpe_h + p[None, :], mask=m_h[:, None] & m_p[None, :],
                 other=0.)     # in its own dtype: a bf16 q_pe takes one dot, not a head and a zero tail
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, RP], tl.float32)
    # a constant trip count (a bound computed from pos would not run under the interpreter): blocks past
    # `end` are fully masked, so they cost no memory traffic, and only the split holding pos has any
    for l0 in range(0, SPLIT, BL):
        offs = start + l0 + tl.arange(0, BL)
        valid = offs < end
        row = offs.to(tl.int64)
        cb = tl.load(c + i_b.to(tl.int64) * s_c_b + row[:, None] * s_c_l + r[None, :],
                     mask=valid[:, None] & m_r[None, :], other=0.)
        kb = tl.load(k_pe + i_b.to(tl.int64) * s_kpe_b + row[:, None] * s_kpe_l + p[None, :],
                     mask=valid[:, None] & m_p[None, :], other=0.)
        s = _dot_f32(q, tl.trans(cb), tl.zeros([HP, BL], tl.float32), BF16, MMA)
        s = _dot_f32(qp, tl.trans(kb), s, BF16, MMA)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))      # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = _dot_f32(pr, cb, acc * alpha[:, None], BF16, MMA)
        m_i = m_new
    row = i_b * NS + i_s
    tl.store(o_part + (row * H + h[:, None]) * R + r[None, :], acc, mask=m_h[:, None] & m_r[None, :])
    tl.store(m_part + row * H + h, m_i, mask=m_h)
    tl.store(l_part + row * H + h, l_i, mask=m_h)


@triton.jit
def _hi_lo_columns(x):
    """[K, N] fp32 -> [K, 2N] bf16: column 2j is x[:, j]'s bf16 head, column 2j+1 its bf16 tail (x = hi + lo +
    O(2^-17 |x|)), so that one product gives both halves of an fp32-accurate one (`_sum_column_pairs`)."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.reshape(tl.join(hi, lo), (x.shape[0], 2 * x.shape[1]))


@triton.jit
def _sum_column_pairs(x):
    """[M, 2N] -> [M, N]: column j the sum of columns 2j and 2j+1."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    return a + b


@triton.jit
def _mla_decode_positions_kernel(q_lat, q_pe, c, k_pe, pos_ptr, o_part, m_part, l_part, qk_scale,
                                  s_qpe_b, s_qpe_h, s_c_b, s_c_l, s_kpe_b, s_kpe_l,
                                  H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, HG: tl.constexpr,
                                  HP: tl.constexpr, RP: tl.constexpr, PP: tl.constexpr, SPLIT: tl.constexpr,
                                  BL: tl.constexpr, MMA: tl.constexpr):
    """`_mla_decode_split_kernel` for a bf16 cache, with the cache positions as the products' rows:

        s^T [BL, HP]  = pairs(c [BL, R] @ hilo(q_lat^T) [R, 2HP] + k_pe [BL, P] @ hilo(q_pe^T) [P, 2HP])
        acc^T [R, HP] = alpha acc^T + c^T @ hi(p^T) + c^T @ lo(p^T)

    the same fp32-accurate products (each fp32 operand as its bf16 head and tail, `_hi_lo_columns`), online
    softmax down the positions. Why: on sm_90 a product with at least 64 rows is a warpgroup MMA (wgmma), which
    reads both operands from shared memory; with the heads as rows (32) the other kernel's products are mma.sync,
    whose operands every warp loads into registers from shared memory for every tile, the loop-invariant q's head
    and tail included. Same workspace as the other kernel, same combine."""
    i_g, i_b, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NS = tl.num_programs(2)
    start, end = _split_span(pos_ptr, i_s, SPLIT)
    if end <= start:
        return  # past the current position: nothing to read; the combine skips this split
    h, m_h = _group_heads(i_g, H, HG, HP)
    r, p = tl.arange(0, RP), tl.arange(0, PP)
    m_r, m_p = r < R, p < P
    q2 = _hi_lo_columns(tl.load(q_lat + (i_b * H + h[None, :]) * R + r[:, None], mask=m_r[:, None] & m_h[None, :],
                                other=0.))
    qp2 = _hi_lo_columns(tl.load(q_pe + i_b * s_qpe_b + h[None, :] * s_qpe_h + p[:, None],
                                 mask=m_p[:, None] & m_h[None, :], other=0.).to(tl.float32))
    c_b = c + i_b.to(tl.int64) * s_c_b      # the sequence's rows: within them 32-bit offsets (`mla_decode` checks)
    kpe_b = k_pe + i_b.to(tl.int64) * s_kpe_b
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([RP, HP], tl.float32)
    for l0 in range(0, SPLIT, BL):   # a constant trip count, as in the other kernel
        offs = start + l0 + tl.arange(0, BL)
        valid = offs < end
        cb = tl.load(c_b + offs[:, None] * s_c_l + r[None, :], mask=valid[:, None] & m_r[None, :], other=0.)
        kb = tl.load(kpe_b + offs[:, None] * s_kpe_l + p[None, :], mask=valid[:, None] & m_p[None, :], other=0.)
        s = _dot_bf16(kb, qp2, _dot_bf16(cb, q2, tl.zeros([BL, 2 * HP], tl.float32), MMA), MMA)
        s = tl.where(valid[:, None], _sum_column_pairs(s) * qk_scale, float("-inf"))      # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(pr, 0)
        p_hi = pr.to(tl.bfloat16)
        ct = tl.trans(cb)
        acc = _dot_bf16(ct, (pr - p_hi.to(tl.float32)).to(tl.bfloat16), _dot_bf16(ct, p_hi, acc * alpha[None, :], MMA),
                        MMA)
        m_i = m_new
    row = i_b * NS + i_s
    tl.store(o_part + (row * H + h[None, :]) * R + r[:, None], acc, mask=m_r[:, None] & m_h[None, :])
    tl.store(m_part + row * H + h, m_i, mask=m_h)
    tl.store(l_part + row * H + h, l_i, mask=m_h)


@triton.jit
def _mla_decode_combine_kernel(o_part, m_part, l_part, pos_ptr, out, SPLIT: tl.constexpr, NS: tl.constexpr,
                               H: tl.constexpr, R: tl.constexpr, NSP: tl.constexpr, BR: tl.constexpr,
                               SB: tl.constexpr):
    """out[b, h, r-block] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s over the splits that ran.

    The splits are merged SB at a time as one [SB, BR] tile (a fixed order: blocks in turn, a tree within a
    block), not one after another: at 128k context there are ~130 splits, and a loop of dependent scalar
    loads would wait on memory ~130 times."""
    i_b, i_h, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(pos_ptr).to(tl.int32) // SPLIT + 1       # splits that started at or before pos
    s = tl.arange(0, NSP)
    ms = tl.load(m_part + (i_b * NS + s) * H + i_h, mask=s < n, other=float("-inf"))
    ls = tl.load(l_part + (i_b * NS + s) * H + i_h, mask=s < n, other=0.)
    m = tl.max(ms, 0)
    denom = tl.sum(tl.exp2(ms - m) * ls, 0)
    r = i_r * BR + tl.arange(0, BR)
    acc = tl.zeros([BR], tl.float32)
    for s0 in range(0, NS, SB):  # splits past pos: masked, never read (their workspace is left unwritten)
        sb = s0 + tl.arange(0, SB)
        live = sb < n
        w = tl.exp2(tl.load(m_part + (i_b * NS + sb) * H + i_h, mask=live, other=float("-inf")) - m)
        rows = tl.load(o_part + ((i_b * NS + sb[:, None]) * H + i_h) * R + r[None, :],
                       mask=live[:, None] & (r < R)[None, :], other=0.)
        acc += tl.sum(w[:, None] * rows, axis=0)
    tl.store(out + (i_b * H + i_h) * R + r, acc / denom, mask=r < R)


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))   # tl.dot needs every dimension >= 16


# At least two loop steps per split. With SPLIT == BL the loop is gone and ptxas builds a 32-register variant
# that spills ~9 KB a thread (the launched sm_90 build: 8,912 bytes of stack, 3,245 LDL, 2,415 STL); that variant
# took 129 us a call inside the CUDA graph at 1k context (decomposition record b37af712), a quarter of the decode
# step. Every SPLIT from 2*BL up builds without spills (198 to 205 registers; tests/test_triton_kda.py); the same
# holds for the head groups of SHORT at their BL (16 heads, SPLIT=BL=64: 4.6 KB of spills).
MIN_SPLIT = 2 * _BL


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def default_split(L: int, B: int, device: torch.device) -> int:
    """Positions per split of the standard layout: about one program per SM when the whole buffer is in use, a
    multiple of _BL, at least MIN_SPLIT."""
    return max(MIN_SPLIT, _BL * triton.cdiv(triton.cdiv(L, max(1, _sms(device) // B)), _BL))


def default_layout(L: int, B: int, H: int, device: torch.device) -> tuple[int, int]:
    """(positions per split, heads per program) for a buffer of L positions: the standard layout (`default_split`,
    all heads), or, where even its shortest splits with the heads grouped fit on the SMs at once, SHORT's:
    about one program per SM when the whole buffer is in use, splits a multiple of SHORT's BL, at least two
    steps of it."""
    sms = _sms(device)
    if SHORT is not None and SHORT["heads"] < H:
        groups = triton.cdiv(H, SHORT["heads"])
        if B * groups * triton.cdiv(L, MIN_SPLIT) <= sms:
            bl = SHORT["BL"]
            return max(2 * bl, bl * triton.cdiv(triton.cdiv(L, max(1, sms // (B * groups))), bl)), SHORT["heads"]
    return default_split(L, B, device), H


# Which split kernel a bf16 cache takes where the loop step is _BL positions: "heads" (`_mla_decode_split_kernel`,
# the heads the products' rows) or "positions" (`_mla_decode_positions_kernel`, the cache positions the rows: warpgroup
# MMAs on sm_90), over `positions_warps` warps. Everything else (an fp32 cache, SHORT's steps of 32) takes "heads".
# The launched sm_90 builds at 32 heads, offline (the shared-memory reads estimated from their instructions' shapes;
# nothing here measured): two stages (three need 303 KB of shared memory), 229,376 bytes of shared memory (the heads
# kernel's three: 225,280), the cache loads async copies.
# - "heads" (mma.sync): 186 ldmatrix.x4 a warp per 64 positions, ~762 KB of shared-memory reads for the products
#   (194 and ~795 KB before the bf16 q_pe took one dot; `_dot_f32`).
# - "positions", 4 warps (one warpgroup): 255 registers (8 bytes spilled: one value kept across the loop, stored
#   before it and loaded after it); the scores as 36 wgmma m64n64k16, p @ c as 64 m64n32k16, each reading both
#   operands from shared memory: ~344 KB.
# - "positions", 8 warps: 216 registers, no spills; Triton gives a dot that feeds another all warps along its
#   rows (its flash-attention rule), so both warpgroups compute the same 64-row scores: 104 m64n32k16 each, ~639 KB.
# "positions" (4 warps) is the default, from H200 runs: a layer's decode attention 88.6 against the heads
# kernel's 96.2 us at 128k (`3af6521c`), 36.9 against 37.3 at 32k (`b42d2d7e`), 8 warps slower at every length
# (`95d6e249`; all at 2a19018); the whole graph decode step at 128k 3.047 against 3.102 ms (`afb49030`,
# `37216595`, at 8d33c8b), and Gate B in bf16 gives the same md5 with either (`dccc6b65`, `9278fd68`).
CONFIG = dict(rows="positions", positions_warps=4)
ROWS = ("heads", "positions")
_POSITIONS_STAGES = 2


class Plan(NamedTuple):
    split: int   # positions per program
    heads: int   # heads per program
    step: int    # positions per loop step
    rows: str    # the split kernel that runs: one of ROWS
    warps: int   # its warps


def plan(L: int, B: int, H: int, dtype: torch.dtype, device: torch.device, split: int | None = None,
         heads: int | None = None, cfg: dict | None = None) -> Plan:
    """How `mla_decode` runs over a buffer of L positions (its arguments' meaning there)."""
    if split is None:
        if heads is not None:
            raise ValueError("mla_decode: heads per program needs its split")
        split, heads = default_layout(L, B, H, device)
    heads = H if heads is None else min(heads, H)
    unit = SHORT["BL"] if heads < H and SHORT is not None else _BL   # positions per loop step (bf16)
    if heads < 1 or split % unit or split < 2 * unit:
        raise ValueError(f"mla_decode: split must be a multiple of {unit} and >= {2 * unit} at {heads} heads a "
                         f"program, got {split}")
    step = _BL if split % _BL == 0 and split >= 2 * _BL else unit
    c = mt.launch_config("mla_decode", CONFIG, cfg)
    if c["rows"] not in ROWS:
        raise ValueError(f"mla_decode: rows must be one of {ROWS}, got {c['rows']!r}")
    if c["positions_warps"] not in (4, 8):
        raise ValueError(f"mla_decode: positions_warps must be 4 or 8 (warpgroups), got {c['positions_warps']!r}")
    if c["rows"] == "positions" and dtype == torch.bfloat16 and step == _BL:
        return Plan(split, heads, step, "positions", c["positions_warps"])
    return Plan(split, heads, step, "heads", _WARPS)


def mla_decode(q_lat, q_pe, c, k_pe, pos, scale, split: int | None = None, heads: int | None = None,
               cfg: dict | None = None):
    """Latent attention output [B,H,R] fp32 of q_lat [B,H,R] fp32 and q_pe [B,H,P] over c [B,L,R] and
    k_pe [B,L,P] (bf16 or fp32, one dtype), positions 0..pos (a device scalar). `split` = positions per
    program and `heads` = heads per program (both by default `default_layout`; a split alone takes all heads):
    all heads take splits that are multiples of 64, at least MIN_SPLIT; fewer (SHORT's layout), multiples of
    SHORT's BL, at least two of them. `cfg` overrides CONFIG's keys (`rows`: which split kernel)."""
    B, H, R = q_lat.shape
    L, P = c.shape[1], k_pe.shape[-1]
    if c.dtype not in (torch.bfloat16, torch.float32) or k_pe.dtype != c.dtype:
        raise TypeError(f"mla_decode: cache must be bf16 or fp32 (one dtype), got {c.dtype} / {k_pe.dtype}")
    assert q_lat.dtype == torch.float32 and q_lat.is_contiguous()
    assert c.stride(-1) == 1 and k_pe.stride(-1) == 1 and q_pe.stride(-1) == 1
    mt.require_runnable(_mla_decode_split_kernel, c.device)
    layout = plan(L, B, H, c.dtype, c.device, split, heads, cfg)
    split, heads, step = layout.split, layout.heads, layout.step
    ns = triton.cdiv(L, split)
    o_part = mt.empty(B, ns, H, R, dtype=torch.float32, device=c.device)
    m_part = mt.empty(B, ns, H, dtype=torch.float32, device=c.device)
    l_part = mt.empty(B, ns, H, dtype=torch.float32, device=c.device)
    out = mt.empty(B, H, R, dtype=torch.float32, device=c.device)
    RP = _pad(R)
    grid = (triton.cdiv(H, heads), B, ns)
    args = (q_lat, q_pe, c, k_pe, pos, o_part, m_part, l_part, scale * 1.4426950408889634,
            q_pe.stride(0), q_pe.stride(1), c.stride(0), c.stride(1), k_pe.stride(0), k_pe.stride(1))
    shape = dict(H=H, R=R, P=P, HG=heads, HP=_pad(heads), RP=RP, PP=_pad(P), SPLIT=split)
    if layout.rows == "positions":
        if max((L - 1) * c.stride(1) + R, (L - 1) * k_pe.stride(1) + P) >= 2 ** 31:
            raise ValueError(f"mla_decode: the positions kernel addresses a sequence's cache in 32 bits; {L} positions "
                             f"of stride {c.stride(1)} do not fit (rows='heads' does)")
        _mla_decode_positions_kernel[grid](*args, **shape, BL=_BL, MMA=mt.compiled(_mla_decode_positions_kernel),
                                           num_warps=layout.warps, num_stages=_POSITIONS_STAGES)
    else:
        _mla_decode_split_kernel[grid](*args, **shape, BL=step if c.dtype == torch.bfloat16 else _BL_FP32,
                                       BF16=c.dtype == torch.bfloat16, MMA=mt.compiled(_mla_decode_split_kernel),
                                       num_warps=layout.warps)
    BR = min(RP, 128)
    nsp = triton.next_power_of_2(ns)
    _mla_decode_combine_kernel[(B, H, triton.cdiv(R, BR))](o_part, m_part, l_part, pos, out, SPLIT=split, NS=ns,
                                                          H=H, R=R, NSP=nsp, BR=BR, SB=min(nsp, 32))
    return out


@triton.jit
def _mla_cache_append_kernel(kv, weight, c_cache, kpe_cache, pos_ptr, eps, s_kv, s_cb, s_cl, s_kb, s_kl,
                             R: tl.constexpr, P: tl.constexpr, RP: tl.constexpr, PP: tl.constexpr):
    """Sequence b (one program): c_cache[b, pos] = rmsnorm(kv[b, :R]) in HF's order (fp32 normalise, round
    to kv's dtype, times weight), kpe_cache[b, pos] = kv[b, R:]."""
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr).to(tl.int64)
    r, p = tl.arange(0, RP)[None, :], tl.arange(0, PP)   # c as a one-row tile, as the norm kernel's rows
    x = _rms_normalize(tl.load(kv + b * s_kv + r, mask=r < R, other=0.).to(tl.float32), R, eps)
    y = x.to(kv.dtype.element_ty).to(tl.float32) * tl.load(weight + r, mask=r < R, other=0.).to(tl.float32)
    tl.store(c_cache + b * s_cb + pos * s_cl + r, y.to(c_cache.dtype.element_ty), mask=r < R)
    k_pe = tl.load(kv + b * s_kv + R + p, mask=p < P, other=0.)
    tl.store(kpe_cache + b * s_kb + pos * s_kl + p, k_pe.to(kpe_cache.dtype.element_ty), mask=p < P)


def mla_cache_append(kv, weight, eps, c_cache, kpe_cache, pos):
    """`model.ops.mla_cache_append` in one launch: kv [B, R+P], caches [B, L, R] / [B, L, P], pos a device
    scalar."""
    B, R, P = kv.shape[0], c_cache.shape[-1], kpe_cache.shape[-1]
    if kv.shape != (B, R + P) or weight.shape != (R,) or c_cache.shape[0] != B or kpe_cache.shape[:2] != c_cache.shape[:2]:
        raise ValueError(f"mla_cache_append: kv {tuple(kv.shape)}, weight {tuple(weight.shape)} and caches "
                         f"{tuple(c_cache.shape)} / {tuple(kpe_cache.shape)} do not fit")
    assert kv.stride(-1) == 1 and c_cache.stride(-1) == 1 and kpe_cache.stride(-1) == 1
    mt.require_runnable(_mla_cache_append_kernel, kv.device)
    _mla_cache_append_kernel[(B,)](kv, weight, c_cache, kpe_cache, pos, float(eps), kv.stride(0), c_cache.stride(0),
                                   c_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1), R=R, P=P,
                                   RP=triton.next_power_of_2(R), PP=triton.next_power_of_2(P), num_warps=4)


@triton.jit
def _mla_absorb_kernel(x, w, out, B, s_xb, s_xh, s_wh, s_wk, s_wn,
                       K: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                       BF16: tl.constexpr, MMA: tl.constexpr):
    """out[:, h, n-block] = x[:, h, :] @ w[h, :, n-block] in fp32, every sequence of the batch at once."""
    i_h, i_n = tl.program_id(0), tl.program_id(1)
    b, n = tl.arange(0, BP), i_n * BN + tl.arange(0, BN)
    y = tl.zeros([BP, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xb = tl.load(x + b[:, None] * s_xb + i_h * s_xh + k[None, :], mask=(b < B)[:, None] & (k < K)[None, :],
                     other=0.)      # in its own dtype: the bf16 model's q_nope takes one dot (`_dot_f32`)
        wb = tl.load(w + i_h * s_wh + k[:, None] * s_wk + n[None, :] * s_wn,
                     mask=(k < K)[:, None] & (n < N)[None, :], other=0.)
        y = _dot_f32(xb, wb, y, BF16, MMA)
    H = tl.num_programs(0)
    tl.store(out + (b[:, None] * H + i_h) * N + n[None, :], y, mask=(b < B)[:, None] & (n < N)[None, :])


# Tiles of w per program and step, by the reduced dim K. Graph-timed per layer on the H200 (`bench_kernels
# --ops mla_absorb`, batch 1, 32 heads): q_nope @ W_uk (K=128, N=512) 2.88 us at ABSORB's `2241bcba`, no other
# config faster; o_lat @ W_uv^T (K=512, N=128) 5.01 us at ABSORB_LONG_K's `076a968f`, 6.11 us at ABSORB's
# `8f09bfdf`.
ABSORB = dict(BN=64, BK=64, num_warps=4)
ABSORB_LONG_K = dict(BN=32, BK=128, num_warps=2)  # K >= 256


def absorb_config(K: int) -> dict:
    return ABSORB_LONG_K if K >= 256 else ABSORB


def mla_absorb(x, w, cfg: dict | None = None):
    """out[b,h,n] = sum_k x[b,h,k] w[h,k,n] in fp32, fp32-accurate for fp32 x (x [B,H,K] any float dtype,
    w [H,K,N] bf16 or fp32, any strides): the absorbed key/value up-projections of MLA decode. `cfg`
    overrides the default tiles (ABSORB, ABSORB_LONG_K; the benchmark's sweep)."""
    B, H, K = x.shape
    N = w.shape[2]
    assert x.stride(-1) == 1 and w.shape[:2] == (H, K)
    mt.require_runnable(_mla_absorb_kernel, x.device)
    c = mt.launch_config("mla_absorb", absorb_config(K), cfg)
    out = mt.empty(B, H, N, dtype=torch.float32, device=x.device)
    BN = min(_pad(N), c["BN"])
    _mla_absorb_kernel[(H, triton.cdiv(N, BN))](x, w, out, B, x.stride(0), x.stride(1), *w.stride(), K=K, N=N,
                                              BP=_pad(B), BK=min(_pad(K), c["BK"]), BN=BN,
                                              BF16=w.dtype == torch.bfloat16, MMA=mt.compiled(_mla_absorb_kernel),
                                              num_warps=c["num_warps"])
    return out

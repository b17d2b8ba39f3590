"""MLA decode over the latent cache ("flash-decoding"), and the absorbed up-projections around it: the fast twins
of `model.ops.mla_decode_attention_torch` and of the torch form in `model.ops.mla_absorb`. Forward only, fp32 math.

`mla_decode`: one query per head against cache positions 0..pos (a device scalar), one program per (head group,
sequence, split of positions), a combine kernel merging the splits; splits past pos return at once, so a grid sized
by the buffer (CUDA-graph safe) costs what pos needs. A bf16 cache meets each fp32 operand as a bf16 head and tail:
two exact-product MMAs give fp32-accurate sums. Tiles, layouts and measurements: docs/kernels.md#mla-decode.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.common import rms_normalize

# The split kernel's cache positions per loop step and warps: no spills in the sm_90 build at 32 heads x 512, the
# cache loads pipelined three stages deep (docs/kernels.md#mla-decode-tiles).
_BL = 64
_WARPS = 8
# Short buffers: `heads` heads a program and steps of `BL` positions, where the standard layout's shortest splits
# with the heads grouped fit on the SMs (docs/kernels.md#mla-decode-short-layout). heads None: the standard layout
# always.
SHORT = mt.LaunchConfig("mla_decode.SHORT", heads=16, BL=32)
# An fp32 cache's IEEE dots of fp32 tiles: at 64 positions they would need 377 KB of shared memory (sm_90: 227 KB)
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
    """acc + a @ b for fp32 or bf16 `a`, to fp32 accuracy: with bf16 `b`, an fp32 `a` as its bf16 head and tail in
    two exact-product dots, a bf16 `a` in one; with fp32 `b`, one IEEE dot."""
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
    """One (head group, sequence, split): heads [i_g * HG, (i_g + 1) * HG), positions [i_s * SPLIT, min((i_s + 1) *
    SPLIT, pos + 1)). Head groups vary fastest, so a split's groups share its cache rows through L2."""
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
    # a constant trip count (the interpreter takes no bound from pos): blocks past `end` are masked, costing no traffic
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
    """[K, N] fp32 -> [K, 2N] bf16: columns 2j and 2j+1 are x[:, j]'s bf16 head and tail (x = hi + lo + O(2^-17 |x|)),
    so one product gives both halves of an fp32-accurate one."""
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

    On sm_90 a product of 64 rows or more is a warpgroup MMA reading its operands from shared memory; the heads as
    rows (32) give mma.sync, whose operands every warp reloads for every tile. Same workspace and combine."""
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
    """out[b, h, r-block] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s over the splits that ran, merged SB at a
    time as one [SB, BR] tile in a fixed order: at 128k context ~130 dependent scalar loads would each wait."""
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


# At least two loop steps per split: with one, ptxas builds a variant without the loop that spills ~9 KB a thread
# (docs/kernels.md#mla-decode-tiles); from two up no spills, which tests/test_triton_kda.py holds.
MIN_SPLIT = 2 * _BL


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def default_split(L: int, B: int, device: torch.device) -> int:
    """Positions per split of the standard layout: about a program per SM over the whole buffer, a multiple of _BL,
    at least MIN_SPLIT."""
    return max(MIN_SPLIT, _BL * triton.cdiv(triton.cdiv(L, max(1, _sms(device) // B)), _BL))


def default_layout(L: int, B: int, H: int, device: torch.device) -> tuple[int, int]:
    """(positions per split, heads per program) for a buffer of L positions: the standard layout, or SHORT's where its
    shortest splits with the heads grouped fit on the SMs at once (splits of at least two of SHORT's BL)."""
    sms = _sms(device)
    short = mt.launch_config("mla_decode.SHORT", SHORT, None)
    if short["heads"] is not None and short["heads"] < H:
        groups = triton.cdiv(H, short["heads"])
        if B * groups * triton.cdiv(L, MIN_SPLIT) <= sms:
            bl = short["BL"]
            return max(2 * bl, bl * triton.cdiv(triton.cdiv(L, max(1, sms // (B * groups))), bl)), short["heads"]
    return default_split(L, B, device), H


# The split kernel of a bf16 cache at steps of _BL: "heads" or "positions" (the products' rows) over
# `positions_warps` warps; else "heads". "positions" on 4 warps: faster on the H200 at 32k and 128k, the same Gate
# B tokens (docs/kernels.md#mla-decode-rows).
CONFIG = mt.LaunchConfig("mla_decode.CONFIG", rows="positions", positions_warps=4)
ROWS = ("heads", "positions")
_POSITIONS_STAGES = 2  # three stages would need 303 KB of shared memory


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
    short = mt.launch_config("mla_decode.SHORT", SHORT, None)
    unit = short["BL"] if heads < H and short["heads"] is not None else _BL   # positions per loop step (bf16)
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
    """Latent attention output [B,H,R] fp32 of q_lat [B,H,R] fp32 and q_pe [B,H,P] over c [B,L,R] and k_pe [B,L,P]
    (bf16 or fp32, one dtype), positions 0..pos (a device scalar). `split` and `heads` (positions and heads per
    program) default to `default_layout`; `plan` checks them. `cfg` overrides CONFIG's keys."""
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
    """Sequence b: c_cache[b, pos] = rmsnorm(kv[b, :R]) in HF's order (fp32 normalise, round to kv's dtype, times
    weight), kpe_cache[b, pos] = kv[b, R:]."""
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr).to(tl.int64)
    r, p = tl.arange(0, RP)[None, :], tl.arange(0, PP)   # c as a one-row tile, as the norm kernel's rows
    x = rms_normalize(tl.load(kv + b * s_kv + r, mask=r < R, other=0.).to(tl.float32), R, eps)
    y = x.to(kv.dtype.element_ty).to(tl.float32) * tl.load(weight + r, mask=r < R, other=0.).to(tl.float32)
    tl.store(c_cache + b * s_cb + pos * s_cl + r, y.to(c_cache.dtype.element_ty), mask=r < R)
    k_pe = tl.load(kv + b * s_kv + R + p, mask=p < P, other=0.)
    tl.store(kpe_cache + b * s_kb + pos * s_kl + p, k_pe.to(kpe_cache.dtype.element_ty), mask=p < P)


def mla_cache_append(kv, weight, eps, c_cache, kpe_cache, pos):
    """`model.ops.mla_cache_append` in one launch: kv [B, R+P], caches [B, L, R] / [B, L, P]."""
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


# Tiles of w per program and step, by the reduced dim K: the fastest graph-timed at batch 1 on the H200 for
# q_nope @ W_uk (K=128) and o_lat @ W_uv^T (K=512) (docs/kernels.md#mla-absorb-tiles).
ABSORB = mt.LaunchConfig("mla_decode.ABSORB", BN=64, BK=64, num_warps=4)
ABSORB_LONG_K = mt.LaunchConfig("mla_decode.ABSORB_LONG_K", BN=32, BK=128, num_warps=2)  # K >= 256


def absorb_config(K: int) -> mt.LaunchConfig:
    return ABSORB_LONG_K if K >= 256 else ABSORB


def mla_absorb(x, w, cfg: dict | None = None):
    """out[b,h,n] = sum_k x[b,h,k] w[h,k,n] in fp32, fp32-accurate for fp32 x (x [B,H,K], w [H,K,N] bf16 or fp32):
    the absorbed key/value up-projections of MLA decode. `cfg` overrides the default tiles."""
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


mt.seal(__name__)

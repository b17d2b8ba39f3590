"""Causal depthwise conv1d + SiLU over a span of tokens (prefill / recompute): the twin of
`model.kda.causal_conv1d`.

torch runs this conv as a generic depthwise 2-d conv on the transposed [B, C, T] input, about 1 ms for
[8192, 12288] bf16 on an H200; here each program reads a [BT, BC] tile of the [B, T, C] input per tap
(the row shifts hit the cache), about the cost of one read and one write of the input.

Rounding matches the torch form on CUDA bit for bit: taps to x's dtype, inputs to the weight dtype,
an fp32 sum over the taps in order (starting from 0, as torch's depthwise kernel does), rounded to the
weight dtype; SiLU as torch computes it, y / (1 + exp(-y)) in fp32 with an IEEE exp and division,
rounded to the weight dtype, then to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.act import _silu_f32
from model.kda import carried_taps

# Launch config: rows (tokens) and channels per program, warps; `bench_kernels --conv-sweep` times the tiles of
# CONV_SWEEP. Picked from the sweep in record 3af1c7b0 (then kept in that record's results.sweep): at 8192 tokens of
# 12288 channels, 16 x 128 on 4 warps took 0.2125 ms against 0.2230 for the 32 x 128 used before, 32 x 64 0.2130,
# the rest 0.227 to 0.359, every tile with torch's bits.
CONFIG = dict(BT=16, BC=128, num_warps=4)


@triton.jit
def _causal_conv1d_kernel(x, taps, w, y, T, C, stride_xb, stride_xt,
                          W: tl.constexpr, HAS_TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          LIBDEVICE: tl.constexpr):
    """Grid (cdiv(T, BT), cdiv(C, BC), B). x rows [B, T] of C channels (row strides given, channels
    contiguous); taps [B, W-1, C] contiguous; w [C, W] contiguous; y [B, T, C] contiguous.
    LIBDEVICE: CUDA's IEEE expf (tl.exp is a faster approximation); the CPU interpreter has no libdevice."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, BT)
    t = i_t * BT + r
    c = i_c * BC + tl.arange(0, BC)
    m_c = c < C
    xdt = x.dtype.element_ty
    wdt = w.dtype.element_ty
    # 64-bit scalar bases, 32-bit offsets within the tile (keeps the per-element address math in registers)
    x_tile = x + i_b.to(tl.int64) * stride_xb + (i_t * BT).to(tl.int64) * stride_xt
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t + (j - (W - 1))                   # input row of tap j for output row t; < 0: a carried tap
        m = (src >= 0)[:, None] & (t < T)[:, None] & m_c[None, :]
        b_x = tl.load(x_tile + (r + (j - (W - 1)))[:, None] * stride_xt + c[None, :], mask=m, other=0.)
        if HAS_TAPS:
            m_old = ((src < 0) & (t < T))[:, None] & m_c[None, :]
            old = tl.load(taps + i_b.to(tl.int64) * (W - 1) * C + (src + (W - 1))[:, None] * C + c[None, :], mask=m_old, other=0.)
            b_x = tl.where(m_old, old.to(xdt), b_x)
        b_w = tl.load(w + c * W + j, mask=m_c, other=0.)
        acc += b_x.to(wdt).to(tl.float32) * b_w.to(tl.float32)[None, :]
    b_y = acc.to(wdt).to(tl.float32)
    b_y = _silu_f32(b_y, LIBDEVICE).to(wdt).to(xdt)
    y_tile = y + (i_b.to(tl.int64) * T + i_t * BT) * C
    tl.store(y_tile + r[:, None] * C + c[None, :], b_y, mask=(t < T)[:, None] & m_c[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor | None = None, cfg: dict | None = None):
    """Same contract as `model.kda.causal_conv1d`: x [B, T, C] (any row strides, channels contiguous),
    weight [C, W], taps [B, W-1, C] or None (zeros). Returns (y [B, T, C] in x's dtype, new taps).
    `cfg` overrides keys of CONFIG (for the benchmark's sweep)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, W) or (taps is not None and taps.shape != (B, W - 1, C)):
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)} and taps "
                         f"{None if taps is None else tuple(taps.shape)} do not fit ([B,T,C], [C,W], [B,W-1,C])")
    mt.require_runnable(_causal_conv1d_kernel, x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    taps = None if taps is None else taps.contiguous()
    c = mt.launch_config("causal_conv1d", CONFIG, cfg)
    y = mt.empty(B, T, C, dtype=x.dtype, device=x.device)
    if B * T * C:
        BT, BC = c["BT"], c["BC"]
        _causal_conv1d_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](
            x, taps, weight, y, T, C, x.stride(0), x.stride(1), W=W, HAS_TAPS=taps is not None, BT=BT, BC=BC,
            LIBDEVICE=x.is_cuda, num_warps=c["num_warps"])
    return y, carried_taps(x, taps, W)  # the last W-1 inputs, carried to the next call: tiny, so torch

"""Causal depthwise conv1d + SiLU over a span of tokens (prefill / recompute): the twin of `model.kda.causal_conv1d`.

Each program slides a window of the last W-1 inputs down BT rows of BC channels, reading x (BT + W-1) / BT times
instead of W (docs/kernels.md#conv). Bit for bit torch's on CUDA: inputs rounded to the weight dtype, an fp32 sum
over the taps in order rounded to it, then SiLU as torch computes it, rounded to it and then to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.common import silu_f32
from model.kda import carried_taps

# Launch config: rows and channels per program, rows per loop step (BT a multiple of it), warps: the fastest tile at
# 8192 x 12288 bf16 on the H200 (docs/kernels.md#conv).
CONFIG = mt.LaunchConfig("conv.CONFIG", BT=32, BC=512, STEP=4, num_warps=4)


@triton.jit
def _causal_conv1d_kernel(x, taps, w, y, T, C, stride_xb, stride_xt,
                          W: tl.constexpr, HAS_TAPS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          STEP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Grid (cdiv(T, BT), cdiv(C, BC), B). x rows [B, T] of C channels (row strides given, channels contiguous);
    taps [B, W-1, C], w [C, W], y [B, T, C] contiguous. LIBDEVICE: CUDA's IEEE expf (`common.silu_f32`)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = i_t * BT
    c = i_c * BC + tl.arange(0, BC)
    m_c = c < C
    xdt = x.dtype.element_ty
    wdt = w.dtype.element_ty
    # 64-bit scalar row bases, 32-bit channel offsets (keeps the per-element address math in registers)
    x_row = x + i_b.to(tl.int64) * stride_xb + t0.to(tl.int64) * stride_xt + c   # row t0
    y_row = y + (i_b.to(tl.int64) * T + t0) * C + c
    ws = ()  # the W weights of the strip's channels, tap 0 (the oldest input) first
    for j in tl.static_range(W):
        ws = ws + (tl.load(w + c * W + j, mask=m_c, other=0.).to(tl.float32),)
    # the window: inputs of rows t0-(W-1) .. t0-1, oldest first, each rounded to x's dtype then to w's; a row < 0 is
    # a carried tap (zeros without taps)
    win = ()
    for k in tl.static_range(W - 1):
        src = t0 + (k - (W - 1))
        b_x = tl.load(x_row + (k - (W - 1)) * stride_xt, mask=m_c & (src >= 0), other=0.)
        if HAS_TAPS:
            m_old = m_c & (src < 0)
            old = tl.load(taps + i_b.to(tl.int64) * (W - 1) * C + (src + (W - 1)) * C + c, mask=m_old, other=0.)
            b_x = tl.where(m_old, old.to(xdt), b_x)
        win = win + (b_x.to(wdt).to(tl.float32),)
    # rows STEP at a time, each step's loads issued a step ahead (y may alias x as far as the compiler knows, so a load
    # written after a store stays after it). A row past the program's last loads the last again: in bounds, unstored.
    n = tl.minimum(BT, T - t0)                  # rows the program stores
    xs = ()
    for u in tl.static_range(STEP):
        xs = xs + (tl.load(x_row + tl.minimum(u, n - 1) * stride_xt, mask=m_c, other=0.),)
    for g in range(0, BT, STEP):
        rows = xs
        xs = ()
        for u in tl.static_range(STEP):
            xs = xs + (tl.load(x_row + tl.minimum(g + STEP + u, n - 1) * stride_xt, mask=m_c, other=0.),)
        for u in tl.static_range(STEP):
            cur = rows[u].to(wdt).to(tl.float32)
            acc = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(W - 1):
                acc += win[j] * ws[j]
            acc += cur * ws[W - 1]
            b_y = silu_f32(acc.to(wdt).to(tl.float32), LIBDEVICE).to(wdt).to(xdt)
            tl.store(y_row + (g + u) * C, b_y, mask=m_c & (g + u < n))
            if W > 1:
                win = win[1:] + (cur,)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor | None = None, cfg: dict | None = None):
    """`model.kda.causal_conv1d`'s contract: x [B, T, C] (channels contiguous), weight [C, W], taps [B, W-1, C] or
    None (zeros) -> (y [B, T, C] in x's dtype, new taps). `cfg` overrides keys of CONFIG."""
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
    if c["BT"] % c["STEP"]:
        raise ValueError(f"causal_conv1d: BT={c['BT']} is no multiple of STEP={c['STEP']}")
    y = mt.empty(B, T, C, dtype=x.dtype, device=x.device)
    if B * T * C:
        BT, BC = c["BT"], c["BC"]
        _causal_conv1d_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](
            x, taps, weight, y, T, C, x.stride(0), x.stride(1), W=W, HAS_TAPS=taps is not None, BT=BT, BC=BC,
            STEP=c["STEP"], LIBDEVICE=x.is_cuda, num_warps=c["num_warps"])
    return y, carried_taps(x, taps, W)  # the last W-1 inputs, carried to the next call: tiny, so torch


mt.seal(__name__)

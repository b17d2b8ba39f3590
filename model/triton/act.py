"""SwiGLU's activation, h = silu(gate) * up, in one pass: the twin of `F.silu(g) * u` (`model.ops.silu_mul`).

torch runs it as two kernels over the GEMM output (a silu, then a mul; both strided when gate and up are the
two halves of one [N, 2I] tensor) and writes silu(g) to memory in between. Here gate and up are read once,
each through its own row stride, and h is written once.

Rounding matches torch on CUDA: silu in fp32 from the input, as torch computes it, g / (1 + exp(-g)) with an
IEEE exp and division, rounded to the input dtype; then the product in fp32, rounded to the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

import model.triton as mt

_BLOCK = 4096  # elements per program: rows x columns, columns a power of two up to 1024


@triton.jit
def _silu_mul_kernel(g, u, h, N, I, stride_g, stride_u,
                     ROWS: tl.constexpr, BI: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Grid (cdiv(N, ROWS), cdiv(I, BI)). g, u: N rows of I (row strides given, columns contiguous);
    h [N, I] contiguous. LIBDEVICE: CUDA's IEEE expf (tl.exp is a faster approximation); the CPU
    interpreter has no libdevice."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dt = h.dtype.element_ty
    b_g = tl.load(g + r64 * stride_g + cols[None, :], mask=mask, other=0.).to(tl.float32)
    b_u = tl.load(u + r64 * stride_u + cols[None, :], mask=mask, other=0.).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-b_g)
    else:
        e = tl.exp(-b_g)
    s = tl.math.div_rn(b_g, 1.0 + e).to(dt).to(tl.float32)
    tl.store(h + r64 * I + cols[None, :], (s * b_u).to(dt), mask=mask)


def _rows(x: torch.Tensor, I: int) -> torch.Tensor:
    """x as rows of I with contiguous columns: a view when x's rows are evenly spaced (a column slice of a
    wider tensor is), else a copy."""
    x = x.reshape(-1, I)
    return x if x.stride(1) == 1 else x.contiguous()


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for g, u of one shape [..., I] and one float dtype, in that dtype. Either may be strided,
    e.g. the two column halves of one [N, 2I] gate|up projection."""
    if g.shape != u.shape:
        raise ValueError(f"silu_mul: gate {tuple(g.shape)} and up {tuple(u.shape)} must have one shape")
    if g.dtype != u.dtype or not g.is_floating_point():
        raise TypeError(f"silu_mul: gate and up must share one float dtype, got {g.dtype} and {u.dtype}")
    if g.device != u.device:
        raise ValueError(f"silu_mul: gate is on {g.device}, up on {u.device}")
    mt.require_runnable(_silu_mul_kernel, g.device)
    h = mt.empty(g.shape, dtype=g.dtype, device=g.device)
    I = g.shape[-1]
    if h.numel():
        g2, u2 = _rows(g, I), _rows(u, I)
        N = g2.shape[0]
        BI = min(1024, triton.next_power_of_2(I))
        rows = _BLOCK // BI
        _silu_mul_kernel[(triton.cdiv(N, rows), triton.cdiv(I, BI))](
            g2, u2, h, N, I, g2.stride(0), u2.stride(0), ROWS=rows, BI=BI, LIBDEVICE=g.is_cuda, num_warps=4)
    return h

"""Elementwise activations over projection outputs, each in one pass.

`silu_mul`: SwiGLU's activation, h = silu(gate) * up: the twin of `F.silu(g) * u` (`model.ops.silu_mul`).

torch runs it as two kernels over the GEMM output (a silu, then a mul; both strided when gate and up are the
two halves of one [N, 2I] tensor) and writes silu(g) to memory in between. Here gate and up are read once,
each through its own row stride, and h is written once.

Rounding matches torch on CUDA: silu in fp32 from the input, as torch computes it, g / (1 + exp(-g)) with an
IEEE exp and division, rounded to the input dtype; then the product in fp32, rounded to the input dtype.

`kda_gate`: KDA's log decay g = -exp(A_log[h]) * softplus(f + dt_bias) in fp32 (`model.kda.kda_gate`), for a
prefill span: torch runs it as an add, a softplus, an exp and a mul, each over [T, H*d] fp32 (the add and the
mul alone 0.26 ms a layer at 8k tokens, decomposition 83152036). Here f (bf16) is read once and g written once, with the decode kernel's softplus
(`kda_decode._softplus`), so prefill and decode compute the gate alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

import model.triton as mt
from model.triton.kda_decode import _softplus

_BLOCK = 4096  # elements per program: rows x columns, columns a power of two up to 1024


@triton.jit
def _silu_f32(y, LIBDEVICE: tl.constexpr):
    """silu(y) in fp32 as torch computes it: y / (1 + exp(-y)) with an IEEE exp and division. LIBDEVICE: CUDA's
    IEEE expf (tl.exp is a faster approximation); the CPU interpreter has no libdevice."""
    if LIBDEVICE:
        e = libdevice.exp(-y)
    else:
        e = tl.exp(-y)
    return tl.math.div_rn(y, 1.0 + e)


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
    s = _silu_f32(b_g, LIBDEVICE).to(dt).to(tl.float32)
    tl.store(h + r64 * I + cols[None, :], (s * b_u).to(dt), mask=mask)


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
        g2, u2 = mt.rows(g, I), mt.rows(u, I)
        N = g2.shape[0]
        BI = min(1024, triton.next_power_of_2(I))
        rows = _BLOCK // BI
        _silu_mul_kernel[(triton.cdiv(N, rows), triton.cdiv(I, BI))](
            g2, u2, h, N, I, g2.stride(0), u2.stride(0), ROWS=rows, BI=BI, LIBDEVICE=g.is_cuda, num_warps=4)
    return h


@triton.jit
def _kda_gate_kernel(f, A_log, dt_bias, g, N, C, stride_f, D: tl.constexpr, ROWS: tl.constexpr, BC: tl.constexpr):
    """Grid (cdiv(N, ROWS), cdiv(C, BC)): rows of C = H*D channels, f's rows stride_f apart, g [N, C] fp32."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(f + r64 * stride_f + cols[None, :], mask=mask, other=0.).to(tl.float32)
    x += tl.load(dt_bias + cols, mask=cols < C, other=0.).to(tl.float32)[None, :]
    a = -tl.exp(tl.load(A_log + cols // D, mask=cols < C, other=0.).to(tl.float32))
    tl.store(g + r64 * C + cols[None, :], a[None, :] * _softplus(x), mask=mask)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """f [..., H*head_dim] (any float dtype, rows may be strided), A_log with H values, dt_bias [H*head_dim] ->
    g [..., H, head_dim] fp32."""
    C = f.shape[-1]
    if C % head_dim or A_log.numel() * head_dim != C or dt_bias.numel() != C:
        raise ValueError(f"kda_gate: f {tuple(f.shape)}, A_log {tuple(A_log.shape)} and dt_bias "
                         f"{tuple(dt_bias.shape)} do not fit head_dim {head_dim}")
    mt.require_runnable(_kda_gate_kernel, f.device)
    g = mt.empty(*f.shape[:-1], C // head_dim, head_dim, dtype=torch.float32, device=f.device)
    if g.numel():
        f2 = mt.rows(f, C)
        N = f2.shape[0]
        BC = min(1024, triton.next_power_of_2(C))
        rows = _BLOCK // BC
        _kda_gate_kernel[(triton.cdiv(N, rows), triton.cdiv(C, BC))](
            f2, A_log.reshape(-1).contiguous(), dt_bias.contiguous(), g, N, C, f2.stride(0), D=head_dim, ROWS=rows,
            BC=BC, num_warps=4)
    return g

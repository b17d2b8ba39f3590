"""Elementwise activations over projection outputs, each in one pass.

`silu_mul`: SwiGLU's h = silu(gate) * up, the twin of `F.silu(g) * u` (`model.ops.silu_mul`): gate and up read
once through their row strides, h written once, rounded as torch rounds on CUDA.
`kda_gate`: KDA's log decay g = -exp(A_log[h]) * softplus(f + dt_bias) in fp32 (`model.kda.kda_gate`) over a
prefill span, with the decode kernel's softplus, so prefill and decode compute the gate alike
(docs/kernels.md#act-and-norms).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt
from model.triton.common import silu_f32, softplus

_BLOCK = 4096  # elements per program: rows x columns, columns a power of two up to 1024


@triton.jit
def _silu_mul_kernel(g, u, h, N, I, stride_g, stride_u,
                     ROWS: tl.constexpr, BI: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Grid (cdiv(N, ROWS), cdiv(I, BI)). g, u: N rows of I (row strides given, columns contiguous); h [N, I]
    contiguous. LIBDEVICE: CUDA's IEEE expf (`common.silu_f32`)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = (rows < N)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dt = h.dtype.element_ty
    b_g = tl.load(g + r64 * stride_g + cols[None, :], mask=mask, other=0.).to(tl.float32)
    b_u = tl.load(u + r64 * stride_u + cols[None, :], mask=mask, other=0.).to(tl.float32)
    s = silu_f32(b_g, LIBDEVICE).to(dt).to(tl.float32)
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
    tl.store(g + r64 * C + cols[None, :], a[None, :] * softplus(x), mask=mask)


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

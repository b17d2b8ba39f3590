"""RMSNorms in Triton, in HF transformers' math order (KimiLinearRMSNorm, KimiLinearRMSNormGated).

One kernel serves all three entry points: rows of the last dim, ROWS rows per program, fp32 math.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

import model.triton as mt
from model.triton.common import rms_normalize


@triton.jit
def _rmsnorm_kernel(x, res, gate, weight, y, res_out, N, stride_x, D: tl.constexpr, eps,
                    BD: tl.constexpr, ROWS: tl.constexpr, ADD_RES: tl.constexpr, GATED: tl.constexpr,
                    SIGNAL: tl.constexpr):
    """y = rmsnorm(x) over rows of D. Grid (cdiv(N, ROWS),); tile [ROWS, BD]; x's rows stride_x apart.

    ADD_RES: x <- x + res first, rounded to x's dtype and stored to res_out (the new residual).
    GATED:   y = x * rsqrt(mean(x^2) + eps) * weight * sigmoid(gate), all fp32, cast once (HF gated norm).
    else:    y = (x * rsqrt(mean(x^2) + eps)).to(x dtype) * weight, cast to y's dtype (HF RMSNorm).
    SIGNAL: lets a kernel launched after it with PDL start now (the decode MoE router, `model.triton.moe`).
    """
    if SIGNAL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b_x = tl.load(x + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.)
    if ADD_RES:
        b_x = (b_x.to(tl.float32) + tl.load(res + off, mask=mask, other=0.).to(tl.float32)).to(x.dtype.element_ty)
        tl.store(res_out + off, b_x, mask=mask)
    b_xf = rms_normalize(b_x.to(tl.float32), D, eps)
    b_w = tl.load(weight + cols, mask=cols < D, other=0.).to(tl.float32)
    if GATED:
        b_y = b_xf * b_w[None, :] * tl.sigmoid(tl.load(gate + off, mask=mask, other=0.).to(tl.float32))
    else:
        b_y = b_xf.to(x.dtype.element_ty).to(tl.float32) * b_w[None, :]
    tl.store(y + off, b_y.to(y.dtype.element_ty), mask=mask)


def _launch(x, weight, eps, *, res=None, gate=None, out_dtype, signal=True):
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rmsnorm: weight must be [{D}] (the last dim of x), got {tuple(weight.shape)}")
    for name, t in (("residual", res), ("gate", gate)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"rmsnorm: {name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    for t in (weight, res, gate):
        if t is not None and t.device != x.device:
            raise ValueError(f"rmsnorm: all tensors must be on {x.device}, one is on {t.device}")
    if not x.is_floating_point():
        raise TypeError(f"rmsnorm: x must be a float tensor, got {x.dtype}")
    mt.require_runnable(_rmsnorm_kernel, x.device)
    weight = weight.contiguous()
    res = None if res is None else res.contiguous()
    gate = None if gate is None else gate.contiguous()
    N = x.numel() // D if D else 0
    y = mt.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = None if res is None else mt.empty(x.shape, dtype=x.dtype, device=x.device)
    if N:
        x_rows = mt.rows(x, D)
        BD = triton.next_power_of_2(D)
        rows = max(1, min(16, 4096 // BD))  # about 4096 elements per program
        _rmsnorm_kernel[(triton.cdiv(N, rows),)](x_rows, res, gate, weight, y, res_out, N, x_rows.stride(0), D,
                                                 float(eps), BD=BD, ROWS=rows, ADD_RES=res is not None,
                                                 GATED=gate is not None,
                                                 SIGNAL=signal and mt.pdl_capable(_rmsnorm_kernel, x.device),
                                                 num_warps=4 if BD <= 1024 else 8)
    return y, res_out


def rmsnorm(x, weight, eps):
    """HF KimiLinearRMSNorm: fp32 x * rsqrt(mean(x^2) + eps), cast to x's dtype, times weight.

    Returns a tensor of dtype promote(x.dtype, weight.dtype), like `weight * x` in torch.
    """
    return _launch(x, weight, eps, out_dtype=torch.promote_types(x.dtype, weight.dtype))[0]


def gated_rmsnorm(o, gate, weight, eps):
    """HF KimiLinearRMSNormGated (the KDA output norm): rmsnorm(o) * weight * sigmoid(gate), fp32, in o's dtype."""
    return _launch(o, weight, eps, gate=gate, out_dtype=o.dtype)[0]


def add_rmsnorm(x, residual, weight, eps, signal: bool = True):
    """new_residual = x + residual (in x's dtype); returns (rmsnorm(new_residual, weight, eps), new_residual).
    `signal=False`: without SIGNAL (the benchmark's peer)."""
    if residual.dtype != x.dtype:
        raise TypeError(f"add_rmsnorm: residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    return _launch(x, weight, eps, res=residual, out_dtype=torch.promote_types(x.dtype, weight.dtype), signal=signal)

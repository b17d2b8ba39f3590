"""@triton.jit helpers that more than one kernel module calls: one definition each, so that prefill and decode
compute a gate, a SiLU or a norm alike."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rounded(x, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 x as dtype, rounded to nearest even: compiled, by the GPU's own conversion; interpreted, bf16 by hand,
    as Triton's interpreter truncates and the CPU tests should see the GPU's error, not a bias."""
    if dtype == tl.bfloat16 and not COMPILED:
        b = x.to(tl.uint32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def softplus(x):
    # torch's softplus (threshold 20); log1p(z) as log(1+z) * z / ((1+z) - 1) keeps tiny z exact. Both branches
    # are computed, so neither may divide 0/0 or inf/inf: exp of min(x, 20), and the divisor 1 where 1 + z == 1.
    z = tl.exp(tl.minimum(x, 20.))
    one_z = 1. + z
    small = one_z == 1.
    log1p = tl.where(small, z, tl.log(one_z) * z / tl.where(small, 1., one_z - 1.))
    return tl.where(x > 20., x, log1p)


@triton.jit
def silu_f32(y, LIBDEVICE: tl.constexpr):
    """silu(y) in fp32 as torch computes it: y / (1 + exp(-y)) with an IEEE division and, with LIBDEVICE (CUDA; the
    interpreter has none), CUDA's IEEE expf where tl.exp approximates."""
    if LIBDEVICE:
        e = libdevice.exp(-y)
    else:
        e = tl.exp(-y)
    return tl.math.div_rn(y, 1.0 + e)


@triton.jit
def rms_normalize(x, D: tl.constexpr, eps):
    """x * rsqrt(mean(x^2) + eps) over the rows of an fp32 tile [ROWS, BD] of D values each (padding lanes 0)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]

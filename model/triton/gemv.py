"""A dense linear for a few rows (decode's projections): y = x W^T, the twin of `F.linear` without bias.

At batch-1 decode a projection reads each weight once per token, so its time is the weight's bytes over the
bandwidth the kernel keeps busy. cuBLAS runs the model's o_proj ([2304, 4096] bf16, 18.9 MB) as a split-K GEMV
plus a reduce kernel (7.45 + 1.8 us a layer in decomposition ba047dfc: about 2.0 TB/s of 4.25). Here one
launch, no split: each program streams BLOCK_N whole weight rows in [BLOCK_N, BLOCK_K] steps (16-byte loads),
the steps unrolled so their loads can be in flight together, and sums in fp32 in a fixed order (the same bits
on every run). The rows x are read by every program, from L2.

Rounding: fp32 products of the stored values, fp32 sums, one rounding to x's dtype at the end, as F.linear
(cuBLAS) does; the two differ only in summation order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt

MAX_ROWS = 8  # rows of x per launch: past this a GEMM (F.linear) is the better tool
# Launch config: weight rows per program, columns per step, warps. BLOCK_K is capped at K's power of two.
GEMV = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4)


@triton.jit
def _gemv_kernel(x, w, y, M, N, K: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N),). x [M, K], w [N, K], y [M, N], all contiguous; BM = M padded to a power of two."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BM)
    mask_n = offs_n < N
    mask_m = offs_m < M
    rows = w + offs_n.to(tl.int64)[:, None] * K
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # K is a constexpr: unrolled, every step's loads issued early
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        b_w = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.).to(tl.float32)
        b_x = tl.load(x + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                      other=0.).to(tl.float32)
        acc += tl.sum(b_w[None, :, :] * b_x[:, None, :], axis=2)
    tl.store(y + offs_m[:, None] * N + offs_n[None, :], acc.to(y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows in all, weight [N, K] of x's dtype -> [..., N] in x's dtype.
    `cfg` overrides keys of GEMV (the benchmark's sweep)."""
    *lead, K = x.shape
    if weight.ndim != 2 or weight.shape[1] != K:
        raise ValueError(f"gemv: weight must be [N, {K}] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"gemv: weight dtype {weight.dtype} differs from x's {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"gemv: x is on {x.device}, weight on {weight.device}")
    M = x.numel() // K if K else 0
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv: x must have 1 to {MAX_ROWS} rows, got {M} (use F.linear)")
    mt.require_runnable(_gemv_kernel, x.device)
    N = weight.shape[0]
    c = mt.launch_config("gemv", GEMV, cfg)
    bn, bk = c["BLOCK_N"], min(c["BLOCK_K"], triton.next_power_of_2(K))
    y = mt.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn),)](x.reshape(M, K).contiguous(), weight.contiguous(), y, M, N, K,
                                        triton.next_power_of_2(M), bn, bk, num_warps=c["num_warps"])
    return y.view(*lead, N)

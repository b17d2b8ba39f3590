"""The dispatch step of the grouped-GEMM MoE (prefill), the twin of `model.ops.moe_dispatch_torch`: y[i] =
x[order[i] // K], every expert's rows contiguous for the grouped GEMM, a program copying BR whole rows in 16-byte
vectors (docs/kernels.md#moe-dispatch-and-moe-combine).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt

DISPATCH = mt.LaunchConfig("moe_dispatch.DISPATCH", BR=8, BD=256, num_warps=4)  # rows per program, columns per load


@triton.jit
def _moe_dispatch_kernel(x, order, y, M, K: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Grid (cdiv(M, BR),). x [N, D] contiguous; order [M] (M = N*K pairs, flat index n*K + k); y [M, D]."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    live = i < M
    src = (tl.load(order + i, mask=live, other=0) // K).to(tl.int64)
    dst = i.to(tl.int64)
    for d0 in tl.static_range(0, D, BD):
        c = d0 + tl.arange(0, BD)
        m = live[:, None] & (c < D)[None, :]
        tl.store(y + dst[:, None] * D + c[None, :], tl.load(x + src[:, None] * D + c[None, :], mask=m), mask=m)


def moe_dispatch(x: torch.Tensor, order: torch.Tensor, K: int) -> torch.Tensor:
    """x [N, D], order [N*K] (a permutation of the flat (token, slot) pairs) -> x[order // K], [N*K, D]."""
    if x.ndim != 2 or order.ndim != 1 or order.numel() != x.shape[0] * K:
        raise ValueError(f"moe_dispatch: x {tuple(x.shape)} and order {tuple(order.shape)} do not fit K={K}")
    mt.require_runnable(_moe_dispatch_kernel, x.device)
    x, order = x.contiguous(), order.contiguous()
    M, D = order.numel(), x.shape[1]
    y = mt.empty(M, D, dtype=x.dtype, device=x.device)
    if M * D:
        c = mt.launch_config("moe_dispatch", DISPATCH, None)
        BD = min(c["BD"], triton.next_power_of_2(D))
        _moe_dispatch_kernel[(triton.cdiv(M, c["BR"]),)](x, order, y, M, K=K, D=D, BR=c["BR"], BD=BD,
                                                          num_warps=c["num_warps"])
    return y


mt.seal(__name__)

"""The combine step of the grouped-GEMM MoE (prefill): the twin of `model.ops.moe_combine_torch`.

Each token gathers its K expert rows back from the expert-sorted output, weighs them and sums them in slot order in
fp32, adds the shared expert's output and rounds once: no atomics, so the bits do not depend on scheduling.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt


@triton.jit
def _moe_combine_kernel(out, slot, w, shared, y, D, K: tl.constexpr, HAS_SHARED: tl.constexpr, BD: tl.constexpr):
    """Grid (N, cdiv(D, BD)). out [N*K, D] (expert order); slot, w [N, K] contiguous; shared, y [N, D]."""
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    d = i_d * BD + tl.arange(0, BD)
    m = d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(slot + i_n * K + k).to(tl.int64)
        acc += tl.load(out + row * D + d, mask=m, other=0.).to(tl.float32) * tl.load(w + i_n * K + k)
    if HAS_SHARED:
        acc += tl.load(shared + i_n.to(tl.int64) * D + d, mask=m, other=0.).to(tl.float32)
    tl.store(y + i_n.to(tl.int64) * D + d, acc.to(y.dtype.element_ty), mask=m)


def moe_combine(out: torch.Tensor, slot: torch.Tensor, w: torch.Tensor, shared_out: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """y[n] = sum_k w[n,k] * out[slot[n,k]] (+ shared_out[n]), fp32, rounded once to `dtype`; [N, D]."""
    N, K = w.shape
    D = out.shape[-1]
    if out.shape != (N * K, D) or slot.shape != (N, K) or (shared_out is not None and shared_out.shape != (N, D)):
        raise ValueError(f"moe_combine: out {tuple(out.shape)}, slot {tuple(slot.shape)}, w {tuple(w.shape)}, "
                         f"shared {None if shared_out is None else tuple(shared_out.shape)} do not fit")
    mt.require_runnable(_moe_combine_kernel, out.device)
    out, slot, w = out.contiguous(), slot.contiguous(), w.float().contiguous()
    shared_out = None if shared_out is None else shared_out.contiguous()
    y = mt.empty(N, D, dtype=dtype, device=out.device)
    if N * D:
        BD = min(512, triton.next_power_of_2(D))
        _moe_combine_kernel[(N, triton.cdiv(D, BD))](out, slot, w, shared_out, y, D, K=K,
                                                     HAS_SHARED=shared_out is not None, BD=BD, num_warps=4)
    return y

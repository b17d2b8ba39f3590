"""One token's dense projection y = W x in Triton: a split-K GEMV for the decode step's narrow projections.

At batch 1 a projection is pure weight streaming. cuBLAS serves the wide ones well (KDA's packed 12576-row
in_proj, lm_head) but runs the 2304-row o_proj (4096 columns) as a split-K GEMM plus a separate reduction
kernel: 7.5 + 1.7 us a call inside the decode graph (decomposition record 7daff384), 2.0 TB/s for its 18.9 MB,
where the MoE gate_up kernel streams at 3.4 TB/s. Here:

  grid (O / BLOCK_O, S): program (o, s) streams rows o*BLOCK_O.. of W over the s-th of S column splits
  ([BLOCK_O, BLOCK_D] tiles, fp32 sums), stores its partial sums, and reports in on an arrival counter
  (`model.triton.arrival_counters`); the last of the S programs of a row block adds the S partials in split
  order and writes y rounded once to x's dtype, as F.linear rounds. Deterministic: no float atomics, the same
  summation order on every run; graph-safe: the counter is put back to 0 by the program that read it.

The reference is F.linear; `model.ops.linear` picks this for one token on CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt

# Launch default: 16 rows x 512 columns per step (16 KB) over 8 warps, as the MoE gate_up kernel that streams
# at ~3.4 TB/s inside the decode graph; 1024 columns per split, so o_proj (2304 x 4096) has 144 x 4 programs.
GEMV = dict(BLOCK_O=16, BLOCK_D=512, SPLIT=1024, num_warps=8)


@triton.jit
def _gemv_splitk_kernel(x_ptr, w_ptr, part_ptr, arrivals, y_ptr, O: tl.constexpr, D: tl.constexpr,
                        S: tl.constexpr, SPLIT: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_o = tl.program_id(0)
    s = tl.program_id(1)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < O
    rows = w_ptr + offs_o.to(tl.int64)[:, None] * D
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for d0 in range(0, SPLIT, BLOCK_D):
        offs_d = s * SPLIT + d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xv = tl.load(x_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        wv = tl.load(rows + offs_d[None, :], mask=mask_o[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * xv[None, :], axis=1)
    DT = y_ptr.dtype.element_ty
    if S == 1:
        tl.store(y_ptr + offs_o, acc.to(DT), mask=mask_o)
    else:
        tl.store(part_ptr + s * O + offs_o, acc, mask=mask_o)
        # Report in once every thread has stored its partials (acq_rel atomic); the row block's last program
        # reads the S partials (.cg: from L2, where the others' stores are) and finishes the rows.
        tl.debug_barrier()
        if tl.atomic_add(arrivals + pid_o, 1) == S - 1:
            total = tl.zeros([BLOCK_O], dtype=tl.float32)
            for j in range(S):
                total += tl.load(part_ptr + j * O + offs_o, mask=mask_o, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs_o, total.to(DT), mask=mask_o)
            tl.atomic_xchg(arrivals + pid_o, 0)


def gemv(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x [..., D] holding one token (numel D), weight [O, D] -> y [..., O] in x's dtype (fp32 sums, one rounding).
    `cfg` overrides `GEMV` (the benchmark's sweep)."""
    O, D = weight.shape
    if x.shape[-1] != D or x.numel() != D:
        raise ValueError(f"gemv: x {tuple(x.shape)} must hold one token of {D} features for weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"gemv: x is {x.dtype} on {x.device}, weight {weight.dtype} on {weight.device}")
    mt.require_runnable(_gemv_splitk_kernel, x.device)
    c = {**GEMV, **(cfg or {})}
    bd = min(c["BLOCK_D"], triton.next_power_of_2(D))
    split = triton.cdiv(min(c["SPLIT"], D), bd) * bd   # whole steps per split
    S = triton.cdiv(D, split)
    bo = min(c["BLOCK_O"], triton.next_power_of_2(O))
    n_o = triton.cdiv(O, bo)
    y = mt.empty(*x.shape[:-1], O, dtype=x.dtype, device=x.device)
    part = mt.empty(S, O, dtype=torch.float32, device=x.device)
    _gemv_splitk_kernel[(n_o, S)](x.contiguous(), weight if weight.is_contiguous() else weight.contiguous(), part,
                                  mt.arrival_counters(x.device, n_o), y, O, D, S, split, bo, bd,
                                  num_warps=c["num_warps"])
    return y

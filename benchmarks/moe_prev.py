"""The MoE expert kernels as they were before the decode rework (main at a526784), frozen: the same-run peer
of `benchmarks.bench_kernels --ops moe_decode`. Not used by the model; delete once the new kernels' records
stand on their own.

Tiles: gate_up [16 rows, 512 columns] per step (the 5th step over D=2304 half masked); down one slot at a
time, [8 rows, all 1024 of I] per step, grid (N, D / 8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prev_gate_up_kernel(x_ptr, idx_ptr, w_ptr, sg_ptr, su_ptr, act_ptr, D: tl.constexpr, I: tl.constexpr,
                    K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """Slot k < K of token n reads expert idx[n, k]; slot K (when SLOTS = K + 1) the shared expert."""
    pid = tl.program_id(0)
    pid_i = tl.program_id(1)
    n = pid // SLOTS
    k = pid % SLOTS
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    if k < K:
        e = tl.load(idx_ptr + n * K + k).to(tl.int64)
        w_gate = w_ptr + e * (2 * I * D) + offs_i[:, None] * D
        w_up = w_gate + I * D
    else:
        w_gate = sg_ptr + offs_i[:, None] * D
        w_up = su_ptr + offs_i[:, None] * D
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xv = tl.load(x_ptr + n * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        m = mask_i[:, None] & mask_d[None, :]
        wg = tl.load(w_gate + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w_up + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    # Round where the prefill path (F.linear, F.silu, mul on model-dtype tensors) rounds, so decode and
    # prefill differ only by fp32 summation order, not by where bf16 rounding happens.
    DT = act_ptr.dtype.element_ty
    g = acc_g.to(DT).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(DT).to(tl.float32)
    h = s * acc_u.to(DT).to(tl.float32)
    tl.store(act_ptr + pid * I + offs_i, h.to(DT), mask=mask_i)


@triton.jit
def _prev_down_kernel(act_ptr, idx_ptr, wt_ptr, w_ptr, sd_ptr, y_ptr, D: tl.constexpr, I: tl.constexpr,
                 K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr):
    n = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(SLOTS):
        if k < K:
            e = tl.load(idx_ptr + n * K + k).to(tl.int64)
            wk = tl.load(wt_ptr + n * K + k).to(tl.float32)
            base = w_ptr + e * (D * I)
        else:  # the shared expert, weight 1
            wk = 1.0
            base = sd_ptr
        part = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            offs_i = i0 + tl.arange(0, BLOCK_I)
            mask_i = offs_i < I
            a = tl.load(act_ptr + (n * SLOTS + k) * I + offs_i, mask=mask_i, other=0.0).to(tl.float32)
            wd = tl.load(base + offs_d[:, None] * I + offs_i[None, :],
                         mask=mask_d[:, None] & mask_i[None, :], other=0.0).to(tl.float32)
            part += tl.sum(wd * a[None, :], axis=1)
        acc += wk * part.to(y_ptr.dtype.element_ty).to(tl.float32)  # each expert's output is rounded, as F.linear's
    tl.store(y_ptr + n * D + offs_d, acc.to(y_ptr.dtype.element_ty), mask=mask_d)


def prev_gate_up(x, idx, gate_up, shared_gate_up):
    N, D = x.shape
    K, I = idx.shape[1], gate_up.shape[1] // 2
    sg, su = shared_gate_up
    act = torch.empty(N * (K + 1), I, dtype=x.dtype, device=x.device)
    BLOCK_I, BLOCK_D = min(16, triton.next_power_of_2(I)), min(512, triton.next_power_of_2(D))
    _prev_gate_up_kernel[(N * (K + 1), triton.cdiv(I, BLOCK_I))](x, idx, gate_up, sg, su, act, D, I, K, K + 1,
                                                                BLOCK_I, BLOCK_D)
    return act


def prev_down(act, idx, w, down, shared_down):
    N, K = idx.shape
    D, I = down.shape[1], down.shape[2]
    y = torch.empty(N, D, dtype=act.dtype, device=act.device)
    BLOCK_D, BLOCK_I = min(8, triton.next_power_of_2(D)), min(1024, triton.next_power_of_2(I))
    _prev_down_kernel[(N, triton.cdiv(D, BLOCK_D))](act, idx, w, down, shared_down, y, D, I, K, K + 1, BLOCK_D, BLOCK_I)
    return y

"""Small-batch MoE in Triton: routing and expert GEMVs that read only the chosen experts' weights.

Decode runs one (or a few) tokens, so each expert matrix is read once per token: the work is pure weight
streaming. Two launches, both with routing kept on the device (no host sync, graph-capturable):

  gate_up:  act[n, k, i] = silu(w1[e] x_n)[i] * (w3[e] x_n)[i]          e = idx[n, k]
            grid (N*(K+1), I / BLOCK_I); each program streams a [BLOCK_I, D] slice of w1 and of w3.
  down:     y[n, d]     = sum_k w[n, k] * (w2[e] act[n, k])[d]  + shared expert (weight 1)
            grid (N, D / BLOCK_D); each program streams [BLOCK_D, I] slices of the K chosen w2's.
The shared expert rides along as slot K, so the whole MoE FFN of a decode step is these two launches.

`route` is the sigmoid router after its fp32 GEMV: bias-corrected top-k, renormalised unbiased weights,
scaled; one program per token (E <= 1024 lives in registers). The references are
`model.ops.moe_experts_torch` and `model.layers.Router`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_expert_gate_up_kernel(x_ptr, idx_ptr, w_ptr, sg_ptr, su_ptr, act_ptr, D: tl.constexpr, I: tl.constexpr,
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
def _moe_expert_down_kernel(act_ptr, idx_ptr, wt_ptr, w_ptr, sd_ptr, y_ptr, D: tl.constexpr, I: tl.constexpr,
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


def fused_moe_small_batch(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                          ) -> torch.Tensor:
    """x [N, D]; idx [N, K] expert ids; w [N, K] fp32 weights; gate_up [E, 2I, D]; down [E, D, I] -> y [N, D].

    `shared` = (gate [I, D], up [I, D], down [D, I]) adds the shared expert (weight 1) in the same launches.
    """
    N, D = x.shape
    K = idx.shape[1]
    E, twoI, D2 = gate_up.shape
    I = twoI // 2
    if D2 != D or down.shape != (E, D, I):
        raise ValueError(f"expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit x {tuple(x.shape)}")
    if shared is not None and (shared[0].shape != (I, D) or shared[1].shape != (I, D) or shared[2].shape != (D, I)):
        raise ValueError(f"shared expert shapes {[tuple(t.shape) for t in shared]} do not fit [{I}, {D}] / [{D}, {I}]")
    x, idx, w = x.contiguous(), idx.contiguous(), w.float().contiguous()
    sg, su, sd = (t.contiguous() for t in shared) if shared is not None else (gate_up, gate_up, down)
    slots = K + (shared is not None)
    act = torch.empty(N * slots, I, dtype=x.dtype, device=x.device)
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    # Pure weight streaming: tiles of 16 rows x 512 columns (gate_up) and 8 rows x all of I (down) keep
    # ~600 / ~300 programs at batch 1 with 16 KB loads each, enough bytes in flight to feed HBM.
    BLOCK_I, BLOCK_D = min(16, triton.next_power_of_2(I)), min(512, triton.next_power_of_2(D))
    _moe_expert_gate_up_kernel[(N * slots, triton.cdiv(I, BLOCK_I))](x, idx, gate_up, sg, su, act, D, I, K, slots,
                                                          BLOCK_I, BLOCK_D)
    BLOCK_D2, BLOCK_I2 = min(8, triton.next_power_of_2(D)), min(1024, triton.next_power_of_2(I))
    _moe_expert_down_kernel[(N, triton.cdiv(D, BLOCK_D2))](act, idx, w, down, sd, y, D, I, K, slots, BLOCK_D2, BLOCK_I2)
    return y


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                  scaling, RENORM: tl.constexpr):
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    s = tl.sigmoid(tl.load(logits_ptr + n * E + offs, mask=mask, other=0.0).to(tl.float32))
    choice = tl.where(mask, s + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32), float("-inf"))
    offs_k = tl.arange(0, K)
    chosen_w = tl.zeros([K], dtype=tl.float32)
    chosen_i = tl.zeros([K], dtype=tl.int32)
    for k in range(K):
        best = tl.max(choice, axis=0)
        # lowest index among equal scores, so the choice is deterministic
        i = tl.min(tl.where(choice == best, offs, BLOCK_E), axis=0)
        chosen_i = tl.where(offs_k == k, i, chosen_i)
        chosen_w = tl.where(offs_k == k, tl.sum(tl.where(offs == i, s, 0.0), axis=0), chosen_w)
        choice = tl.where(offs == i, float("-inf"), choice)
    if RENORM:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    tl.store(idx_ptr + n * K + offs_k, chosen_i.to(idx_ptr.dtype.element_ty))
    tl.store(w_ptr + n * K + offs_k, chosen_w * scaling)


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float, renorm: bool):
    """logits [N, E] fp32 router GEMV output -> (idx [N, k] int64, weights [N, k] fp32)."""
    N, E = logits.shape
    if k & (k - 1):
        raise ValueError(f"top-k {k} must be a power of two for the Triton router")
    idx = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(N, k, dtype=torch.float32, device=logits.device)
    _moe_route_kernel[(N,)](logits.contiguous(), bias.float().contiguous(), idx, w, E, k,
                        triton.next_power_of_2(E), float(scaling), bool(renorm))
    return idx, w

"""Small-batch (decode) MoE in Triton, the twin of `model.ops.moe_router` and `model.ops.moe_experts_torch`: weight
streaming that reads only the chosen experts. Three launches a layer, routing kept on the device:

  router:   logits[n, e] = x_n . Wr[e] (fp32); the token's last program to finish picks its top-k experts
  gate_up:  act[n, k, i] = silu(w1[e] x_n)[i] * (w3[e] x_n)[i]          e = idx[n, k]; slot K the shared expert
  down:     y[n, d]     = sum_k w[n, k] * (w2[e] act[n, k])[d]  + shared expert, summed in a fixed order
With PDL (programmatic dependent launch) each launch streams its weights before it waits for the kernel before it:
the same bits either way. Launch defaults and PDL's order: docs/kernels.md#moe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import model.triton as mt
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Launch defaults for batch-1 decode of the 48B model: the fastest in a CUDA graph over 32 layers' weights, cold from
# HBM (docs/kernels.md#moe-launch-config). No tl.dot, so the bytes in flight are a step's tile times programs per SM.
GATE_UP = mt.LaunchConfig("moe.GATE_UP", BLOCK_I=16, BLOCK_D=256, num_warps=8)
DOWN = mt.LaunchConfig("moe.DOWN", BLOCK_D=1, BLOCK_I=1024, num_warps=4)
ROUTER = mt.LaunchConfig("moe.ROUTER", BLOCK_E=1, num_warps=4)
ROUTER_LOGITS = 1 << 16  # the router's logits buffer (see fused_router): tokens x experts


@triton.jit
def _gate_up_rows(x_row, w_gate, w_up, mask_i, D: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """(w1 x, w3 x) in fp32 for BLOCK_I rows (w_gate, w_up: [BLOCK_I, 1] row pointers, any float dtype)."""
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xv = tl.load(x_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        m = mask_i[:, None] & mask_d[None, :]
        wg = tl.load(w_gate + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w_up + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    return acc_g, acc_u


@triton.jit
def _moe_expert_gate_up_kernel(x_ptr, idx_ptr, w_ptr, sg_ptr, su_ptr, act_ptr, D: tl.constexpr, I: tl.constexpr,
                    K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
                    PDL: tl.constexpr):
    """Slot k < K of token n reads expert idx[n, k]; slot K (when SLOTS = K + 1) the shared expert. A routed stack of
    another dtype than the shared expert's is read through its own pointers (Triton refuses one pointer variable of
    two element types); with one dtype one loop reads either."""
    pid = tl.program_id(0)
    pid_i = tl.program_id(1)
    n = pid // SLOTS
    k = pid % SLOTS
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    if PDL and k < K:  # launched early (PDL): the routed slots wait for the router's idx
        gdc_wait()
    if PDL:  # down may launch once every program got here: the routed ones past their wait, so idx is complete
        gdc_launch_dependents()
    if w_ptr.dtype.element_ty == sg_ptr.dtype.element_ty:
        if k < K:
            e = tl.load(idx_ptr + n * K + k).to(tl.int64)
            w_gate = w_ptr + e * (2 * I * D) + offs_i[:, None] * D
            w_up = w_gate + I * D
        else:
            w_gate = sg_ptr + offs_i[:, None] * D
            w_up = su_ptr + offs_i[:, None] * D
        acc_g, acc_u = _gate_up_rows(x_ptr + n * D, w_gate, w_up, mask_i, D, BLOCK_I, BLOCK_D)
    else:
        if k < K:
            e = tl.load(idx_ptr + n * K + k).to(tl.int64)
            w_gate = w_ptr + e * (2 * I * D) + offs_i[:, None] * D
            acc_g, acc_u = _gate_up_rows(x_ptr + n * D, w_gate, w_gate + I * D, mask_i, D, BLOCK_I, BLOCK_D)
        else:
            acc_g, acc_u = _gate_up_rows(x_ptr + n * D, sg_ptr + offs_i[:, None] * D, su_ptr + offs_i[:, None] * D,
                                         mask_i, D, BLOCK_I, BLOCK_D)
    # Round where the prefill path (F.linear, F.silu, mul) rounds: decode and prefill differ only in summation order
    DT = act_ptr.dtype.element_ty
    g = acc_g.to(DT).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(DT).to(tl.float32)
    h = s * acc_u.to(DT).to(tl.float32)
    tl.store(act_ptr + pid * I + offs_i, h.to(DT), mask=mask_i)


@triton.jit
def _down_weights(w_ptr, sd_ptr, rows, offs_d, mask_kd, mask_d, i0, I: tl.constexpr, SHARED: tl.constexpr,
                  BLOCK_I: tl.constexpr):
    """One step's weight tiles: [KP, BLOCK_D, BLOCK_I] of the chosen w2's and [BLOCK_D, BLOCK_I] of the shared one."""
    offs_i = i0 + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    wd = tl.load(w_ptr + rows[:, :, None] + offs_i[None, None, :], mask=mask_kd[:, :, None] & mask_i[None, None, :],
                 other=0.0)
    ws = wd  # unused without the shared expert
    if SHARED:
        ws = tl.load(sd_ptr + offs_d[:, None] * I + offs_i[None, :], mask=mask_d[:, None] & mask_i[None, :], other=0.0)
    return wd, ws


@triton.jit
def _down_step(act_ptr, a_rows, a_shared, wd, ws, acc, acc_s, mask_k, i0, I: tl.constexpr, SHARED: tl.constexpr,
               BLOCK_I: tl.constexpr):
    """acc (+ acc_s) plus one step's products of the weight tiles with act."""
    offs_i = i0 + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    a = tl.load(act_ptr + a_rows[:, None] + offs_i[None, :], mask=mask_k[:, None] & mask_i[None, :],
                other=0.0).to(tl.float32)
    acc += tl.sum(wd.to(tl.float32) * a[:, None, :], axis=2)
    if SHARED:
        a_s = tl.load(act_ptr + a_shared + offs_i, mask=mask_i, other=0.0).to(tl.float32)
        acc_s += tl.sum(ws.to(tl.float32) * a_s[None, :], axis=1)
    return acc, acc_s


@triton.jit
def _moe_expert_down_kernel(act_ptr, idx_ptr, wt_ptr, w_ptr, sd_ptr, y_ptr, D: tl.constexpr, I: tl.constexpr,
                 K: tl.constexpr, KP: tl.constexpr, SHARED: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_I: tl.constexpr, PDL: tl.constexpr):
    """Rows offs_d of y[n] from the K routed slots (a [KP, BLOCK_D, BLOCK_I] tile per step, KP = K padded to a power
    of two) and the shared expert (SHARED, slot K of act). PDL: the first step's weight tiles are read before the
    wait for gate_up's act."""
    n = tl.program_id(0)
    pid_d = tl.program_id(1)
    SLOTS: tl.constexpr = K + SHARED
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_k = tl.arange(0, KP)
    mask_k = offs_k < K
    e = tl.load(idx_ptr + n * K + offs_k, mask=mask_k, other=0).to(tl.int64)
    wk = tl.load(wt_ptr + n * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    rows = e[:, None] * (D * I) + offs_d[None, :] * I                       # [KP, BLOCK_D] row starts
    mask_kd = mask_k[:, None] & mask_d[None, :]
    a_rows = (n * SLOTS + offs_k) * I
    a_shared = (n * SLOTS + K) * I
    acc = tl.zeros([KP, BLOCK_D], dtype=tl.float32)
    acc_s = tl.zeros([BLOCK_D], dtype=tl.float32)
    wd, ws = _down_weights(w_ptr, sd_ptr, rows, offs_d, mask_kd, mask_d, 0, I, SHARED, BLOCK_I)
    if PDL:  # the tiles above stream while gate_up finishes; act is read only after it has
        gdc_wait()
    acc, acc_s = _down_step(act_ptr, a_rows, a_shared, wd, ws, acc, acc_s, mask_k, 0, I, SHARED, BLOCK_I)
    for i0 in range(BLOCK_I, I, BLOCK_I):
        wd, ws = _down_weights(w_ptr, sd_ptr, rows, offs_d, mask_kd, mask_d, i0, I, SHARED, BLOCK_I)
        acc, acc_s = _down_step(act_ptr, a_rows, a_shared, wd, ws, acc, acc_s, mask_k, i0, I, SHARED, BLOCK_I)
    # Each expert's output rounded (as F.linear's), weighted in fp32, summed in a fixed order, the shared expert
    # last; one rounding of the sum, as the prefill path.
    DT = y_ptr.dtype.element_ty
    y = tl.sum(wk[:, None] * acc.to(DT).to(tl.float32), axis=0)
    if SHARED:
        y += acc_s.to(DT).to(tl.float32)
    tl.store(y_ptr + n * D + offs_d, y.to(DT), mask=mask_d)


def fused_moe_small_batch(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          gate_up_cfg: dict | None = None, down_cfg: dict | None = None,
                          early: bool = False) -> torch.Tensor:
    """x [N, D]; idx [N, K] expert ids; w [N, K] fp32 weights; gate_up [E, 2I, D]; down [E, D, I] -> y [N, D].
    `shared` = (gate [I, D], up [I, D], down [D, I]) adds the shared expert (weight 1) in the same launches."""
    N, D = x.shape
    E, twoI, D2 = gate_up.shape
    I = twoI // 2
    if D2 != D or down.shape != (E, D, I):
        raise ValueError(f"expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit x {tuple(x.shape)}")
    if shared is not None and (shared[0].shape != (I, D) or shared[1].shape != (I, D) or shared[2].shape != (D, I)):
        raise ValueError(f"shared expert shapes {[tuple(t.shape) for t in shared]} do not fit [{I}, {D}] / [{D}, {I}]")
    x, idx, w = x.contiguous(), idx.contiguous(), w.float().contiguous()
    act = expert_gate_up(x, idx, gate_up, shared[:2] if shared is not None else None, gate_up_cfg, early)
    return expert_down(act, idx, w, down, shared[2] if shared is not None else None, down_cfg, early)


def expert_gate_up(x, idx, gate_up, shared_gate_up=None, cfg=None, early: bool = False) -> torch.Tensor:
    """The first launch: act [N * SLOTS, I] (SLOTS = K, + 1 with the shared expert's (gate, up)). `early`: PDL after
    the router, set by `fused_moe_decode` alone, which checks that nothing is copied before the launch."""
    mt.require_runnable(_moe_expert_gate_up_kernel, x.device)
    N, D = x.shape
    K, I = idx.shape[1], gate_up.shape[1] // 2
    sg, su = (t.contiguous() for t in shared_gate_up) if shared_gate_up is not None else (gate_up, gate_up)
    slots = K + (shared_gate_up is not None)
    act = mt.empty(N * slots, I, dtype=x.dtype, device=x.device)
    c = mt.launch_config("expert_gate_up", GATE_UP, cfg)
    bi, bd = min(c["BLOCK_I"], triton.next_power_of_2(I)), min(c["BLOCK_D"], triton.next_power_of_2(D))
    _moe_expert_gate_up_kernel[(N * slots, triton.cdiv(I, bi))](x, idx, gate_up, sg, su, act, D, I, K, slots, bi, bd,
                                                               **pdl(_moe_expert_gate_up_kernel, x.device, early),
                                                               num_warps=c["num_warps"])
    return act


def expert_down(act, idx, w, down, shared_down=None, cfg=None, early: bool = False) -> torch.Tensor:
    """The second launch: y [N, D] from act (`expert_gate_up`), the routing weights w [N, K] fp32 and w2. `early`:
    PDL after gate_up, set by `fused_moe_decode` alone."""
    mt.require_runnable(_moe_expert_down_kernel, act.device)
    N, K = idx.shape
    D, I = down.shape[1], down.shape[2]
    sd = shared_down.contiguous() if shared_down is not None else down
    y = mt.empty(N, D, dtype=act.dtype, device=act.device)
    c = mt.launch_config("expert_down", DOWN, cfg)
    bd, bi = min(c["BLOCK_D"], triton.next_power_of_2(D)), min(c["BLOCK_I"], triton.next_power_of_2(I))
    _moe_expert_down_kernel[(N, triton.cdiv(D, bd))](act, idx, w, down, sd, y, D, I, K, triton.next_power_of_2(K),
                                                     shared_down is not None, bd, bi,
                                                     **pdl(_moe_expert_down_kernel, act.device, early),
                                                     num_warps=c["num_warps"])
    return y


@triton.jit
def _topk_route(logit, offs, mask, bias_ptr, idx_ptr, w_ptr, scaling, K: tl.constexpr, BLOCK_E: tl.constexpr,
                RENORM: tl.constexpr):
    """One token's routing from its logits [BLOCK_E] (lanes offs, valid where mask): the K best of sigmoid + bias,
    their unbiased sigmoid weights (renormalised when RENORM) times scaling. Each choice is one max over int64 keys,
    the score's order-preserving bits above the complemented lane index: ties go to the lowest index."""
    s = tl.sigmoid(logit)
    choice = s + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bits = choice.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # int order == float order
    taken = -(1 << 62) * 2  # int64 min: below every valid key, so a masked or chosen lane is never picked
    key = tl.where(mask, (ordered << 32) | (BLOCK_E - 1 - offs).to(tl.int64), taken)
    offs_k = tl.arange(0, K)
    chosen_i = tl.zeros([K], dtype=tl.int32)
    for k in range(K):
        best = tl.max(key, axis=0)
        chosen_i = tl.where(offs_k == k, (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32), chosen_i)
        key = tl.where(key == best, taken, key)
    # the chosen lanes' unbiased scores: a [K] x [BLOCK_E] one-hot contraction, no per-choice reduction
    chosen_w = tl.sum(tl.where(offs[None, :] == chosen_i[:, None], s[None, :], 0.0), axis=1)
    if RENORM:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    tl.store(idx_ptr + offs_k, chosen_i.to(idx_ptr.dtype.element_ty))
    tl.store(w_ptr + offs_k, chosen_w * scaling)


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                  scaling, RENORM: tl.constexpr):
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    logit = tl.load(logits_ptr + n * E + offs, mask=mask, other=0.0).to(tl.float32)
    _topk_route(logit, offs, mask, bias_ptr, idx_ptr + n * K, w_ptr + n * K, scaling, K, BLOCK_E, RENORM)


def _check_k(k: int) -> None:
    if k & (k - 1):
        raise ValueError(f"top-k {k} must be a power of two for the Triton router")


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float, renorm: bool):
    """logits [N, E] fp32 router GEMM output -> (idx [N, k] int64, weights [N, k] fp32)."""
    N, E = logits.shape
    _check_k(k)
    mt.require_runnable(_moe_route_kernel, logits.device)
    idx = mt.empty(N, k, dtype=torch.int64, device=logits.device)
    w = mt.empty(N, k, dtype=torch.float32, device=logits.device)
    _moe_route_kernel[(N,)](logits.contiguous(), bias.float().contiguous(), idx, w, E, k,
                        triton.next_power_of_2(E), float(scaling), bool(renorm))
    return idx, w


@triton.jit
def _moe_router_kernel(x_ptr, wr_ptr, bias_ptr, logits_ptr, arrivals, idx_ptr, w_ptr, scaling, D: tl.constexpr,
                       E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                       EP: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    """Logits of experts offs_e for token n (whole rows: BLOCK_D = D padded to a power of two), then, in the
    token's last program to arrive, its routing. The logit of expert e is one fixed-order fp32 reduction."""
    n = tl.program_id(0)
    pid_e = tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    wv = tl.load(wr_ptr + offs_e[:, None] * D + offs_d[None, :], mask=mask_e[:, None] & mask_d[None, :],
                 other=0.0).to(tl.float32)
    if PDL:  # the weight rows above are read while the kernel before (the norm that makes x) finishes
        gdc_wait()
        gdc_launch_dependents()
    xv = tl.load(x_ptr + n * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    tl.store(logits_ptr + n * E + offs_e, tl.sum(wv * xv[None, :], axis=1), mask=mask_e)
    # Report in (acq_rel atomic) once this program's logits are stored; the token's last program reads all E
    # logits (.cg: from L2) and routes the token.
    tl.debug_barrier()
    if tl.atomic_add(arrivals + n, 1) == tl.num_programs(1) - 1:
        offs = tl.arange(0, EP)
        mask = offs < E
        logit = tl.load(logits_ptr + n * E + offs, mask=mask, other=0.0, cache_modifier=".cg")
        _topk_route(logit, offs, mask, bias_ptr, idx_ptr + n * K, w_ptr + n * K, scaling, K, EP, RENORM)
        tl.atomic_xchg(arrivals + n, 0)


def fused_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, scaling: float, renorm: bool,
                 cfg: dict | None = None, early: bool = False):
    """x [N, D], router weight [E, D] (fp32), correction bias [E] -> (idx [N, k] int64, weights [N, k] fp32):
    the router GEMV and the routing in one launch. `cfg` overrides `ROUTER`. `early`: PDL after the kernel before,
    set by `fused_moe_decode` alone."""
    N, D = x.shape
    E = weight.shape[0]
    if weight.shape[1] != D or bias.shape != (E,):
        raise ValueError(f"router weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not fit x {tuple(x.shape)}")
    _check_k(k)
    mt.require_runnable(_moe_router_kernel, x.device)
    c = mt.launch_config("fused_router", ROUTER, cfg)
    be = min(c["BLOCK_E"], triton.next_power_of_2(E))
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.float().contiguous()
    idx = mt.empty(N, k, dtype=torch.int64, device=x.device)
    w = mt.empty(N, k, dtype=torch.float32, device=x.device)
    # a buffer that outlives the call: gate_up may start before this launch ends (PDL) and must not be handed a
    # temporary freed here
    logits = mt.kept_buffer("router logits", x.device, N * E, ROUTER_LOGITS, torch.float32)
    _moe_router_kernel[(N, triton.cdiv(E, be))](
        x, weight, bias, logits, mt.arrival_counters(x.device, N), idx, w, float(scaling), D, E, k, be,
        triton.next_power_of_2(D), triton.next_power_of_2(E), bool(renorm), **pdl(_moe_router_kernel, x.device, early),
        num_warps=c["num_warps"])
    return idx, w


def pdl(kernel, device: torch.device, early: bool) -> dict:
    """Launch arguments for programmatic dependent launch when `early`, compiled on CUDA only (the interpreter has no
    griddepcontrol): the kernel may start while the one before it runs, and waits (`gdc_wait`) for its output."""
    on = early and mt.pdl_capable(kernel, device)
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


def fused_moe_decode(x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor, k: int, scaling: float,
                     renorm: bool, gate_up: torch.Tensor, down: torch.Tensor,
                     shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The whole small-batch MoE block: `fused_router` then `fused_moe_small_batch`, the first two launches `early`
    (PDL): the same bits. The caller promises that the kernel launched just before writes neither the router's nor
    the experts' weights (true of a model's decode step)."""
    # Early starts only when no input is copied: a copy would be the kernel just before an early launch
    early = (x.is_contiguous() and router_weight.is_contiguous() and bias.dtype == torch.float32
             and bias.is_contiguous() and (shared is None or all(t.is_contiguous() for t in shared)))
    x = x.contiguous()
    idx, w = fused_router(x, router_weight, bias, k, scaling, renorm, early=early)
    return fused_moe_small_batch(x, idx, w, gate_up, down, shared, early=early)


mt.seal(__name__)

"""The one place where the model picks an implementation for each hot op: plain PyTorch or Triton.

`KIMI_KERNELS` = `auto` (Triton on CUDA tensors, PyTorch elsewhere), `torch`, or `triton` (Triton everywhere;
on a CPU that needs `TRITON_INTERPRET=1`). `use("torch")` overrides it inside a `with` block (tests, A/B runs).
`experts_kernel(fn)` runs another computation of the prefill MoE's grouped experts inside a block (a candidate kernel
under a model-level A/B, kept outside the model).
The PyTorch forms are the references: `model.kda`, `model.norms`, and the functions below.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from . import kda, norms

_VALID = ("auto", "torch", "triton")
_override: str | None = None


def kernels_setting() -> str:
    mode = _override or os.environ.get("KIMI_KERNELS", "auto")
    if mode not in _VALID:
        raise ValueError(f"KIMI_KERNELS={mode!r}; expected one of {_VALID}")
    return mode


@contextlib.contextmanager
def use(mode: str):
    """Force `mode` for the ops called inside the block."""
    global _override
    if mode not in _VALID:
        raise ValueError(f"kernel mode {mode!r}; expected one of {_VALID}")
    prev, _override = _override, mode
    try:
        yield
    finally:
        _override = prev


def _triton(t: torch.Tensor) -> bool:
    mode = kernels_setting()
    return mode == "triton" or (mode == "auto" and t.is_cuda)


# ---- KDA --------------------------------------------------------------------------------------
def kda_gate(f, A_log, dt_bias, head_dim):
    """Log decay g = -exp(A_log[h]) * softplus(f + dt_bias), fp32, [..., H, head_dim] (`kda.kda_gate`)."""
    if _triton(f):
        from .triton.act import kda_gate as triton_kda_gate
        return triton_kda_gate(f, A_log, dt_bias, head_dim)
    return kda.kda_gate(f, A_log, dt_bias, head_dim)


def causal_conv1d(x, weight, taps=None):
    """Depthwise causal conv + SiLU over a span, from the carried taps: (y, new taps), as `kda.causal_conv1d`."""
    if _triton(x):
        from .triton.conv import causal_conv1d as triton_causal_conv1d
        return triton_causal_conv1d(x, weight, taps)
    return kda.causal_conv1d(x, weight, taps)


def chunk_kda(q, k, v, g, beta, initial_state=None):
    """Prefill / recompute over a span: returns (o, final state fp32)."""
    if _triton(q):
        from .triton.kda_chunk import chunk_kda_fwd
        return chunk_kda_fwd(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    return kda.chunk_kda(q, k, v, g, beta, initial_state=initial_state)


def kda_decode_step(qkv_raw, taps, conv_w, f, A_log, dt_bias, b_raw, state, gate, norm_w, eps):
    """One KDA token per sequence from carried state, conv-tap update through the gated output norm:
    conv + SiLU, gate, beta, L2 norm, state update, output, rmsnorm(o) * norm_w * sigmoid(gate).
    `taps` and `state` are updated in place. Shapes as in `model.triton.kda_decode.fused_kda_decode`;
    returns [B, H, d] in qkv_raw's dtype."""
    if _triton(qkv_raw):
        from .triton.kda_decode import fused_kda_decode
        return fused_kda_decode(qkv_raw, taps, conv_w, f, A_log, dt_bias, b_raw, state,
                                out_gate=gate, norm_weight=norm_w, norm_eps=eps)
    H, d = state.shape[1], state.shape[2]
    y, new_taps = kda.causal_conv1d(qkv_raw[:, None], conv_w, taps)
    taps.copy_(new_taps)
    q, k, v = (t.unflatten(-1, (H, d)) for t in y[:, 0].chunk(3, dim=-1))
    g = kda.kda_gate(f, A_log, dt_bias, d)
    beta = torch.sigmoid(b_raw.float())
    o = kda.recurrent_kda_step(q, k, v, g, beta, state).to(qkv_raw.dtype)
    return norms.gated_rmsnorm(o, gate.unflatten(-1, (H, d)), norm_w, eps)


def rmsnorm(x, weight, eps):
    if _triton(x):
        from .triton.norms import rmsnorm as triton_rmsnorm
        return triton_rmsnorm(x, weight, eps)
    return norms.rmsnorm(x, weight, eps)


def add_rmsnorm(x, residual, weight, eps):
    """(rmsnorm(x + residual), x + residual): the residual add fused into the norm that follows it."""
    if _triton(x):
        from .triton.norms import add_rmsnorm as triton_add_rmsnorm
        return triton_add_rmsnorm(x, residual, weight, eps)
    h = x + residual
    return norms.rmsnorm(h, weight, eps), h


def gated_rmsnorm(o, gate, weight, eps):
    if _triton(o):
        from .triton.norms import gated_rmsnorm as triton_gated_rmsnorm
        return triton_gated_rmsnorm(o, gate, weight, eps)
    return norms.gated_rmsnorm(o, gate, weight, eps)


# ---- MLA ----------------------------------------------------------------------------------------
_cudnn_narrow_v: bool | None = None  # does cuDNN's flash attention take v narrower than q and k here? (first call)


def mla_prefill_attention(q, k, v, scale):
    """Causal attention of T queries over S >= T keys, aligned at the end (query i sits at position S-T+i).

    q, k [B,H,T|S,192], v [B,H,S,128]. On CUDA, a prefill from an empty cache (T = S) in bf16/fp16 goes to cuDNN's
    flash kernel, which takes v as it is. Elsewhere on CUDA (or where cuDNN refuses) v is zero-padded to q's head
    dim so that a flash kernel applies (torch's own needs equal head dims), and the padded output columns,
    exactly zero, are dropped. Both give the same bits (tests/test_gpu_paths.py); the padded form copies v and
    multiplies the zeros.
    """
    global _cudnn_narrow_v
    T, S, dv = q.shape[2], k.shape[2], v.shape[-1]
    mask = causal_lower_right(T, S)
    if q.is_cuda and dv < q.shape[-1]:
        if T == S and q.dtype in (torch.bfloat16, torch.float16) and _cudnn_narrow_v is not False:
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                _cudnn_narrow_v = True
                return o
            except RuntimeError:
                if _cudnn_narrow_v:  # it ran before: this failure is not about the head dims
                    raise
                _cudnn_narrow_v = False
        v = F.pad(v, (0, q.shape[-1] - dv))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :dv]


def mla_cache_append(kv, weight, eps, c_cache, kpe_cache, pos):
    """Decode: one token's latent, kv [B, R+P] (the kv_a projection), into the MLA cache at position pos (a
    device scalar): c_cache[:, pos] = rmsnorm(kv[:, :R]) (kv_a_layernorm), kpe_cache[:, pos] = kv[:, R:].
    In Triton one launch, where the norm and two index copies took three."""
    if _triton(kv):
        from .triton.mla_decode import mla_cache_append as triton_mla_cache_append
        return triton_mla_cache_append(kv, weight, eps, c_cache, kpe_cache, pos)
    c, k_pe = kv.split([c_cache.shape[-1], kpe_cache.shape[-1]], dim=-1)
    c_cache.index_copy_(1, pos.view(1), rmsnorm(c, weight, eps)[:, None])
    kpe_cache.index_copy_(1, pos.view(1), k_pe[:, None])


def mla_decode_attention(q_lat, q_pe, c, k_pe, pos, scale):
    """Attention of one query per head over the latent cache, positions 0..pos (a device scalar).

    q_lat [B,H,R] fp32 (q_nope absorbed into the latent space), q_pe [B,H,P], c [B,L,R], k_pe [B,L,P].
    The step's shapes never change with pos (graph-safe); the Triton form reads only positions 0..pos.
    Returns the latent output [B,H,R] in fp32.
    """
    if _triton(c):
        from .triton.mla_decode import mla_decode
        return mla_decode(q_lat, q_pe, c, k_pe, pos, scale)
    return mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale)


def mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale):
    """Reference: fp32 scores, softmax and p @ c over the whole buffer, positions past pos masked out."""
    c, k_pe = c.float(), k_pe.float()
    s = torch.einsum("bhr,blr->bhl", q_lat.float(), c) + torch.einsum("bhp,blp->bhl", q_pe.float(), k_pe)
    valid = torch.arange(c.shape[1], device=c.device) <= pos
    p = torch.softmax((s * scale).masked_fill(~valid, float("-inf")), dim=-1)
    return torch.einsum("bhl,blr->bhr", p, c.masked_fill(~valid[:, None], 0))


def mla_absorb(x, w):
    """out[b,h,n] = sum_k x[b,h,k] w[h,k,n] with an fp32 result (x [B,H,K], w [H,K,N]): the key/value
    up-projections absorbed into MLA decode, kept in fp32 so the latent query and output are not rounded."""
    if _triton(x):
        from .triton.mla_decode import mla_absorb as triton_mla_absorb
        return triton_mla_absorb(x, w)
    return torch.einsum("bhk,hkn->bhn", x.float(), w.float())


# ---- MoE ----------------------------------------------------------------------------------------
SMALL_BATCH = 16  # tokens up to which the MoE streams only the chosen experts' rows (decode), in Triton


def moe_router(x, weight, bias, k: int, scaling: float, renorm: bool, weight_bf16=None):
    """Tokens x [N, D] -> (expert ids [N, k], weights [N, k] fp32). Logits x.float() @ weight.float()^T in fp32;
    top-k of sigmoid + bias; weights the unbiased sigmoid scores of the chosen, renormalised, times scaling.

    Decode-sized batches run the GEMV and the routing in one launch (Triton); larger ones a GEMM then the
    routing kernel. `weight_bf16`, when given, must hold weight's values exactly (`layers.Router.pack_`): bf16
    tokens on CUDA then get the same products from a bf16 GEMM with fp32 accumulation and output."""
    triton = _triton(x) and not (k & (k - 1))  # the Triton top-k takes a power-of-two k
    if triton and x.shape[0] <= SMALL_BATCH:
        from .triton.moe import fused_router
        return fused_router(x, weight, bias, k, scaling, renorm)
    if weight_bf16 is not None and x.is_cuda and x.dtype == torch.bfloat16:
        logits = torch.mm(x, weight_bf16.t(), out_dtype=torch.float32)
    else:
        logits = F.linear(x.float(), weight.float())
    if triton:
        from .triton.moe import route
        return route(logits, bias, k, scaling, renorm)
    return moe_route_torch(logits, bias, k, scaling, renorm)


def moe(x, gate, gate_up, down, shared=None):
    """The MoE block on tokens x [N, D]: routing by `gate` (a `layers.Router`), then `moe_experts`. Decode-sized
    batches on Triton run it as `fused_moe_decode`, the same launches and bits, each started early (PDL): the
    router reads its weights while the norm before it runs, the shared expert's gate_up streams while the router's
    top-k runs, and down reads its first weight tiles while gate_up finishes (`model.triton.moe`)."""
    if _triton(x) and x.shape[0] <= SMALL_BATCH and not (gate.top_k & (gate.top_k - 1)):
        from .triton.moe import fused_moe_decode
        sw = None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
        return fused_moe_decode(x, gate.weight, gate.e_score_correction_bias, gate.top_k, gate.scaling, gate.renorm,
                                gate_up, down, sw)
    idx, w = gate(x)
    return moe_experts(x, idx, w, gate_up, down, shared)


def moe_route_torch(logits, bias, k, scaling, renorm):
    """Reference routing from fp32 logits [N, E]."""
    scores = torch.sigmoid(logits)
    idx = torch.topk(scores + bias.float(), k, dim=-1, sorted=False).indices
    return idx, route_weights(scores, idx, scaling, renorm)


def route_weights(scores, idx, scaling, renorm):
    """The weights of the chosen experts idx [N, k] from the unbiased sigmoid scores [N, E]: renormalised over the
    chosen when `renorm`, times `scaling`."""
    w = scores.gather(-1, idx)
    if renorm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling


def silu_mul(g, u):
    """SwiGLU's activation silu(g) * u; g and u of one shape and dtype, either may be a strided view (the two
    halves of one gate|up projection output). One pass in Triton instead of torch's silu kernel, a write of
    silu(g), and a mul kernel; the same roundings."""
    if _triton(g):
        from .triton.act import silu_mul as triton_silu_mul
        return triton_silu_mul(g, u)
    return F.silu(g) * u


def moe_experts(x, idx, w, gate_up, down, shared=None):
    """sum_k w[n,k] * down[e](silu(w1[e] x) * w3[e] x) with e = idx[n,k], plus the shared expert (an `MLP`
    module) when given; x [N,D], idx/w [N,k].

    Decode-sized batches stream only the chosen experts' rows, the shared expert's in the same two launches
    (Triton); prefill-sized ones sort the (token, expert) pairs by expert and run two grouped GEMMs; the
    loop is the reference. All round once, from the fp32 sum with the shared expert included.
    The expert stacks may be held in a narrower dtype than x (`model.checkpoint.ROUTED_EXPERTS`): they are
    widened to x's dtype where they are read."""
    if _triton(x) and x.shape[0] <= SMALL_BATCH:
        from .triton.moe import fused_moe_small_batch
        sw = None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
        return fused_moe_small_batch(x, idx, w, gate_up, down, sw)
    s = None if shared is None else shared(x)
    if x.is_cuda and hasattr(F, "grouped_mm"):
        return moe_experts_grouped(x, idx, w, gate_up, down, s)
    y = moe_experts_torch(x, idx, w, gate_up, down)
    return (y if s is None else y + s.float()).to(x.dtype)


def moe_experts_grouped(x, idx, w, gate_up, down, shared_out=None):
    """Grouped-GEMM form: the (token, expert) pairs sorted by expert, the experts' outputs of all pairs at once
    (`grouped_experts`, or the function an enclosing `experts_kernel` block gives), then `moe_combine`; returns x's
    dtype."""
    N, K = idx.shape
    order, offs = sort_by_expert(idx, gate_up.shape[0])
    out = (_experts_kernel.get() or grouped_experts)(x, order, offs, gate_up, down, K)
    return moe_combine(out, pair_rows(order).view(N, K), w, shared_out, x.dtype)


def grouped_experts(x, order, offs, gate_up, down, K: int):
    """out [N*K, D] = down[e](silu(w1[e] x) * w3[e] x) for each (token, expert) pair in the sorted order (token
    order[r] // K, expert e by offs), in x's dtype: the dispatch copy, one grouped GEMM per projection and silu_mul."""
    I = down.shape[2]
    gu = grouped_mm(moe_dispatch(x, order, K), gate_up.transpose(1, 2), offs)
    h = silu_mul(gu[:, :I], gu[:, I:])
    return grouped_mm(h, down.transpose(1, 2), offs)


# The function `moe_experts_grouped` runs in place of `grouped_experts` in this context (None: `grouped_experts`).
# A ContextVar, so a block's change is seen by its thread (or task) alone and undone exactly by that block.
_experts_kernel: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("experts_kernel", default=None)


@contextlib.contextmanager
def experts_kernel(fn: Callable | None):
    """Inside the block, in this thread or task, `moe_experts_grouped` computes the pairs' expert outputs as
    fn(x, order, offs, gate_up, down, K), which must return what `grouped_experts` does; None: `grouped_experts`
    itself. On leaving, also by an exception, as before. The one way a kernel that is not the model's default (a
    candidate under a model-level A/B) runs inside the model."""
    if fn is not None and not callable(fn):
        raise TypeError(f"experts_kernel takes a function of (x, order, offs, gate_up, down, K) or None, got {fn!r}")
    token = _experts_kernel.set(fn)
    try:
        yield
    finally:
        _experts_kernel.reset(token)


def pair_rows(order):
    """The inverse of the sorted pair order: the row of the expert outputs that holds flat pair n*K + k."""
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=order.device)
    return slot


def sort_by_expert(idx, E: int):
    """(order, offs) for the (token, slot) pairs of idx [N, K]: order [N*K] (int64) lists the flat pairs sorted
    by expert, stably; offs [E] (int32) is the end of each expert's rows in that order.

    No host sync: the offsets are a device-side binary search in the sorted ids. (torch.bincount syncs twice for
    its min and max, which starved the GPU at every MoE layer; docs/RESULTS.md, "Notes behind the code".) The ids
    sort as int16 where they fit: a radix sort over 16 bits
    makes two passes, over int64 eight."""
    keys = idx.reshape(-1).to(torch.int16 if E <= torch.iinfo(torch.int16).max else torch.int32)
    ids, order = torch.sort(keys, stable=True)
    bounds = torch.arange(1, E + 1, device=idx.device, dtype=keys.dtype)
    return order, torch.searchsorted(ids, bounds, out_int32=True)


def moe_dispatch(x, order, K: int):
    """x[order // K]: each (token, slot) pair's token row, in the pairs' sorted order (`sort_by_expert`)."""
    if _triton(x):
        from .triton.moe_dispatch import moe_dispatch as triton_moe_dispatch
        return triton_moe_dispatch(x, order, K)
    return moe_dispatch_torch(x, order, K)


def moe_dispatch_torch(x, order, K: int):
    return x[order // K]


def grouped_mm(a, b, offs):
    """Rows offs[e-1]:offs[e] of a [M, K] times b[e] [K, N] for each group e -> [M, N] in a's dtype.

    torch's grouped GEMM where it runs (bf16 on CUDA; any one dtype on a CPU). Otherwise, e.g. fp32 rows against
    expert stacks held in bf16 (Gate A's precision on CUDA), one GEMM per non-empty group with its b widened to
    a's dtype: a host sync for the offsets and ~E launches, where the reference loop syncs once per expert."""
    if a.dtype == b.dtype and (not a.is_cuda or a.dtype == torch.bfloat16):
        return F.grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], b[e].to(a.dtype), out=out[start:end])
        start = end
    return out


def moe_combine(out, slot, w, shared_out, dtype):
    """y[n] = sum over k in order of w[n,k] * out[slot[n,k]], plus shared_out[n], in fp32, rounded once to
    `dtype`. out [N*K, D] (rows in any order), slot/w [N, K], shared_out [N, D] or None. No atomics."""
    if _triton(out):
        from .triton.moe_combine import moe_combine as triton_moe_combine
        return triton_moe_combine(out, slot, w, shared_out, dtype)
    return moe_combine_torch(out, slot, w, shared_out, dtype)


def moe_combine_torch(out, slot, w, shared_out, dtype):
    y = torch.zeros(w.shape[0], out.shape[-1], dtype=torch.float32, device=out.device)
    for k in range(w.shape[1]):
        y = y + out[slot[:, k]].float() * w[:, k, None].float()
    return (y if shared_out is None else y + shared_out.float()).to(dtype)


def moe_experts_torch(x, idx, w, gate_up, down):
    """Reference: loop over the experts that were chosen; accumulate in fp32 (returned in fp32). Each expert's
    weights are widened to x's dtype (a no-op unless the stacks are held narrower)."""
    y = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    I = down.shape[2]
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        gu = F.linear(x[tok], gate_up[e].to(x.dtype))
        h = F.silu(gu[:, :I]) * gu[:, I:]
        y.index_add_(0, tok, F.linear(h, down[e].to(x.dtype)).float() * w[tok, slot, None])
    return y

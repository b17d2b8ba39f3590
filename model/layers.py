"""Kimi-Linear's blocks in plain PyTorch: RMSNorm, KDA, NoPE MLA, MoE, dense MLP.

Parameter names match HF transformers' KimiLinearForCausalLM, so one state dict serves both (the HF peer
shares our tensors instead of copying 91 GiB). The math is SPEC.md §1. Each attention block has two entry
points: `forward` for a span of tokens (the whole sequence when recomputing, the prompt when prefilling; MLA
also takes the span's `start`) and `decode` for one token a step from carried state (MLA also takes the
position `pos`, a device scalar; KDA's state carries no position).
Where a fast kernel exists the choice is made in `model.ops`, never here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .cache import KDAState, MLACache
from .config import KimiConfig


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back to the input dtype, then scale by `weight` (not 1 + weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)


class ForgetGate(nn.Module):
    """Decay-gate parameters; KimiDeltaAttention runs f_a/f_b with its other projections (see its `pack_`)."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        d, n = cfg.kda_head_dim, cfg.kda_num_heads
        self.f_a_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.f_b_proj = nn.Linear(d, n * d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(n * d))
        self.A_log = nn.Parameter(torch.zeros(1, 1, n, 1))


def check_one_dtype(linears, what: str) -> None:
    dtypes = {m.weight.dtype for m in linears}
    if len(dtypes) > 1:
        raise TypeError(f"{what} projection weights must share one dtype to be packed, got {sorted(map(str, dtypes))}")


def pack_linears(owner: nn.Module, buffer: str, linears: tuple[nn.Linear, ...], what: str, stack: bool = False):
    """Copy the linears' weights into one tensor, registered on `owner` as a non-persistent `buffer`
    (concatenated along the output rows, or stacked), and re-point each nn.Linear's weight to its view of it:
    names, shapes and values stay as they were, so `state_dict()` sees no difference."""
    check_one_dtype(linears, what)
    packed = (torch.stack if stack else torch.cat)([m.weight for m in linears])
    owner.register_buffer(buffer, packed, persistent=False)
    views = packed if stack else packed.split([m.out_features for m in linears])
    for m, w in zip(linears, views):
        m.weight = nn.Parameter(w, requires_grad=False)


class KimiDeltaAttention(nn.Module):
    """Inference only: the forward reads the packed weights (`pack_`), so no gradient reaches the nn.Linears."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        D, d, n, W = cfg.hidden_size, cfg.kda_head_dim, cfg.kda_num_heads, cfg.conv_kernel_size
        self.head_dim, self.num_heads, self.eps = d, n, cfg.rms_norm_eps
        self.q_proj = nn.Linear(D, n * d, bias=False)
        self.k_proj = nn.Linear(D, n * d, bias=False)
        self.v_proj = nn.Linear(D, n * d, bias=False)
        # q|k|v depthwise convs stacked, as HF holds them: [3*n*d, 1, W]
        self.conv1d = nn.Conv1d(3 * n * d, 3 * n * d, W, groups=3 * n * d, bias=False)
        self.forget_gate = ForgetGate(cfg)
        self.b_proj = nn.Linear(D, n, bias=False)
        self.g_a_proj = nn.Linear(D, d, bias=False)
        self.g_b_proj = nn.Linear(d, n * d, bias=False)
        self.o_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(n * d, D, bias=False)
        self.pack_()

    @torch.no_grad()
    def pack_(self) -> None:
        """Copy the weights of q|k|v|f_a|g_a|b_proj into one [3*n*d + 2*d + n, D] tensor (`in_proj_weight`) and
        those of f_b|g_b_proj into one [2, n*d, d] (`gate_b_weight`), and re-point each nn.Linear's weight to
        its view of them.

        Why: at batch-1 decode each of these eight projections is a small, latency-bound GEMV; packed they are
        two launches, one GEMV and one batched GEMV. Parameter names, shapes and values stay as they were, so
        `state_dict()` (checkpoints, fingerprints, the HF peer, which wraps our tensors) sees no difference.
        Call it again after assigning weights (`model.build.from_state_dict` does): the forward reads only the
        packed tensors, and the weights assigned before are copied, not kept.
        """
        fg = self.forget_gate
        ins = (self.q_proj, self.k_proj, self.v_proj, fg.f_a_proj, self.g_a_proj, self.b_proj)
        outs = (fg.f_b_proj, self.g_b_proj)
        check_one_dtype(ins + outs, "KDA")  # across both packs: the forward multiplies one by the other
        pack_linears(self, "in_proj_weight", ins, "KDA")
        pack_linears(self, "gate_b_weight", outs, "KDA", stack=True)

    def _project(self, x):
        """x [..., D] -> (q|k|v before the conv, f_b(f_a(x)), g_b(g_a(x)), b_proj(x)) in two launches: the six
        input projections as one GEMM, then f_b and g_b as one batched GEMM on the f_a|g_a columns (a view)."""
        nd, d = self.num_heads * self.head_dim, self.head_dim
        qkv, fg_a, b = F.linear(x, self.in_proj_weight).split([3 * nd, 2 * d, self.num_heads], dim=-1)
        f, gate = torch.bmm(fg_a.reshape(-1, 2, d).transpose(0, 1), self.gate_b_weight.transpose(1, 2))
        return qkv, f.view(*x.shape[:-1], nd), gate.view(*x.shape[:-1], nd), b

    def forward(self, x: torch.Tensor, cache: KDAState | None = None, last_only: bool = False) -> torch.Tensor:
        """A span of tokens [B, T, D]: chunked form from the carried state (zeros without a cache). With last_only,
        the state still takes in every token, but only the last one's output is normed and projected: [B, 1, D]."""
        fg = self.forget_gate
        qkv, f, gate, b = self._project(x)
        qkv, taps = ops.causal_conv1d(qkv, self.conv1d.weight[:, 0], None if cache is None else cache.taps)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        g = ops.kda_gate(f, fg.A_log, fg.dt_bias, self.head_dim)
        beta = torch.sigmoid(b.float())
        o, state = ops.chunk_kda(q, k, v, g, beta, initial_state=None if cache is None else cache.state)
        if cache is not None:
            cache.state.copy_(state)
            cache.taps.copy_(taps)
        gate = gate.unflatten(-1, (self.num_heads, self.head_dim))
        if last_only:
            o, gate = o[:, -1:], gate[:, -1:]
        o = ops.gated_rmsnorm(o.to(x.dtype), gate, self.o_norm.weight, self.eps)
        return self.o_proj(o.flatten(-2))

    def decode(self, x: torch.Tensor, cache: KDAState) -> torch.Tensor:
        """One token per sequence, x [B, D]; updates the recurrent state and conv taps in place."""
        fg = self.forget_gate
        qkv, f, gate, b = self._project(x)
        o = ops.kda_decode_step(qkv, cache.taps, self.conv1d.weight[:, 0], f, fg.A_log, fg.dt_bias, b, cache.state,
                                gate, self.o_norm.weight, self.eps)
        return self.o_proj(o.flatten(-2))


class MultiLatentAttention(nn.Module):
    """NoPE MLA: nothing is rotated; the 64-dim `k_pe` part is one key shared by all heads. Inference only, as
    KimiDeltaAttention: the forward reads the packed input projection (`pack_`)."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.R, self.P = H, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.dn, self.dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim ** -0.5
        self.q_proj = nn.Linear(D, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.P, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, cfg.kv_norm_eps)
        self.kv_b_proj = nn.Linear(self.R, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=False)
        self.pack_()

    @torch.no_grad()
    def pack_(self) -> None:
        """Copy the weights of q_proj and kv_a_proj_with_mqa into one [H*192 + R+P, D] tensor (`in_proj_weight`)
        and re-point both nn.Linears' weights to their views of it: one GEMV at batch-1 decode where two
        latency-bound ones ran (the narrow kv_a projection alone took microseconds a layer; docs/RESULTS.md, "Notes
        behind the code"). The same contract as `KimiDeltaAttention.pack_`: names, shapes and values unchanged; call
        again after assigning weights."""
        pack_linears(self, "in_proj_weight", (self.q_proj, self.kv_a_proj_with_mqa), "MLA")

    def _project(self, x):
        """x [..., D] -> (q [..., H*192], kv [..., R+P]) in one launch."""
        return F.linear(x, self.in_proj_weight).split([self.q_proj.out_features, self.R + self.P], dim=-1)

    def forward(self, x: torch.Tensor, cache: MLACache | None = None, start: int = 0,
                last_only: bool = False) -> torch.Tensor:
        """Tokens [B, T, D] at positions start..start+T-1; the latents of earlier positions come from the cache.
        With last_only, every token's latent is made (the cache, the keys), but only the last token queries:
        [B, 1, D]."""
        B, T, _ = x.shape
        if last_only:
            q, kv = self.q_proj(x[:, -1:]), self.kv_a_proj_with_mqa(x)   # views of the packed weight
        else:
            q, kv = self._project(x)
        Tq = q.shape[1]
        q = q.reshape(B, Tq, self.H, -1).transpose(1, 2)                     # [B,H,Tq,192]
        c, k_pe = kv.split([self.R, self.P], dim=-1)
        c = self.kv_a_layernorm(c)
        if cache is not None:
            cache.c[:, start:start + T] = c
            cache.k_pe[:, start:start + T] = k_pe
            c, k_pe = cache.c[:, :start + T], cache.k_pe[:, :start + T]
        S = c.shape[1]
        kv = self.kv_b_proj(c).view(B, S, self.H, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        # k = k_nope | k_pe (one k_pe for all heads), written as two copies into one buffer: torch.cat's kernel
        # is slow on the head-broadcast (stride 0) k_pe. The buffer is token-major, [B, S, H, 192], as q and kv
        # are, so that both copies read and write whole rows; attention takes it as a [B, H, S, 192] view.
        k = k_nope.new_empty(B, S, self.H, self.dn + self.P)
        k[..., :self.dn] = k_nope
        k[..., self.dn:] = k_pe[:, :, None]
        o = ops.mla_prefill_attention(q, k.transpose(1, 2), v.transpose(1, 2), self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, Tq, self.H * self.dv))

    def decode(self, x: torch.Tensor, cache: MLACache, pos: torch.Tensor) -> torch.Tensor:
        """One token per sequence at position `pos` (a device scalar), attending over the latent cache.

        The key/value up-projection is absorbed: q_nope is mapped into the latent space (q_nope @ W_uk) and
        the attention output is mapped out of it (o_lat @ W_uv^T), so keys and values are never expanded.
        """
        B = x.shape[0]
        q, kv = self._project(x)
        q_nope, q_pe = q.reshape(B, self.H, -1).split([self.dn, self.P], dim=-1)
        norm = self.kv_a_layernorm
        ops.mla_cache_append(kv, norm.weight, norm.eps, cache.c, cache.k_pe, pos)
        w = self.kv_b_proj.weight.view(self.H, self.dn + self.dv, self.R)
        w_uk, w_uv = w[:, :self.dn], w[:, self.dn:]
        # both absorbed products in fp32: one rounding, at the end, to the model dtype
        q_lat = ops.mla_absorb(q_nope, w_uk)                                                   # [B,H,R] fp32
        o_lat = ops.mla_decode_attention(q_lat, q_pe, cache.c, cache.k_pe, pos, self.scale)   # [B,H,R] fp32
        o = ops.mla_absorb(o_lat, w_uv.transpose(1, 2)).to(x.dtype)                           # [B,H,dv]
        return self.o_proj(o.reshape(B, self.H * self.dv))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    """Sigmoid scores; top-k chosen on score + correction bias; weights are the unbiased scores of the
    chosen experts, renormalised and scaled (num_expert_group = topk_group = 1 reduces to plain top-k)."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.top_k, self.scaling, self.renorm = cfg.num_experts_per_token, cfg.routed_scaling_factor, cfg.moe_renormalize
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.register_buffer("weight_bf16", None, persistent=False)

    @torch.no_grad()
    def pack_(self) -> None:
        """Keep a bf16 copy of the router weight (`weight_bf16`) when it holds bf16 values exactly, as checkpoint
        values do (the checkpoint stores it in bf16; `model.checkpoint.FP32_HELD` widens it), else none.

        Why: prefill-sized bf16 batches then take their fp32 logits from a bf16 tensor-core GEMM with fp32
        accumulation, which forms every product exactly, as the fp32 GEMM does (an FFMA kernel, with the tokens
        widened first: milliseconds of casts in the 8k prefill, docs/RESULTS.md, "Notes behind the code"); the sums
        differ only in order. A weight that bf16 would round (e.g. random fp32 weights in tests) keeps the fp32
        GEMM. Decode reads the fp32 weight. Costs 1.2 MB a layer at 48B-A3B; call again after assigning weights."""
        w = self.weight.to(torch.bfloat16)
        self.weight_bf16 = w if torch.equal(w.to(self.weight.dtype), self.weight) else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.moe_router(x, self.weight, self.e_score_correction_bias, self.top_k, self.scaling, self.renorm,
                              self.weight_bf16)


class Experts(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, D))   # w1 rows, then w3 rows
        self.down_proj = nn.Parameter(torch.zeros(E, D, I))


class MoE(nn.Module):
    """Router, routed experts, shared expert. After `shard_` (expert parallelism, `model.parallel`), the routed
    stacks hold one rank's experts and `forward` returns the sum over the ranks of their partial outputs."""

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts) \
            if cfg.num_shared_experts else None
        self.ep = None  # a model.parallel.ExpertParallel once sharded

    @torch.no_grad()
    def shard_(self, ep) -> None:
        """Keep only `ep`'s experts: rows ep.start:ep.stop of both stacks, copied, so the whole stacks can go (on
        the meta device, before weights are assigned, nothing is held). One rank (world 1) changes nothing."""
        ex = self.experts
        if self.ep is not None:
            raise RuntimeError("this MoE layer is sharded already")
        if ex.gate_up_proj.shape[0] != ep.num_experts:
            raise ValueError(f"expert parallelism over {ep.num_experts} experts; this layer holds "
                             f"{ex.gate_up_proj.shape[0]}")
        if ep.world == 1:
            return
        ex.gate_up_proj = nn.Parameter(ex.gate_up_proj[ep.start:ep.stop].clone(), requires_grad=False)
        ex.down_proj = nn.Parameter(ex.down_proj[ep.start:ep.stop].clone(), requires_grad=False)
        self.ep = ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.ep is None:
            y = ops.moe(x, self.gate, self.experts.gate_up_proj, self.experts.down_proj, self.shared_experts)
        else:
            y = self.ep.reduce(self.partial(x))  # one all_reduce over the ranks
        return y.view(shape)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """A sharded layer's output on this rank before the sum over the ranks, x [N, D] -> [N, D]: its experts'
        share of the routed sum (`ExpertParallel.localize`), plus the shared expert on rank 0 alone. The routing is
        computed on every rank from the same inputs and weights, so every rank chooses the same experts."""
        idx, w = self.ep.localize(*self.gate(x))
        shared = self.shared_experts if self.ep.rank == 0 else None
        return ops.moe_experts(x, idx, w, self.experts.gate_up_proj, self.experts.down_proj, shared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_kinds[i]
        self.self_attn = KimiDeltaAttention(cfg) if self.kind == "kda" else MultiLatentAttention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _norm_in(self, x, residual):
        """(input_layernorm(h), h) with h = residual + x: the previous layer's closing residual add is fused
        into this norm (one kernel instead of two, the same bits). The first layer gets the embeddings as x
        and no residual."""
        norm = self.input_layernorm
        if residual is None:
            return norm(x), x
        return ops.add_rmsnorm(x, residual, norm.weight, norm.eps)

    def _ffn(self, a, residual):
        """h = residual + a; returns (mlp(rmsnorm(h)), h), the add fused into the norm."""
        post = self.post_attention_layernorm
        normed, h = ops.add_rmsnorm(a, residual, post.weight, post.eps)
        return self.mlp(normed), h

    def forward(self, x, residual=None, cache_layer=None, start: int = 0, last_only: bool = False):
        """A span of tokens. Returns (delta, residual): the layer's output is residual + delta, an add left
        to the next layer's input norm (or the final norm).

        last_only: the model's last layer when only the last position's logits are asked for. The attention still
        takes every token into the cache (its state or latents), and that is all any later step reads of them; only
        the last token goes on through the attention's output and the MLP, so (delta, residual) are [B, 1, D]. At
        48B-A3B this saves, per prompt, a 27th of the MoE and of the attention (an MLA layer's)."""
        a, residual = self._norm_in(x, residual)
        if self.kind == "kda":
            a = self.self_attn(a, cache_layer, last_only=last_only)
        else:
            a = self.self_attn(a, cache_layer, start, last_only=last_only)
        return self._ffn(a, residual[:, -1:] if last_only else residual)

    def decode(self, x, residual, cache_layer, pos):
        a, residual = self._norm_in(x, residual)
        a = self.self_attn.decode(a, cache_layer) if self.kind == "kda" else self.self_attn.decode(a, cache_layer, pos)
        return self._ffn(a, residual)

"""Parameter counts of a Kimi-Linear config, from its sizes alone (the tensor list of SPEC.md §1): the total, what
one decoded token reads, and the parts held in another dtype than the model's. `KimiConfig.checkpoint_size` counts
the same total (a test holds the two equal); this module adds the splits the memory projection and the roofline
need."""
from __future__ import annotations

from dataclasses import dataclass

from model.config import KimiConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter of the checkpoint
    active_per_token: int  # parameters one decoded token reads (SPEC §1: 3,106,972,544 for 48b-a3b)
    fp32: int  # parameters kept in fp32 whatever the model dtype (A_log, dt_bias, e_score_correction_bias)
    routed_experts: int  # the routed experts' stacks (model.checkpoint.ROUTED_EXPERTS), which may be held apart
    router: int  # the routers' weights: held in fp32 under a narrower model (model.checkpoint.FP32_HELD)


def param_counts(cfg: KimiConfig) -> ParamCounts:
    """Parameter counts from the config shapes (SPEC §1 tensor list)."""
    D, hd, d, H = cfg.hidden_size, cfg.kda_dim, cfg.kda_head_dim, cfg.kda_num_heads
    A, E, I = cfg.num_attention_heads, cfg.num_experts, cfg.moe_intermediate_size
    kda_fp32 = H + hd  # A_log, dt_bias
    kda = (3 * hd * D + 3 * hd * cfg.conv_kernel_size  # q/k/v projections and their convs
           + 2 * (d * D + hd * d)  # f_a/f_b (decay) and g_a/g_b (output gate) low-rank pairs
           + H * D + d + D * hd + kda_fp32)  # b_proj, o_norm, o_proj
    mla = (A * cfg.qk_head_dim * D + (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * D + cfg.kv_lora_rank
           + A * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank + D * A * cfg.v_head_dim)
    expert = 3 * I * D
    dense = 3 * cfg.intermediate_size * D
    moe = E * D + E + E * expert + cfg.num_shared_experts * expert  # router, its bias, experts, shared expert
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    total = (2 * cfg.vocab_size * D + D  # embed_tokens, lm_head, final norm
             + cfg.num_hidden_layers * 2 * D  # input and post-attention norms
             + len(cfg.kda_layer_ids) * kda + len(cfg.mla_layer_ids) * mla
             + (cfg.num_hidden_layers - n_moe) * dense + n_moe * moe)
    # A token reads one embedding row (negligible, not counted, as SPEC does) and only its top-k experts.
    active = total - cfg.vocab_size * D - n_moe * (E - cfg.num_experts_per_token) * expert
    fp32 = len(cfg.kda_layer_ids) * kda_fp32 + n_moe * E
    return ParamCounts(total, active, fp32, n_moe * E * expert, n_moe * E * D)

"""Kimi-Linear configuration: read the original checkpoint's config.json, validate it, presets.

The original format numbers layers from 1 in `linear_attn_config.{kda_layers,full_attn_layers}`;
internally every layer index is 0-based.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that cannot describe a Kimi-Linear model; the message says which field and why."""


# Upper bounds on sizes, far past any released model (Kimi-Linear: 256 experts, 27 layers, a 163,840-token
# vocabulary): a size past them is a typo, and a name list of ten million experts' tensors exhausts memory before
# the checkpoint check that would refuse it can run.
MAX_SIZE = 1 << 20
SIZE_LIMITS = {"num_hidden_layers": 4096, "num_experts": 1 << 16, "num_experts_per_token": 1 << 16,
               "num_attention_heads": 4096, "kda_num_heads": 4096, "conv_kernel_size": 64, "vocab_size": 1 << 24}

# The JSON types config.json's fields must have (where present): a string where a number belongs, or a null, is
# refused by name here rather than failing later inside float() or a comparison.
_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
         "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
         "first_k_dense_replace", "num_experts", "num_experts_per_token", "num_shared_experts",
         "moe_intermediate_size", "bos_token_id", "pad_token_id", "model_max_length")
_INTS_OR_NULL = ("q_lora_rank", "num_expert_group", "topk_group")
_LAC_INTS = ("head_dim", "num_heads", "short_conv_kernel_size")
_NUMBERS = ("routed_scaling_factor", "rms_norm_eps")
_BOOLS = ("moe_renormalize", "tie_word_embeddings")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(d: dict, lac: dict) -> None:
    def bad(where: str, v, want: str) -> ConfigError:
        return ConfigError(f"{where} must be {want}, got {json.dumps(v)}")
    for k in _INTS:
        if k in d and not _is_int(d[k]):
            raise bad(f"config.{k}", d[k], "an integer")
    for k in _INTS_OR_NULL:
        if d.get(k) is not None and not _is_int(d[k]):
            raise bad(f"config.{k}", d[k], "an integer or null")
    for k in _LAC_INTS:
        if k in lac and not _is_int(lac[k]):
            raise bad(f"linear_attn_config.{k}", lac[k], "an integer")
    for k in _NUMBERS:
        if k in d and not ((_is_int(d[k]) or isinstance(d[k], float)) and math.isfinite(d[k])):
            raise bad(f"config.{k}", d[k], "a finite number")
    for k in _BOOLS:
        if k in d and not isinstance(d[k], bool):
            raise bad(f"config.{k}", d[k], "true or false")
    eos = d.get("eos_token_id", 0)
    if not (_is_int(eos) or (isinstance(eos, list) and eos and all(_is_int(t) for t in eos))):
        raise bad("config.eos_token_id", eos, "an integer or a non-empty list of integers")


@dataclass(frozen=True)
class KimiConfig:
    vocab_size: int = 163840
    hidden_size: int = 2304
    num_hidden_layers: int = 27
    intermediate_size: int = 9216
    # MLA (full attention, NoPE)
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # KDA (linear attention)
    kda_head_dim: int = 128
    kda_num_heads: int = 32
    conv_kernel_size: int = 4
    kda_layers: tuple[int, ...] = (1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26)  # 1-based
    full_attn_layers: tuple[int, ...] = (4, 8, 12, 16, 20, 24, 27)  # 1-based
    # MoE
    first_k_dense_replace: int = 1
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1024
    moe_renormalize: bool = True
    routed_scaling_factor: float = 2.446
    num_expert_group: int = 1
    topk_group: int = 1
    # misc
    rms_norm_eps: float = 1e-5
    kv_norm_eps: float = 1e-6  # kv_a_layernorm keeps the module default in the original code and in HF
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    tie_word_embeddings: bool = False
    model_max_length: int = 1048576
    name: str = field(default="custom", compare=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> list[str]:
        """Per 0-based layer: 'kda' or 'mla'."""
        kinds = ["?"] * self.num_hidden_layers
        for i in self.kda_layers:
            kinds[i - 1] = "kda"
        for i in self.full_attn_layers:
            kinds[i - 1] = "mla"
        return kinds

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "kda"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "mla"]

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_head_dim * self.kda_num_heads

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> "KimiConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                  "qk_nope_head_dim", "v_head_dim", "kda_head_dim", "kda_num_heads", "conv_kernel_size",
                  "num_experts", "num_experts_per_token", "moe_intermediate_size", "intermediate_size"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"config.{f} must be a positive integer, got {v!r}")
            need(v <= SIZE_LIMITS.get(f, MAX_SIZE), f"config.{f} = {v:,} is past any plausible model "
                 f"(limit {SIZE_LIMITS.get(f, MAX_SIZE):,}): a typo? (a config this size would exhaust memory "
                 f"before any check of its weights could run)")
        need(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0,
             f"config.qk_rope_head_dim must be an integer >= 0, got {self.qk_rope_head_dim!r}")
        need(self.q_lora_rank is None, f"config.q_lora_rank must be null for Kimi-Linear (plain q_proj), got {self.q_lora_rank!r}")
        need(self.num_key_value_heads == self.num_attention_heads,
             f"config.num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads ({self.num_attention_heads})")
        L = self.num_hidden_layers
        for name, ids in (("kda_layers", self.kda_layers), ("full_attn_layers", self.full_attn_layers)):
            bad = [i for i in ids if not isinstance(i, int) or not 1 <= i <= L]
            need(not bad, f"linear_attn_config.{name} holds {bad}: layers are numbered 1..{L} (1-based)")
            need(len(set(ids)) == len(ids), f"linear_attn_config.{name} repeats a layer: {list(ids)}")
        both = set(self.kda_layers) & set(self.full_attn_layers)
        need(not both, f"layers {sorted(both)} are listed both as kda_layers and full_attn_layers")
        missing = sorted(set(range(1, L + 1)) - set(self.kda_layers) - set(self.full_attn_layers))
        need(not missing, f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers")
        need(0 <= self.first_k_dense_replace <= L, f"config.first_k_dense_replace must lie in 0..{L}")
        need(self.num_experts_per_token <= self.num_experts,
             f"num_experts_per_token ({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})")
        need(self.num_expert_group == 1 and self.topk_group == 1,
             f"only num_expert_group = topk_group = 1 (plain top-k) is supported, got {self.num_expert_group}/{self.topk_group}")
        need(self.num_shared_experts in (0, 1), f"num_shared_experts must be 0 or 1, got {self.num_shared_experts}")
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, tok)
            need(isinstance(v, int) and 0 <= v < self.vocab_size, f"config.{tok} = {v!r} lies outside the vocabulary (0..{self.vocab_size - 1})")
        need(self.rms_norm_eps > 0, "config.rms_norm_eps must be > 0")
        need(not self.tie_word_embeddings, "tie_word_embeddings = true is not a Kimi-Linear layout")
        return self

    # ---- original config.json ------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> "KimiConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt != "kimi_linear":
            raise ConfigError(f"config.json model_type is {mt!r}, expected 'kimi_linear'")
        lac = d.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise ConfigError("config.json lacks linear_attn_config (an object with kda_layers, full_attn_layers, head_dim, num_heads)")
        for k in ("kda_layers", "full_attn_layers"):
            if not isinstance(lac.get(k), list):
                raise ConfigError(f"linear_attn_config.{k} must be a list of 1-based layer numbers")
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"moe_router_activation_func {d['moe_router_activation_func']!r} is not supported (sigmoid only)")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
                    "moe_intermediate_size", "intermediate_size")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config.json lacks required fields: {', '.join(missing)}")
        _check_types(d, lac)
        eos = d.get("eos_token_id", 163586)
        if isinstance(eos, list):
            eos = eos[0]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
            intermediate_size=d["intermediate_size"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
            kda_head_dim=lac.get("head_dim", 128), kda_num_heads=lac.get("num_heads", 32),
            conv_kernel_size=lac.get("short_conv_kernel_size", 4),
            kda_layers=tuple(lac["kda_layers"]), full_attn_layers=tuple(lac["full_attn_layers"]),
            first_k_dense_replace=d.get("first_k_dense_replace", 1), num_experts=d["num_experts"],
            num_experts_per_token=d["num_experts_per_token"], num_shared_experts=d.get("num_shared_experts", 1),
            moe_intermediate_size=d["moe_intermediate_size"], moe_renormalize=d.get("moe_renormalize", True),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            num_expert_group=d.get("num_expert_group", 1) or 1, topk_group=d.get("topk_group", 1) or 1,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            bos_token_id=d.get("bos_token_id", 163584), eos_token_id=eos, pad_token_id=d.get("pad_token_id", 163839),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            model_max_length=d.get("model_max_length", 1048576), name=name,
        )
        try:
            cfg = cls(**kw)
        except TypeError as e:  # pragma: no cover - defensive
            raise ConfigError(str(e)) from e
        return cfg.validate()

    @classmethod
    def from_json(cls, path: str | Path) -> "KimiConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(d, name=str(path.parent))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e      # which file, for every caller

    def to_dict(self) -> dict:
        """The original checkpoint's config.json layout (what HF transformers also reads)."""
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "linear_attn_config": {
                "head_dim": self.kda_head_dim,
                "num_heads": self.kda_num_heads,
                "short_conv_kernel_size": self.conv_kernel_size,
                "kda_layers": list(self.kda_layers),
                "full_attn_layers": list(self.full_attn_layers),
            },
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": True,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "model_max_length": self.model_max_length,
            "torch_dtype": "bfloat16",
        }

    def replace(self, **kw) -> "KimiConfig":
        return dataclasses.replace(self, **kw).validate()


PRESETS: dict[str, KimiConfig] = {
    "48b-a3b": KimiConfig(name="48b-a3b").validate(),
    # Runs on a CPU in seconds: 4 layers covering KDA, MLA, the dense MLP (layer 0) and MoE (layers 1..3),
    # 8 experts (top-2), a 512-token vocabulary, chunk-unaligned head sizes kept small.
    "tiny": KimiConfig(
        name="tiny", vocab_size=512, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, kda_head_dim=16, kda_num_heads=4, conv_kernel_size=4,
        kda_layers=(1, 2, 4), full_attn_layers=(3,), first_k_dense_replace=1, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.446,
        bos_token_id=500, eos_token_id=501, pad_token_id=511,
    ).validate(),
}


def get_config(name_or_path: str) -> KimiConfig:
    """A preset name, or a checkpoint directory / config.json path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = Path(name_or_path)
    if p.exists():
        return KimiConfig.from_json(p)
    raise ConfigError(f"unknown preset {name_or_path!r} and no such path; presets: {', '.join(PRESETS)}")

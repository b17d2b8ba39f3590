"""Decode state carried between steps of the incremental path.

Per KDA layer: the fp32 recurrent state [B, H, K, V] and the conv taps (the last W-1 pre-conv inputs of
q|k|v, [B, W-1, 3*H*d]). Per MLA layer: the latent cache, `c` = kv_a_layernorm(c_kv) [B, max_len, R] and the
shared `k_pe` [B, max_len, P]. Buffers are allocated once at their full size so that a decode step never
allocates (what a CUDA graph needs); `length` says how many positions are filled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import KimiConfig


@dataclass
class KDAState:
    state: torch.Tensor  # [B, H, K, V] fp32
    taps: torch.Tensor   # [B, W-1, 3*H*d] model dtype


@dataclass
class MLACache:
    c: torch.Tensor      # [B, max_len, kv_lora_rank]
    k_pe: torch.Tensor   # [B, max_len, qk_rope_head_dim]


@dataclass
class DecodeCache:
    layers: list[KDAState | MLACache]
    max_len: int
    length: int = 0
    # the same position as a device scalar, for graph-captured decode steps (kept in sync by the model)
    pos: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, cfg: KimiConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> "DecodeCache":
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        layers: list[KDAState | MLACache] = []
        for kind in cfg.layer_kinds:
            if kind == "kda":
                layers.append(KDAState(
                    state=torch.zeros(batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim,
                                      dtype=torch.float32, device=device),
                    taps=torch.zeros(batch, cfg.conv_kernel_size - 1, 3 * cfg.kda_dim, dtype=dtype, device=device)))
            else:
                layers.append(MLACache(
                    c=torch.zeros(batch, max_len, cfg.kv_lora_rank, dtype=dtype, device=device),
                    k_pe=torch.zeros(batch, max_len, cfg.qk_rope_head_dim, dtype=dtype, device=device)))
        return cls(layers=layers, max_len=max_len, pos=torch.zeros((), dtype=torch.long, device=device))

    @property
    def batch(self) -> int:
        return next(iter(vars(self.layers[0]).values())).shape[0]

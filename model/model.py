"""Kimi-Linear for causal LM: embedding, decoder layers, final norm, lm_head (logits in fp32).

Three entry points, all greedy-generation building blocks:
- `forward(ids)`: the whole sequence from scratch (the recompute path; no state kept).
- `prefill(ids, cache)`: a span of tokens appended to the decode cache (the prompt, or a chunk of it).
- `decode_step(tokens, cache)`: one token per sequence from the carried state.
"""
from __future__ import annotations

import torch
from torch import nn

from . import ops
from .cache import DecodeCache
from .config import KimiConfig
from .layers import DecoderLayer, RMSNorm


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinear(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        self.model = KimiLinearModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def check_ids(self, ids: torch.Tensor) -> None:
        """Refuse what would otherwise index out of range or compute on nothing."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"token ids must be int32/int64, got {ids.dtype}")
        if ids.numel() == 0 or ids.shape[-1] == 0:
            raise ValueError("empty prompt: at least one token id is needed")
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one host sync, not one per bound
        if lo < 0 or hi >= self.cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} lies outside the vocabulary 0..{self.cfg.vocab_size - 1}")

    def new_cache(self, batch: int, max_len: int) -> DecodeCache:
        return DecodeCache.empty(self.cfg, batch, max_len, self.dtype, self.device)

    def _logits(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The final norm of residual + delta (the last layer's add fused into it), then lm_head."""
        norm = self.model.norm
        h, _ = ops.add_rmsnorm(delta, residual, norm.weight, norm.eps)
        return self.lm_head(h).float()

    def _run_layers(self, ids: torch.Tensor, cache: DecodeCache | None, start: int, last_only: bool) -> torch.Tensor:
        """The layers over ids [B, T] at positions start.., each taking its tokens into its cache layer when a cache
        is given. last_only: the last layer takes only the last position through its attention output and MLP
        (its cache still takes every token; `DecoderLayer.forward`), and only that position's logits come back."""
        h, res = self.model.embed_tokens(ids), None
        layers = self.model.layers
        cache_layers = [None] * len(layers) if cache is None else cache.layers
        for i, (layer, cl) in enumerate(zip(layers, cache_layers)):
            h, res = layer(h, res, cl, start, last_only=last_only and i == len(layers) - 1)
        return self._logits(h[:, -1], res[:, -1]) if last_only else self._logits(h, res)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V] fp32 (or [B, V] with last_only), no state carried."""
        self.check_ids(ids)
        return self._run_layers(ids, None, 0, last_only)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, cache: DecodeCache, last_only: bool = True) -> torch.Tensor:
        """Append ids [B, T] after the cache's `length` positions; returns the logits (last position by default)."""
        self.check_ids(ids)
        start, T = cache.length, ids.shape[1]
        if start + T > cache.max_len:
            raise ValueError(f"cache holds {cache.max_len} positions; {start} used, {T} more asked")
        logits = self._run_layers(ids, cache, start, last_only)
        cache.length += T
        cache.pos.fill_(cache.length)
        return logits

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """tokens [B] at position cache.pos -> logits [B, V] fp32. No host sync: `cache.pos` advances on the
        device, so the step can be captured in a CUDA graph; `cache.length` is the host's copy of it."""
        if cache.length >= cache.max_len:
            raise ValueError(f"decode cache is full ({cache.max_len} positions)")
        if tokens.device.type == "cpu":   # checked where it costs no device sync (on CUDA the embedding asserts)
            self.check_ids(tokens)
        h, res = self.model.embed_tokens(tokens), None
        for layer, cl in zip(self.model.layers, cache.layers):
            h, res = layer.decode(h, res, cl, cache.pos)
        cache.pos += 1
        cache.length += 1
        return self._logits(h, res)

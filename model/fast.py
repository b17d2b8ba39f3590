"""The decode step captured once as a CUDA graph and replayed every token.

At batch 1 a decode step is hundreds of small kernels; launched one by one from Python the CPU, not the
GPU, sets the pace. The model's decode path is written so that it can be captured: static cache buffers,
the position as a device scalar, routing and expert selection on the device (model/triton/moe.py), KDA's
whole decode step in one Triton kernel. This module adds nothing to the math: it records `decode_step` and
replays it.
"""
from __future__ import annotations

import torch

from . import ops
from .cache import DecodeCache
from .model import KimiLinear


class GraphDecoder:
    """Callable like `model.decode_step(tokens, cache)`, bound to one cache (the graph holds its addresses).

    The returned logits live in a static buffer that the next call overwrites: consume or clone them first.
    """

    def __init__(self, model: KimiLinear, cache: DecodeCache, warmup: int = 2):
        if not model.device.type == "cuda":
            raise RuntimeError("GraphDecoder needs the model on a CUDA device")
        if ops.kernels_setting() == "torch":
            raise RuntimeError("GraphDecoder needs the Triton kernels (KIMI_KERNELS=torch makes the MoE sync with the host)")
        self.model, self.cache = model, cache
        batch = cache.batch
        self.tokens = torch.zeros(batch, dtype=torch.long, device=model.device)
        # Warm up on a scratch cache of the same shapes: compiles the Triton kernels and sets up cuBLAS
        # without touching the real state.
        scratch = DecodeCache.empty(model.cfg, batch, cache.max_len, model.dtype, model.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                model.decode_step(self.tokens, scratch)
        torch.cuda.current_stream().wait_stream(side)
        del scratch
        self.graph = torch.cuda.CUDAGraph()
        length = cache.length
        with torch.cuda.graph(self.graph):
            self.logits = model.decode_step(self.tokens, cache)
        cache.length = length  # capture records the step without running it

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        if cache is not self.cache:
            raise ValueError("this GraphDecoder was captured for another cache")
        if cache.length >= cache.max_len:
            raise ValueError(f"decode cache is full ({cache.max_len} positions)")
        self.tokens.copy_(tokens)
        self.graph.replay()
        cache.length += 1
        return self.logits

"""Greedy generation on the two paths, with what the gates need to explain a mismatch.

- recompute: every step re-runs the whole sequence (prompt + tokens so far) through `forward`: O(n^2),
  stateless, the reference the incremental path is held against (Gate A).
- incremental: `prefill` the prompt once into a decode cache, then `decode_step` one token a step from
  the carried state.

Each step keeps the top-k token ids and log-probabilities (fp64, from the fp32 logits), so a gate can
report margins at a divergence; `keep_logits` also keeps the full logits rows for max |diff| reports.
"""
from __future__ import annotations

import numbers

from dataclasses import dataclass, field

import torch

from . import ops
from .model import KimiLinear

PATHS = ("recompute", "incremental")


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)   # per step [V] fp32, only with keep_logits
    decoder: str = ""                                           # what ran the decode steps
    top_logits: list[float] = field(default_factory=list)       # per step, the chosen token's logit


def _record(gen: Generation, logits: torch.Tensor, topk: int, keep_logits: bool) -> int:
    """Greedy choice from logits [V]; keeps the top-k. Ties go to the lowest id (torch.argmax's rule)."""
    tok = int(torch.argmax(logits))
    lp = torch.log_softmax(logits.double(), dim=-1)
    top = torch.topk(lp, topk)
    gen.tokens.append(tok)
    gen.topk_ids.append(top.indices.tolist())
    gen.topk_logprobs.append(top.values.tolist())
    gen.top_logits.append(float(logits[tok]))
    if keep_logits:
        gen.logits.append(logits.detach().float().cpu())
    return tok


def _check(model: KimiLinear, prompt, new_tokens: int) -> torch.Tensor:
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    ids = torch.as_tensor(prompt_ids(prompt), dtype=torch.long, device=model.device)[None]
    model.check_ids(ids)
    return ids


def prompt_ids(prompt) -> list[int]:
    """A prompt of token ids (a sequence of ints, or a 1-D integer tensor) as a list; anything else refused by
    name, not cast: a float id is no id (1.7 would have become 1), a bool no token, text not yet tokenised."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise TypeError(f"token ids must be integers, got a {prompt.dtype} tensor")
        if prompt.dim() != 1:
            raise ValueError(f"a prompt is one sequence of token ids (1-D), got shape {tuple(prompt.shape)}")
        return prompt.tolist()
    if isinstance(prompt, (str, bytes)):
        raise TypeError("a prompt is token ids, got text: tokenise it first (model/tokenizer.py)")
    ids = list(prompt)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"token ids must be integers, got {t!r} at position {i}")
    return [int(t) for t in ids]


@torch.no_grad()
def generate_recompute(model: KimiLinear, prompt, new_tokens: int, topk: int = 10,
                       keep_logits: bool = False, step_hook=None) -> Generation:
    ids = _check(model, prompt, new_tokens)
    gen = Generation(prompt=ids[0].tolist())
    for _ in range(new_tokens):
        tok = _record(gen, model(ids, last_only=True)[0], topk, keep_logits)
        ids = torch.cat([ids, ids.new_tensor([[tok]])], dim=1)
        if step_hook:
            step_hook()
    return gen


def uses_graph(model: KimiLinear) -> bool:
    """The fast path on CUDA: decode steps replayed from a CUDA graph (needs the Triton kernels)."""
    return model.device.type == "cuda" and ops.kernels_setting() != "torch"


@torch.no_grad()
def generate_incremental(model: KimiLinear, prompt, new_tokens: int, topk: int = 10,
                         keep_logits: bool = False, step_hook=None, cache=None, decode=None) -> Generation:
    """`decode` replaces the decode step: by default a CUDA-graph replay of `model.decode_step` on CUDA
    (model/fast.py), the eager step elsewhere."""
    ids = _check(model, prompt, new_tokens)
    gen = Generation(prompt=ids[0].tolist())
    if cache is None:
        cache = model.new_cache(1, ids.shape[1] + new_tokens)
    if decode is None and uses_graph(model) and new_tokens > 1:
        from .fast import GraphDecoder
        decode = GraphDecoder(model, cache)
    decode = decode or model.decode_step
    gen.decoder = getattr(decode, "__qualname__", type(decode).__name__)
    tok = _record(gen, model.prefill(ids, cache)[0], topk, keep_logits)
    for _ in range(new_tokens - 1):
        if step_hook:
            step_hook()
        tok = _record(gen, decode(ids.new_tensor([tok]), cache)[0], topk, keep_logits)
    return gen


def generate(model: KimiLinear, prompt, new_tokens: int, path: str = "incremental", **kw) -> Generation:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    fn = generate_recompute if path == "recompute" else generate_incremental
    return fn(model, prompt, new_tokens, **kw)

"""Planted errors on the decode path: the instrument behind Gate A's detection curve and its negative controls.

`planted(site, rel)` wraps one of the model's hot ops so that, inside `decode_step` only, its output carries a
relative error of `rel` in every element, with alternating signs along the last dimension (x * (1 + rel * s),
s = +1, -1, +1, ...). Alternating signs keep the error from being a uniform scale, which a following norm would
remove. The prefill and the recompute path are untouched, so Gate A compares a wrong incremental path against a
right reference. The perturbation is plain tensor arithmetic, so it is captured with the step in a CUDA graph.
"""
from __future__ import annotations

import contextlib

import torch

from model import ops
from model.model import KimiLinear

# The kinds of kernel on the decode path, and the op of `model.ops` that computes each.
SITES = {
    "kda_step": "kda_decode_step",          # KDA: conv, gate, state update and gated output norm, fused
    "mla_attention": "mla_decode_attention",  # MLA: attention over the latent cache
    "moe_experts": "moe",                   # MoE: routed and shared experts with the combine
    "norm": "add_rmsnorm",                  # residual add + RMSNorm (every layer's two, and the final one)
}

_in_decode = False


def _perturb(x: torch.Tensor, rel: float) -> torch.Tensor:
    sign = 1.0 - 2.0 * (torch.arange(x.shape[-1], device=x.device) % 2).to(x.dtype)
    return x * (1 + rel * sign)


@contextlib.contextmanager
def planted(site: str, rel: float):
    """Inside the block, `site`'s output in every decode step carries relative error `rel` (module docstring)."""
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; expected one of {', '.join(SITES)}")
    if not 0 < rel < 1:
        raise ValueError(f"a planted relative error must lie in (0, 1), got {rel!r}")
    name = SITES[site]
    op, step = getattr(ops, name), KimiLinear.decode_step

    def wrapped(*args, **kwargs):
        out = op(*args, **kwargs)
        if not _in_decode:
            return out
        if isinstance(out, tuple):          # add_rmsnorm: (normed, residual); only the normed output is wrong
            return (_perturb(out[0], rel), *out[1:])
        return _perturb(out, rel)

    def decode_step(self, *args, **kwargs):
        global _in_decode
        prev, _in_decode = _in_decode, True
        try:
            return step(self, *args, **kwargs)
        finally:
            _in_decode = prev

    setattr(ops, name, wrapped)
    KimiLinear.decode_step = decode_step
    try:
        yield
    finally:
        setattr(ops, name, op)
        KimiLinear.decode_step = step

"""RMS norms in plain PyTorch (the references for the Triton norm kernels)."""
from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x * rsqrt(mean(x^2) + eps)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back to x's dtype, then scale by `weight` (HF's KimiLinearRMSNorm order)."""
    return weight * rms_normalize(x, eps).to(x.dtype)


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: rmsnorm(o) * weight * sigmoid(gate), all in fp32, cast to o's dtype."""
    return (rms_normalize(o, eps) * weight.float() * torch.sigmoid(gate.float())).to(o.dtype)

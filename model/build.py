"""Build a model from an internal state dict, a checkpoint directory, or a preset's synthetic weights."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import KimiConfig, get_config, PRESETS
from .model import KimiLinear


def from_state_dict(cfg: KimiConfig, state: dict[str, torch.Tensor]) -> KimiLinear:
    """Wrap the given tensors without copying them (modules are built on the meta device, then assigned)."""
    with torch.device("meta"):
        model = KimiLinear(cfg)
    expected = set(model.state_dict())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(f"state dict does not fit the config: missing {missing[:10]} ({len(missing)}), "
                         f"unexpected {extra[:10]} ({len(extra)})")
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


@dataclass
class Loaded:
    model: KimiLinear
    cfg: KimiConfig
    source: str          # 'synthetic:<preset>:seed=<n>' or the checkpoint path
    fingerprint: str


def load_model(preset: str | None = None, checkpoint: str | None = None, *, device="cpu",
               dtype=torch.float32, seed: int = 0) -> Loaded:
    """Exactly one of `preset` (synthetic weights) or `checkpoint` (original-format directory)."""
    from .checkpoint import load_checkpoint
    from .weights import fingerprint, synthetic_weights
    if (preset is None) == (checkpoint is None):
        raise ValueError("give exactly one of preset= or checkpoint=")
    if checkpoint is not None:
        cfg, state = load_checkpoint(checkpoint, device=device, dtype=dtype)
        source = str(checkpoint)
    else:
        cfg = get_config(preset)
        state = synthetic_weights(cfg, seed=seed, device=device, dtype=dtype)
        source = f"synthetic:{preset}:seed={seed}"
    return Loaded(from_state_dict(cfg, state), cfg, source, fingerprint(state))

"""Build a model from an internal state dict, a checkpoint directory, or a preset's synthetic weights."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .checkpoint import internal_names, load_checkpoint
from .config import KimiConfig, get_config
from .layers import KimiDeltaAttention, MultiLatentAttention, Router
from .model import KimiLinear
from .parallel import ExpertParallel, load_checkpoint_shard, shard_
from .parallel import weights_id as parallel_weights_id
from .weights import synthetic_weights, weights_id

SMALL_MODEL_BYTES = 1 << 30  # synthetic weights below this (in bf16) are drawn on the CPU, then moved


def from_state_dict(cfg: KimiConfig, state: dict[str, torch.Tensor], ep: ExpertParallel | None = None) -> KimiLinear:
    """Wrap the given tensors (modules are built on the meta device, then assigned). With `ep` (more than one rank),
    the routed expert stacks of `state` hold that rank's experts alone (`model.parallel`).

    Every tensor is used as it is, not copied, except the projections that `KimiDeltaAttention.pack_` (q/k/v,
    f_a/f_b, g_a/g_b, b_proj) and `MultiLatentAttention.pack_` (q_proj, kv_a_proj_with_mqa) pack: those are
    copied into packed buffers, so the model does not see later writes to the caller's tensors of those names,
    and they cost memory (~1.4 GB for the 48B model in bf16) until the caller drops them. `model.state_dict()` gives the model's own tensors (views of the packed
    buffers), with the same names, shapes and values.
    """
    with torch.device("meta"):
        model = KimiLinear(cfg)
        if ep is not None:
            shard_(model, ep)
    expected = set(model.state_dict())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(f"state dict does not fit the config: missing {missing[:10]} ({len(missing)}), "
                         f"unexpected {extra[:10]} ({len(extra)})")
    model.load_state_dict(state, assign=True, strict=True)
    for m in model.modules():
        if isinstance(m, (KimiDeltaAttention, MultiLatentAttention, Router)):
            m.pack_()
    return model.eval().requires_grad_(False)


def is_small(cfg: KimiConfig) -> bool:
    """Under 1 GiB in bf16: drawn on the CPU (and run on one CPU thread by the gates)."""
    return 2 * sum(torch.Size(shape).numel() for shape, _ in internal_names(cfg).values()) < SMALL_MODEL_BYTES


@dataclass
class Loaded:
    model: KimiLinear
    cfg: KimiConfig
    source: str          # 'synthetic:<preset>:seed=<n>' or the checkpoint path
    weights: str         # model.weights.weights_id: the same for any dtype of the same weights
    load_s: float


def load_model(preset: str | None = None, checkpoint: str | None = None, *, device="cpu",
               dtype=torch.float32, seed: int = 0, expert_dtype: torch.dtype | None = None,
               ep: ExpertParallel | None = None) -> Loaded:
    """Exactly one of `preset` (synthetic weights) or `checkpoint` (original-format directory).

    `expert_dtype` holds the routed experts apart from `dtype` (`model.checkpoint.ROUTED_EXPERTS`): bf16 under an
    fp32 model computes the 48B model in fp32 on one GPU.

    Small presets are drawn on the CPU and moved, so they are the same weights on every device (CPU and CUDA
    generators differ) and the committed CPU goldens also judge GPU runs; larger ones are drawn on the device.

    `ep` (expert parallelism, `model.parallel`; world 1 is the one-process model): this rank's share alone is drawn
    or read, its routed experts and everything else; the weights id is the whole model's (a collective: every rank
    loads at once).
    """
    if (preset is None) == (checkpoint is None):
        raise ValueError("give exactly one of preset= or checkpoint=")
    ep = None if ep is None or ep.world == 1 else ep
    t0 = time.perf_counter()
    if checkpoint is not None:
        if ep is None:
            cfg, state = load_checkpoint(checkpoint, device=device, dtype=dtype, expert_dtype=expert_dtype)
        else:
            cfg, state = load_checkpoint_shard(checkpoint, ep, device=device, dtype=dtype, expert_dtype=expert_dtype)
        source = str(checkpoint)  # as the caller named it: a record keeps no path the user did not give
    else:
        cfg = get_config(preset)
        state = synthetic_weights(cfg, seed=seed, device="cpu" if is_small(cfg) else device, dtype=dtype,
                                  expert_dtype=expert_dtype, shard=ep)
        state = {n: t.to(device) for n, t in state.items()}
        source = f"synthetic:{preset}:seed={seed}"
    model = from_state_dict(cfg, state, ep)
    del state  # its KDA projections were copied into packed buffers: let them go
    wid = weights_id(model.state_dict(), cfg) if ep is None else parallel_weights_id(model.state_dict(), cfg, ep)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # NVML (the memory floor) sees the freed copies as used while they stay cached
    return Loaded(model, cfg, source, wid, time.perf_counter() - t0)

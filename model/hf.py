"""HF transformers' KimiLinearForCausalLM as the independent implementation (oracle, golden source, peer).

Two ways in: `hf_from_checkpoint(dir)` loads an original-format checkpoint through HF's own conversion
mapping (the real, independent route: our writer -> their loader); `hf_from_state_dict(cfg, state)` wraps
our in-memory tensors without copying them (same parameter names), for the GPU peer where a second copy of
91 GiB does not fit. Neither path ever executes code from a checkpoint directory (no trust_remote_code).
"""
from __future__ import annotations

import torch

from .config import KimiConfig


def _hf():
    try:
        import transformers
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("HF transformers with KimiLinear (>= 5.x) is needed for the oracle/peer") from e
    return transformers, KimiLinearConfig, KimiLinearForCausalLM


def hf_config(cfg: KimiConfig):
    _, KimiLinearConfig, _ = _hf()
    return KimiLinearConfig.from_dict(cfg.to_dict())


def hf_from_checkpoint(path, dtype=torch.float32, device="cpu", attn="eager"):
    _, _, KimiLinearForCausalLM = _hf()
    model = KimiLinearForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn,
                                                  trust_remote_code=False)
    return model.to(device).eval()


def hf_from_state_dict(cfg: KimiConfig, state: dict[str, torch.Tensor], attn="sdpa"):
    _, _, KimiLinearForCausalLM = _hf()
    hcfg = hf_config(cfg)
    hcfg._attn_implementation = attn
    with torch.device("meta"):
        model = KimiLinearForCausalLM(hcfg)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


def hf_version() -> str:
    transformers, _, _ = _hf()
    return transformers.__version__


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int, topk: int = 10):
    """HF `generate` (greedy, its own cache) -> (tokens, topk_ids, topk_logprobs) per step."""
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, num_beams=1, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=model.config.pad_token_id, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    ids_k, lps_k = [], []
    for step_logits in out.logits:
        lp = torch.log_softmax(step_logits[0].double(), dim=-1)
        top = torch.topk(lp, topk)
        ids_k.append(top.indices.tolist())
        lps_k.append(top.values.tolist())
    return tokens, ids_k, lps_k

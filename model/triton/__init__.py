"""Triton kernels for Kimi-Linear, forward only, each held against a torch reference by tests/test_triton_kda.py.

- `kda_chunk.chunk_kda_fwd`: chunked KDA prefill, the twin of `model.kda.chunk_kda`.
- `kda_decode.fused_kda_decode`: one decode step (conv, gate, beta, L2 norm, state update, output and
  optionally the gated output norm) in one launch, the twin of `causal_conv1d` + `kda_gate` +
  sigmoid + `recurrent_kda_step`.
- `norms.rmsnorm`, `norms.gated_rmsnorm`, `norms.add_rmsnorm`: HF's KimiLinearRMSNorm(Gated).
- `mla_decode.mla_decode`: MLA decode attention over the latent cache, split-K with a combine (the twin of
  `model.ops.mla_decode_attention_torch`); `mla_decode.mla_absorb`: the absorbed up-projections in fp32
  (held against fp64 by tests/test_triton_mla.py).
- `conv.causal_conv1d`: the short causal conv + SiLU over a prefill span, the twin of `model.kda.causal_conv1d`.
- `moe_dispatch.moe_dispatch`, `moe_combine.moe_combine`: the grouped-GEMM MoE's dispatch (token rows in expert
  order) and combine, the twins of `model.ops.moe_dispatch_torch` and `model.ops.moe_combine_torch`.
- `act.silu_mul`: SwiGLU's silu(gate) * up in one pass, the twin of `F.silu(g) * u`.
- `moe_grouped.gate_up_silu`, `moe_grouped.down`: the prefill MoE's grouped expert GEMMs (gate_up with the dispatch and SwiGLU fused in), held against `model.ops.moe_experts_torch` and torch's grouped GEMM; the model uses those `CONFIG["use"]` names, none by default.

Triton chooses compiled (CUDA) or interpreted (CPU) kernels when a kernel module is first imported,
from TRITON_INTERPRET (read by triton): set it to 1 before that import to run them on the CPU.
"""
import torch


def empty(*shape, dtype, device):
    """Every buffer a kernel writes is allocated here, so tests can poison them all with NaN."""
    return torch.empty(*shape, dtype=dtype, device=device)


def rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as rows of n with contiguous columns, for kernels that take a row stride: a view when x's rows are
    evenly spaced (a column slice of a wider tensor is, e.g. one half of a gate|up output or MLA's latent c
    in the kv_a projection), else a copy."""
    x = x.reshape(-1, n)
    return x if x.stride(1) == 1 else x.contiguous()


# Buffers that kernels share across launches, made once per device and never replaced (a captured CUDA graph keeps
# their addresses), large enough for any batch; one launch of the kernels that use one at a time per device.
# - arrival counters (`arrival_counters`) of the kernels whose last program to finish completes the work (the KDA
#   decode step, the fused MoE router): int32 zeros that such a program puts back to 0, so every launch, CUDA-graph
#   replays included, finds them at 0;
# - the fused MoE router's logits (`model.triton.moe.fused_router`), which must outlive the call (see there).
ARRIVAL_COUNTERS = 1 << 16
_kept: dict[tuple[str, torch.device], torch.Tensor] = {}


def kept_buffer(name: str, device: torch.device, n: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """The device's `name` buffer of `size` zeros (made on first use, then the same tensor), of which n are needed."""
    if n > size:
        raise ValueError(f"{n} {name} asked for; the buffer holds {size}")
    buf = _kept.get((name, device))
    if buf is None:
        buf = _kept[(name, device)] = torch.zeros(size, dtype=dtype, device=device)
    return buf


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    return kept_buffer("arrival counters", device, n, ARRIVAL_COUNTERS, torch.int32)


class UnknownConfigKeys(ValueError, KeyError):
    """A launch-config override naming keys the defaults lack, or giving a value of another kind than the default's
    (a ValueError to kernels' callers, a KeyError to those that look keys up, as `benchmarks.bench_ab` does)."""

    def __str__(self) -> str:   # KeyError's str() quotes its message
        return str(self.args[0]) if self.args else ""


def _kind(v) -> str:
    """What an override must match its default in: a count is no flag, a name no count ("eight" for 8)."""
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, (int, float)):
        return "a number"
    return {str: "a name", tuple: "a list", list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def launch_config(name: str, defaults: dict, cfg: dict | None) -> dict:
    """A kernel's launch config: its module's defaults with `cfg`'s overrides (a benchmark sweep's, a model-level
    A/B's); a default that is itself a dict (one kernel's tiles among several) takes an override's keys one by one,
    so an override names only what it changes. An unknown key, at either level, or a value of another kind than
    its default's (a default or an override of None matches anything), is an error, not a silent no-op."""
    def check(where: str, defaults: dict, cfg: dict) -> None:
        unknown = sorted(set(cfg) - set(defaults))
        if unknown:
            raise UnknownConfigKeys(f"{where}: unknown cfg keys {unknown}; its keys: {sorted(defaults)}")
        for k, v in cfg.items():
            if defaults[k] is not None and v is not None and _kind(v) != _kind(defaults[k]):
                raise UnknownConfigKeys(f"{where}: {k!r} must be {_kind(defaults[k])} as its default "
                                        f"{defaults[k]!r} is, got {v!r}")
    cfg = cfg or {}
    check(name, defaults, cfg)
    out = {**defaults, **cfg}
    for k, v in cfg.items():
        if isinstance(defaults[k], dict) and isinstance(v, dict):
            check(f"{name}[{k!r}]", defaults[k], v)
            out[k] = {**defaults[k], **v}
    return out


def compiled(kernel) -> bool:
    """Whether Triton compiles `kernel` (for the GPU) rather than interpreting it (TRITON_INTERPRET=1)."""
    return type(kernel).__name__ != "InterpretedFunction"


def pdl_capable(kernel, device: torch.device) -> bool:
    """Whether `kernel` can take part in programmatic dependent launch (griddepcontrol) on `device`: compiled, on
    CUDA (the interpreter has no griddepcontrol)."""
    return device.type == "cuda" and compiled(kernel)


def require_runnable(kernel, device: torch.device) -> None:
    """Clear error instead of a Triton crash when a compiled kernel is handed CPU tensors."""
    if device.type != "cuda" and compiled(kernel):
        raise RuntimeError(f"model.triton kernels need CUDA tensors, got {device}; for CPU runs set "
                           "TRITON_INTERPRET=1 before model.triton's kernel modules are first imported")

"""Triton kernels for Kimi-Linear, forward only, each the twin of a torch reference in `model.kda` or `model.ops`
and held to it by tests/test_triton_*.py; design notes in docs/kernels.md. Triton compiles them (CUDA) or interprets
them (CPU) by TRITON_INTERPRET as it stands when a kernel module is first imported.
"""
import torch


def empty(*shape, dtype, device):
    """Every buffer a kernel writes is allocated here, so tests can poison them all with NaN."""
    return torch.empty(*shape, dtype=dtype, device=device)


def rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as rows of n with contiguous columns: a view when the rows are evenly spaced (a column slice's are), else a
    copy."""
    x = x.reshape(-1, n)
    return x if x.stride(1) == 1 else x.contiguous()


# Buffers kernels share across launches (arrival counters, the MoE router's logits), made once per device and never
# replaced, so a captured CUDA graph keeps their addresses; one launch of their kernels at a time per device.
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
    """A launch-config override naming unknown keys or values of another kind than the default's (a ValueError to
    kernels' callers, a KeyError to those that look keys up)."""

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
    """A kernel's launch config: its module's defaults with `cfg`'s overrides (a sweep's, an A/B's); a dict default
    takes an override's keys one by one. An unknown key, or a value of another kind than its default's (None
    matches anything), is an error, not a silent no-op."""
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
    """Whether `kernel` can take part in programmatic dependent launch on `device`: compiled, on CUDA."""
    return device.type == "cuda" and compiled(kernel)


def require_runnable(kernel, device: torch.device) -> None:
    """Clear error instead of a Triton crash when a compiled kernel is handed CPU tensors."""
    if device.type != "cuda" and compiled(kernel):
        raise RuntimeError(f"model.triton kernels need CUDA tensors, got {device}; for CPU runs set "
                           "TRITON_INTERPRET=1 before model.triton's kernel modules are first imported")

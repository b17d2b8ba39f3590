"""Triton kernels for Kimi-Linear, forward only, each the twin of a torch reference in `model.kda` or `model.ops`
and held to it by tests/test_triton_*.py; design notes in docs/kernels.md. Triton compiles them (CUDA) or interprets
them (CPU) by TRITON_INTERPRET as it stands when a kernel module is first imported.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import sys
import types
from collections.abc import Iterator, Mapping

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


def frozen(values: Mapping) -> Mapping:
    """A read-only copy of a launch config, its nested configs too."""
    return types.MappingProxyType({k: frozen(v) if isinstance(v, Mapping) else v for k, v in values.items()})


def plain(values: Mapping) -> dict:
    """A launch config as plain dicts, its nested configs too (what a JSON record holds)."""
    return {k: plain(v) if isinstance(v, Mapping) else v for k, v in values.items()}


# The launch configs changed in this context by `overrides`: "module.NAME" -> the whole config as it reads there.
# A ContextVar, so a change is seen by this thread (or task) alone and undone exactly by the block that made it.
_scoped: contextvars.ContextVar[Mapping[str, Mapping]] = contextvars.ContextVar(
    "launch_config_overrides", default=types.MappingProxyType({}))


class LaunchConfig(Mapping):
    """A kernel module's launch config, `key` its "module.NAME" in this package: a read-only mapping that reads as its
    defaults, or as an enclosing `overrides` block changed them. Kernels take a `cfg` argument for a change of one
    call; nothing writes the module's config."""
    __slots__ = ("key", "defaults")

    def __init__(self, key: str, **defaults) -> None:
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "defaults", frozen(defaults))

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"launch config {self.key} is read-only: pass cfg= to the kernel, or change it inside "
                             f"model.triton.overrides")

    def __setitem__(self, k, value) -> None:
        raise TypeError(f"launch config {self.key} is read-only: pass cfg= to the kernel, or change it inside "
                        f"model.triton.overrides")

    def __delitem__(self, k) -> None:
        self.__setitem__(k, None)

    def current(self) -> Mapping:
        return _scoped.get().get(self.key, self.defaults)

    def __getitem__(self, k):
        return self.current()[k]

    def __iter__(self) -> Iterator:
        return iter(self.current())

    def __len__(self) -> int:
        return len(self.current())

    def __repr__(self) -> str:
        return f"LaunchConfig({self.key!r}, {plain(self.current())})"


class _KernelModule(types.ModuleType):
    """A kernel module whose `LaunchConfig` globals cannot be rebound or deleted from outside it."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(self.__dict__.get(name), LaunchConfig):
            raise AttributeError(f"{self.__name__}.{name} is a launch config: pass cfg= to the kernel, or change it "
                                 f"inside model.triton.overrides")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if isinstance(self.__dict__.get(name), LaunchConfig):
            raise AttributeError(f"{self.__name__}.{name} is a launch config and cannot be deleted")
        super().__delattr__(name)


def seal(module_name: str) -> None:
    """The last line of a kernel module: its launch configs can no longer be rebound from outside. A copy loaded under
    another name and not in sys.modules (`benchmarks.bench_ab`'s code arms) stays as it is."""
    mod = sys.modules.get(module_name)
    if mod is not None:
        mod.__class__ = _KernelModule


def _kind(v) -> str:
    """What an override must match its default in: a count is no flag, a name no count ("eight" for 8)."""
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, Mapping):
        return "an object"
    return {str: "a name", tuple: "a list", list: "a list"}.get(type(v), type(v).__name__)


def launch_config(name: str, defaults: Mapping, cfg: Mapping | None) -> dict:
    """A kernel's launch config as a plain dict: `defaults` (a `LaunchConfig` reads as the enclosing `overrides` set
    it) with `cfg`'s overrides (a sweep's, an A/B's), which win; a nested config takes an override's keys one by one.
    An unknown key, or a value of another kind than its default's (None matches anything), is an error, not a silent
    no-op."""
    def check(where: str, defaults: dict, cfg: Mapping) -> None:
        if not isinstance(cfg, Mapping):
            raise UnknownConfigKeys(f"{where}: overrides must be an object of keys to change, got {cfg!r}")
        unknown = sorted(set(cfg) - set(defaults))
        if unknown:
            raise UnknownConfigKeys(f"{where}: unknown cfg keys {unknown}; its keys: {sorted(defaults)}")
        for k, v in cfg.items():
            if defaults[k] is not None and v is not None and _kind(v) != _kind(defaults[k]):
                raise UnknownConfigKeys(f"{where}: {k!r} must be {_kind(defaults[k])} as its default "
                                        f"{defaults[k]!r} is, got {v!r}")
    base = plain(defaults.current() if isinstance(defaults, LaunchConfig) else defaults)
    cfg = cfg or {}
    check(name, base, cfg)
    out = {**base, **cfg}
    for k, v in cfg.items():
        if isinstance(base[k], dict) and isinstance(v, Mapping):
            check(f"{name}[{k!r}]", base[k], v)
            out[k] = {**base[k], **v}
    return out


def _named(key: str) -> LaunchConfig:
    """The launch config "module.NAME" of this package's kernel modules, or UnknownConfigKeys."""
    module, _, attr = key.rpartition(".")
    full = f"{__name__}.{module}"
    mod = None
    if module:
        try:
            mod = importlib.import_module(full)
        except ModuleNotFoundError as e:
            if e.name != full:
                raise
    cfg = getattr(mod, attr, None)
    if not isinstance(cfg, LaunchConfig) or cfg.key != key:
        raise UnknownConfigKeys(f"overrides: {key!r} names no launch config of {__name__} (a kernel module's "
                                f"'module.NAME', e.g. 'kda_chunk.CONFIG')")
    return cfg


@contextlib.contextmanager
def overrides(changes: Mapping[str, Mapping]) -> Iterator[None]:
    """Inside the block, in this thread or task, each launch config named ("module.NAME": its keys to change, a nested
    config's changed key by key) reads as changed, for every kernel launched, a CUDA graph captured or a model run
    there; on leaving, also by an exception, it reads as before. A kernel's `cfg` argument still wins. Checked as
    `launch_config` checks a cfg, before the block runs; blocks nest, the inner changing the outer's config."""
    scoped = dict(_scoped.get())
    for key, cfg in changes.items():
        scoped[key] = frozen(launch_config(key, _named(key), cfg))
    token = _scoped.set(types.MappingProxyType(scoped))
    try:
        yield
    finally:
        _scoped.reset(token)


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

"""The kernel benchmarks, one `Bench` per op of `--ops`, in the order the runner runs them: the vs-peer cases first
(each a summarised record per size), then the benches that write their own records. The command line's ops, their
default, the size and sweep options and the summary's targets all come from here.

    from benchmarks.kernels.registry import REGISTRY
    REGISTRY["chunk_kda"].sizes.default        # (1024, 8192, 32768)
"""
from __future__ import annotations

from benchmarks.kernels import (causal_conv1d, chunk_kda, kda_decode_step, mla_absorb, mla_decode, mla_decode_layout,
                                mla_decode_rows, moe_combine, moe_decode, moe_prefill, moe_prefill_rows)
from benchmarks.kernels.spec import Bench, Size, Sweep

__all__ = ["Bench", "Size", "Sweep", "REGISTRY", "DEFAULT_OPS", "cases", "studies", "size_options", "sweep_options"]

REGISTRY: dict[str, Bench] = {b.op: b for b in (
    chunk_kda.BENCH, kda_decode_step.BENCH, mla_decode.BENCH,
    causal_conv1d.BENCH, moe_combine.BENCH, moe_prefill.BENCH,
    mla_absorb.BENCH, mla_decode_layout.BENCH, mla_decode_rows.BENCH, moe_prefill_rows.BENCH, moe_decode.BENCH)}

DEFAULT_OPS: tuple[str, ...] = tuple(op for op, b in REGISTRY.items() if b.default)


def cases() -> list[list[Bench]]:
    """The benches with a vs-peer case, in registry order, in groups: neighbours that share a size option form one
    group, which runs size by size (every op of the group at one size, then the next size)."""
    groups: list[list[Bench]] = []
    for b in REGISTRY.values():
        if b.case is None:
            continue
        if groups and groups[-1][0].sizes is b.sizes:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def studies() -> list[Bench]:
    """The benches that write their own records, in registry order."""
    return [b for b in REGISTRY.values() if b.study is not None]


def size_options() -> list[Size]:
    """Each size option once, in registry order."""
    seen: list[Size] = []
    for b in REGISTRY.values():
        if b.sizes.flag is not None and all(s.flag != b.sizes.flag for s in seen):
            seen.append(b.sizes)
    return seen


def sweep_options() -> list[tuple[str, Sweep]]:
    """(op, sweep) for each sweep that a command-line flag turns on, in registry order."""
    return [(b.op, b.sweep) for b in REGISTRY.values() if b.sweep is not None and b.sweep.flag is not None]

"""Kernel-name categories for the decode decomposition, and the time arithmetic over profiler events.

`categorize(name)` maps a CUDA kernel name, as the PyTorch profiler reports it (demangled C++ names,
Triton kernel names), to one category by the ordered table below: the first pattern that matches
wins. The order is deliberate: project-specific names come before the generic library ones, because
library names leak into them (fla's and flash-attention's kernels are cutlass templates, an expert
kernel may be a "gemv", a Triton cast kernel is also "pointwise").

`decompose(events, steps)` turns the GPU kernel events of `steps` decode steps into the figures a
`decomposition` record carries: per-category shares of kernel time and of exclusive time (below), the GPU idle
fraction between kernels, and the time per step.

Exclusive time: kernels overlap when one is launched early (PDL: the MoE router and gate_up start while the kernel
before them runs, and wait inside), so a kernel's own duration counts its waiting too and the durations sum past
the busy time. `exclusive_lengths` gives every instant of busy time to one kernel, the earliest-started of those
running then: a launch that starts early gets only the time after the kernels it overlaps have ended. Exclusive
times sum to the busy time.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable

CATEGORIES: tuple[tuple[str, str], ...] = (
    # (category, pattern); searched case-insensitively, first match wins.
    # Our Triton KDA kernels (kda_*) and fla's (chunk_kda*, fused_recurrent*, the gated delta rule
    # they are built on); the short causal conv belongs to the KDA layer too.
    ("kda", r"kda|fused_recurrent|gated_delta_rule|causal_conv1d"),
    # MLA: our mla_* kernels, flash-attention / SDPA (fmha_cutlass* must not fall into gemm; cuDNN's SDPA kernels,
    # cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma*, must not fall into other), softmax.
    ("mla_attention", r"mla_|fmha|flash_fwd|flash_fprop|flash_attn|sdpa|softmax"),
    # Router glue: our moe_route*, the sigmoid router, torch.topk (sbtopk/mbtopk) and the sorts behind it.
    ("moe_routing", r"moe_route|sigmoid\w*rout|topk|top_k|sort"),
    # Expert work: the decode experts, the prefill's grouped GEMMs (moe_grouped_*) and the dispatch and combine
    # around them.
    ("moe_experts", r"moe_expert|fused_moe|moe_grouped|moe_dispatch|moe_combine"),
    # cuBLAS / cutlass / nvjet matmuls, incl. cuBLAS's split-K reduction that belongs to its GEMM; on a CPU (the
    # smoke run's leaf operators) ATen's matmul operators.
    ("gemm", r"gemv|gemm|cutlass|xmma|nvjet|splitkreduce|^aten::(?:addmm|baddbmm|bmm|mm|matmul|linear|einsum)$"),
    ("norm", r"rms_?norm|layer_?norm|l2_?norm|group_?norm"),
    # Explicit casts (aten::_to_copy, Triton `convert`), PyTorch's dtype-converting copies
    # (bfloat16_copy_kernel_cuda, bfloat16tofloat32_copy_kernel_cuda, ...) and its dynamic-casting
    # elementwise kernels (LoadWithCast/StoreWithCast when contiguous, a lambda of `gpu_kernel_impl<`
    # when strided): those exist only because operand dtypes differ, which is what the seed's "CastBf16"
    # share measured. Not casts: "broadcast", and PyTorch's same-dtype paths `gpu_kernel_impl_nocast`
    # and LoadWithoutCast (every strided silu, mul or copy kernel is named so).
    ("cast", r"to_copy|(?<!broad)(?<!no)(?<!without)cast|convert|gpu_kernel_impl<|float\d+\w*_copy_kernel"),
    # Same-dtype device copies (contiguous(), index copies) and fills are memcpy/memset in kernel form.
    ("memcpy", r"memcpy|memset|direct_copy|copy_kernel|fillfunctor"),
    ("elementwise", r"elementwise|triton_poi|pointwise|silu_mul"),
    ("reduction", r"reduce|reduction|triton_red|triton_per"),
)
OTHER = "other"
CATEGORY_NAMES: tuple[str, ...] = tuple(c for c, _ in CATEGORIES) + (OTHER,)

_COMPILED = tuple((cat, re.compile(pat, re.IGNORECASE)) for cat, pat in CATEGORIES)


def categorize(name: str) -> str:
    """The category of one kernel name; `other` when no pattern matches."""
    if not isinstance(name, str):
        raise TypeError(f"kernel name must be a str, got {type(name).__name__}: {name!r}")
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return OTHER


def exclusive_lengths(intervals: list[tuple[float, float]]) -> list[float]:
    """Per (start, end) interval, the time in which it is the earliest-started of the intervals running (ties: the
    one listed first): the part of it past the latest end of every interval that started before it. The lengths
    sum to the length of the intervals' union."""
    out = [0.0] * len(intervals)
    covered = float("-inf")  # the latest end among the intervals taken so far
    for i in sorted(range(len(intervals)), key=lambda i: (intervals[i][0], i)):
        start, end = intervals[i]
        out[i] = max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return out


def decompose(events: Iterable[tuple[str, float, float]], steps: int) -> dict:
    """Decompose GPU kernel events `(name, start_us, duration_us)` covering `steps` decode steps.

    Returns `shares` {category: fraction of summed kernel time} over every category in CATEGORY_NAMES
    (summing to 1; with concurrent streams summed kernel time exceeds busy time, and shares of the sum
    keep the categories comparable), `exclusive_shares` {category: fraction of busy time, by
    `exclusive_lengths`} (summing to 1), `idle_fraction` = (wall span - union of busy intervals) / wall
    span (the host-bound gaps the seed measured at ~15%), `step_ms` = wall span / steps, plus the raw
    `kernel_us`, `busy_us`, `wall_us`, `steps` and `n_kernels`, and `exclusive_us`, each event's exclusive time.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    per_cat = dict.fromkeys(CATEGORY_NAMES, 0.0)
    intervals, cats = [], []
    for i, event in enumerate(events):
        try:
            name, start, dur = event
        except (TypeError, ValueError):
            raise ValueError(f"event {i} must be (name, start_us, duration_us), got {event!r}") from None
        if not dur >= 0:
            raise ValueError(f"event {i} ({name!r}) has a negative or NaN duration: {dur!r}")
        cats.append(categorize(name))
        per_cat[cats[-1]] += float(dur)
        intervals.append((float(start), float(start) + float(dur)))
    if not intervals:
        raise ValueError("no kernel events to decompose")
    kernel_us = sum(per_cat.values())
    if kernel_us == 0:
        raise ValueError("all kernel events have zero duration")
    wall_us = max(e for _, e in intervals) - min(s for s, _ in intervals)
    exclusive_us = exclusive_lengths(intervals)
    busy_us = math.fsum(exclusive_us)  # exclusive lengths partition the union of the busy intervals
    excl = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for cat, t in zip(cats, exclusive_us):
        excl[cat] += t
    return {
        "shares": {cat: t / kernel_us for cat, t in per_cat.items()},
        "exclusive_shares": {cat: t / busy_us for cat, t in excl.items()},
        "idle_fraction": (wall_us - busy_us) / wall_us,
        "step_ms": wall_us / steps / 1000.0,
        "kernel_us": kernel_us,
        "busy_us": busy_us,
        "wall_us": wall_us,
        "steps": steps,
        "n_kernels": len(intervals),
        "exclusive_us": exclusive_us,  # per event, in the order given
    }

"""Candidates: kernels measured against the model's default that did not become it, kept outside `model/` with their
tests and kernel benchmark so that they can be measured again (another GPU, another torch or Triton). The model does
not know them: each runs inside it only through an explicit hook of `model.ops` for the span of a `with` block, and
`model/` holds only what the default path runs.

A candidate module has `CONFIG` (its launch config's defaults, read-only), `config(changes)` (CONFIG with changes,
checked: an unknown key or a value of another kind is `model.triton.UnknownConfigKeys`), `installed(changes)` (the
block inside which the model runs it) and `ENTRY_POINTS` (the functions that launch its kernels, whose calls an A/B
counts). `benchmarks.bench_ab` names one as `NAME=benchmarks.candidates.MODULE:JSON`.

    moe_grouped   the prefill MoE's grouped expert GEMMs with the dispatch and SwiGLU fused in
                  (hook `model.ops.experts_kernel`; docs/kernels.md#moe-grouped)
"""


class Unsupported(ValueError):
    """Inputs a candidate does not take (e.g. a dtype it has no kernel for), where the model's default would run."""

"""moe_prefill_rows: the prefill MoE's expert GEMMs (torch's grouped GEMM) at the router's rows per expert against the
same number of rows balanced across the experts: what the spread of rows costs. do_bench."""
from __future__ import annotations

import traceback

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import DTYPE, PREFILL_T, rel_err
from benchmarks.kernels.moe_prefill import first_router
from benchmarks.kernels.spec import Bench
from benchmarks.timing import log

MOE_TILE_ROWS = 128  # the rows of torch's grouped-GEMM tiles on sm_90 when a problem has more than 128 rows a group
ROWS_TOL = 1e-2  # the grouped GEMMs against one torch.mm pair per expert


def balanced_counts(n: int, E: int) -> torch.Tensor:
    """n rows over E groups as evenly as they go (the first n % E groups one more)."""
    return torch.full((E,), n // E, dtype=torch.int64) + (torch.arange(E) < n % E)


def rows_inputs(T: int, Dm: int, I: int, E: int, K: int, device: str = "cuda") -> tuple:
    """Seeded inputs at T tokens: (x [T, Dm] the router's input, rows [T*K, Dm] the rows the experts take, gate_up
    [E, Dm, 2I] and down [E, I, Dm] as transposed views, as the model holds them)."""
    g = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, Dm, generator=g, device=device).to(DTYPE)
    rows = torch.randn(T * K, Dm, generator=g, device=device).to(DTYPE)
    gate_up = (torch.randn(E, 2 * I, Dm, generator=g, device=device) / Dm ** 0.5).to(DTYPE).transpose(1, 2)
    down = (torch.randn(E, Dm, I, generator=g, device=device) / I ** 0.5).to(DTYPE).transpose(1, 2)
    return x, rows, gate_up, down


def moe_rows_case(T: int, rep_ms: int, device: str = "cuda", preset: str = "48b-a3b") -> dict:
    """The prefill MoE's expert GEMMs (`ops.grouped_mm` gate_up, `ops.silu_mul`, `ops.grouped_mm` down: the
    model's path without the dispatch and combine copies) for T tokens of `preset` at the rows per expert its
    router gives, against the same number of rows balanced across the experts (peer "balanced rows"). The router
    is the first MoE layer's, synthetic weights seed 0 as the benchmarks' model has them, on unit normal inputs.
    The gap is what the spread of rows costs torch's grouped GEMM: each expert's rows fill whole tiles of
    MOE_TILE_ROWS, so a skewed spread pays for padded rows (`tile_rows_wasted`, beside the balanced case's). Ours
    is checked against one torch.mm per expert for the first experts. One `kernel` record."""
    from model import ops
    from model.config import get_config
    cfg = get_config(preset)
    E, Dm, I, K = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token
    router, desc = first_router(preset, device)
    params = {"op": "moe_prefill_rows", "B": 1, "T": T, "H": E, "d": Dm, "dtype": "bfloat16", "I": I, "K": K,
              "router": desc,
              "ours_scope": "grouped gate_up + silu_mul + grouped down at the router's rows per expert",
              "peer_scope": "the same GEMMs with the same number of rows balanced across the experts"}
    results, reasons = {"peer": "balanced rows", "timing": "do_bench"}, []
    try:
        x, rows, gate_up, down = rows_inputs(T, Dm, I, E, K, device)
        idx = router(x)[0]
        counts = torch.bincount(idx.flatten().cpu(), minlength=E)
        cases = {"ours": counts, "peer": balanced_counts(T * K, E)}

        def experts(offs):
            h = ops.grouped_mm(rows, gate_up, offs)
            return ops.grouped_mm(ops.silu_mul(h[:, :I], h[:, I:]), down, offs)

        ends = {side: torch.cumsum(c, 0) for side, c in cases.items()}
        for side, c in cases.items():
            offs = ends[side].to(torch.int32).to(device)
            results[f"{side}_ms"] = common.gpu_ms(lambda offs=offs: experts(offs), rep_ms)
            results[f"{side}_tile_rows_wasted"] = int((-c % MOE_TILE_ROWS).sum())
        results.update(rows_per_expert_sd=float(counts.float().std()), rows_per_expert_max=int(counts.max()),
                       rows_per_expert_min=int(counts.min()))
        results["speedup"] = results["peer_ms"] / results["ours_ms"]
        y = experts(ends["ours"].to(torch.int32).to(device))
        ref, got = [], []
        for e in range(8):  # the first experts' rows, one torch.mm pair each
            b = int(ends["ours"][e])
            a = b - int(counts[e])
            h = rows[a:b] @ gate_up[e]
            ref.append(ops.silu_mul(h[:, :I], h[:, I:]) @ down[e])
            got.append(y[a:b])
        results["rel_err_vs_per_expert_mm"] = rel_err(torch.cat(got), torch.cat(ref))
        if not results["rel_err_vs_per_expert_mm"] <= ROWS_TOL:
            reasons.append(f"grouped GEMMs differ from per-expert torch.mm: {results['rel_err_vs_per_expert_mm']:.3g}")
    except Exception as e:
        traceback.print_exc()
        reasons.append(f"moe_prefill_rows failed: {type(e).__name__}: {e}")
    rec = common.kernel_record(params, results, reasons, device)
    log(f"  moe_prefill_rows T={T}: router rows {common.fmt_ms(results.get('ours_ms'))} ms, balanced "
        f"{common.fmt_ms(results.get('peer_ms'))} ms; rows per expert sd "
        f"{results.get('rows_per_expert_sd', float('nan')):.1f}, padded rows {results.get('ours_tile_rows_wasted')} "
        f"against {results.get('peer_tile_rows_wasted')}  {rec['verdict']} {reasons}")
    return rec


BENCH = Bench(
    op="moe_prefill_rows", inputs=rows_inputs, ours="model.ops:grouped_mm", peer="balanced rows", peer_fn=None,
    check="the grouped GEMMs against one torch.mm pair per expert (first 8 experts), relative RMS error <= ROWS_TOL",
    tol=ROWS_TOL, sizes=PREFILL_T, study=lambda sizes, rep_ms, swept: [moe_rows_case(T, rep_ms) for T in sizes])

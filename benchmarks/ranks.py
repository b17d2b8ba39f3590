"""The end-to-end benchmark over several ranks (`python -m benchmarks.bench_e2e --world N`): the command starts the N
processes itself, the ranks of one process group (`model.parallel.spawn`: forked over gloo on a CPU, started fresh
over NCCL on CUDA with rank r on cuda:r), as the gates do (gates/ranks.py). Each rank loads its share of the routed
experts and runs every configuration, since each MoE layer is a collective; rank 0 alone prints and appends the
records, once every rank has finished the configuration. A rank that crashes, dies or hangs stops the run
(`RankFailed`, naming it), which the command turns into exit 2.

The rooflines over N GPUs: a rank's work per token is its own share (decode: the replicated weights and the state
whole, the top-k routed experts' rows split evenly, k/N a rank; prefill: the whole model's FLOPs, since every rank
still computes every routed pair, the foreign ones weighted zero, docs/PARALLEL.md), and since the ranks step
together the ceiling is the slowest rank's measured rate over its own work. The collective's share of a decode
step comes from an A/B in the same run on the same ranks: the step timed as it is, then with the per-MoE-layer
all_reduce skipped (`model.parallel.collective_skipped`).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from benchmarks import roofline
from gates.memory import describe_links, gpu_links
from gates.ranks import DEFAULT_RANK_TIMEOUT_S, spawn_ranks  # noqa: F401 (the bench default too)
from model.config import KimiConfig, get_config

DECODE_DERIVATION = (
    "over {world} ranks, which step together (an all_reduce in every MoE layer): roofline_tok_s is the slowest "
    "rank's, min over ranks of rank_hbm_gbps / rank_bytes_per_token, each rank's measured read bandwidth over the "
    "bytes it reads per token: the replicated weights and the per-sequence state whole, the top-k routed experts' "
    "rows split evenly, k/{world} a rank (the ideal split). hbm_gbps and bytes_per_token are the sums over ranks")
PREFILL_DERIVATION = (
    "over {world} ranks, which step together: roofline_tok_s is the slowest rank's, min over ranks of "
    "rank_matmul_tflops / rank_flops_per_token, each rank's measured bf16 matmul rate over its FLOPs per token: the "
    "whole model's, as every rank computes every routed pair (the foreign ones weighted zero). matmul_tflops and "
    "flops_per_token are the sums over ranks")
COLLECTIVE_AB = (
    "A/B in this run on the same ranks: the decode step timed with its all_reduce per MoE layer, then as many steps "
    "with the collective skipped (model.parallel.collective_skipped, a graph captured without it); "
    "collective_ms = median_ms - no_collective_median_ms (the slowest rank's median without it); "
    "collective_share = collective_ms / median_ms, clamped to [0, 1]")


def impl_name(impl: str, world: int) -> str:
    """A record's impl over several ranks names the world, so that its series stays apart from one process's."""
    return impl if world == 1 else f"{impl}-ep{world}"


def peers_skipped(peers, world: int) -> str:
    return (f"peers {', '.join(peers)} not run over {world} ranks: HF transformers runs the whole model in one "
            f"process, ours is split over {world}")


def first_line(s) -> str:
    """What a run over several ranks says first: how many, the experts each holds, where (on CUDA each GPU and the
    links between them, as NVML reports them)."""
    cfg = get_config(s.preset)
    where = "cpu, gloo" if s.device == "cpu" else f"cuda, NCCL; {describe_links(gpu_links(range(s.world)))}"
    return (f"bench over {s.world} ranks, {cfg.num_experts // s.world} experts each: {s.preset} {s.dtype} "
            f"({where})")


# ---- the rooflines over ranks --------------------------------------------------------------------------------

def routed_active_params(cfg: KimiConfig) -> int:
    """The routed experts' parameters one decoded token reads: its top-k experts in every MoE layer."""
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    return n_moe * cfg.num_experts_per_token * 3 * cfg.moe_intermediate_size * cfg.hidden_size


def rank_decode_bytes_per_token(cfg: KimiConfig, context: int, dtype: torch.dtype, world: int) -> float:
    """Bytes one rank of `world` reads per decoded token: `roofline.decode_bytes_per_token` with the routed experts'
    share cut to 1/world (world 1: the one-process figure)."""
    routed = routed_active_params(cfg) * dtype.itemsize
    return roofline.decode_bytes_per_token(cfg, context, dtype) - routed * (world - 1) / world


def over_ranks(cfg: KimiConfig, T: int, dtype: torch.dtype, decode: bool, ceilings: list) -> tuple[float, dict]:
    """(roofline tok/s, the record's fields) of a configuration over len(ceilings) ranks, from each rank's measured
    `roofline.Ceilings`: the ranks step together, so the slowest rank's rate over its own work per token bounds
    them all. The record keeps each rank's ceiling and work under rank_*, and their sums."""
    world = len(ceilings)
    gbps, tflops = [c.hbm_gbps for c in ceilings], [c.matmul_tflops for c in ceilings]
    fields = {"hbm_gbps": sum(gbps), "rank_hbm_gbps": gbps, "matmul_tflops": sum(tflops), "rank_matmul_tflops": tflops}
    if decode:
        work = [rank_decode_bytes_per_token(cfg, T, dtype, world)] * world
        fields.update(bytes_per_token=sum(work), rank_bytes_per_token=work,
                      roofline_derivation=DECODE_DERIVATION.format(world=world))
        return min(g * roofline.GB / w for g, w in zip(gbps, work)), fields
    work = [roofline.prefill_flops_per_token(cfg, T)] * world
    fields.update(flops_per_token=sum(work), rank_flops_per_token=work,
                  roofline_derivation=PREFILL_DERIVATION.format(world=world))
    return min(t * 1e12 / w for t, w in zip(tflops, work)), fields


def collective_share(with_ms: float, without_ms: list[float]) -> dict:
    """The record's fields of the collective A/B: the median decode step with the all_reduce (`with_ms`) and each
    rank's median without it (the step waits for the slowest rank, so its time is the one compared)."""
    slowest = max(without_ms)
    diff = with_ms - slowest
    return {"no_collective_median_ms": slowest, "rank_no_collective_median_ms": list(without_ms),
            "collective_ms": diff, "collective_share": min(1.0, max(0.0, diff / with_ms)),
            "collective_ab": COLLECTIVE_AB}


# ---- the ranks ---------------------------------------------------------------------------------------------------

def _rank_main(s) -> list[dict] | None:
    """One rank: its share of the model, every configuration; rank 0 prints and returns its records, the others are
    silent (their errors still reach stderr)."""
    from benchmarks import bench_e2e
    from model.parallel import ExpertParallel

    rank = dist.get_rank()
    if s.device == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // s.world))
    with contextlib.ExitStack() as stack:
        if rank != 0:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        records = bench_e2e.measure(s, ExpertParallel.of(get_config(s.preset).num_experts))
    return records if rank == 0 else None


def run_ranks(s, log=print) -> list[dict]:
    """Run the benchmark of settings `s` over `s.world` ranks started here and return rank 0's records; RankFailed,
    naming the rank, where one fails."""
    if s.world < 2:
        raise ValueError(f"run_ranks needs world >= 2, got {s.world}")
    log(first_line(s))
    return spawn_ranks(_rank_main, s.world, (s,), s.device, s.rank_timeout_s)[0]

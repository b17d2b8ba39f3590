"""moe_combine: the prefill MoE's combine (T tokens x top-8 expert rows of 2304, plus the shared expert's) against
the index_add-into-fp32 combine the grouped MoE used before (peer `torch`). Both sides by do_bench."""
from __future__ import annotations

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import DTYPE, PEER, PEER_TOL, PREFILL_T, rel_err
from benchmarks.kernels.spec import Bench


K, DM = 8, 2304  # the 48B's top-8 picks and hidden size


def combine_inputs(T: int) -> tuple:
    """Seeded inputs of the combine of T tokens on the GPU: (out [T*K, DM] expert rows, order: the pair each row of
    out holds, slot [T*K]: the row of each (token, pick) pair, w [T, K] fp32 weights, shared [T, DM])."""
    gen = torch.Generator().manual_seed(T)
    out = torch.randn(T * K, DM, generator=gen).cuda().to(DTYPE)
    order = torch.randperm(T * K, generator=gen).cuda()       # row r of out holds pair order[r]
    slot = torch.empty_like(order)
    slot[order] = torch.arange(T * K, device="cuda")
    w = torch.rand(T, K, generator=gen).cuda()
    shared = torch.randn(T, DM, generator=gen).cuda().to(DTYPE)
    return out, order, slot, w, shared


def combine_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    from model.triton.moe_combine import moe_combine
    out, order, slot, w, shared = combine_inputs(T)

    def index_add():  # the combine this replaced
        y = torch.zeros(T, DM, dtype=torch.float32, device="cuda")
        y.index_add_(0, order // K, out.float() * w.view(-1)[order, None])
        return (y + shared.float()).to(DTYPE)

    y = moe_combine(out, slot.view(T, K), w, shared, DTYPE)
    res = {"ours_ms": common.gpu_ms(lambda: moe_combine(out, slot.view(T, K), w, shared, DTYPE), rep_ms),
           "peer_ms": common.gpu_ms(index_add, rep_ms), "rel_err_vs_peer": rel_err(y, index_add()),
           "peer": f"torch-{torch.__version__} index_add"}
    return res, []


BENCH = Bench(
    op="moe_combine", inputs=combine_inputs, ours="model.triton.moe_combine:moe_combine",
    peer=f"torch-{torch.__version__} index_add", peer_fn=None,
    check="relative RMS error <= PEER_TOL against the index_add combine", tol=PEER_TOL, sizes=PREFILL_T,
    case=combine_case, params=lambda: dict(peer_scope="the torch form this replaces"), default=True,
    # a case that raises before naming its peer is recorded with the fla label, as every failed non-MLA case is
    peer_if_failed=PEER)

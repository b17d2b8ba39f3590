"""mla_decode: MLA decode attention over the latent cache (batch 1, 32 heads, rank 512 + 64, bf16 cache filled to T
positions, the query at T-1): our split-K `mla_decode` (fp32 scores, reads positions 0..pos) against the previous
torch-einsum form (bf16 score and p@c einsums over the whole buffer, masked): peer "torch-einsum". Ours is also held
against the fp32 torch reference (`rel_err_vs_fp32_ref`, must be <= 1e-4); `gbps` is the cache bytes read per call
over ours' time. Both sides by do_bench.

The MLA shapes here (MLA_H, MLA_R, MLA_P, MLA_LAYERS) are those of the other MLA benches too."""
from __future__ import annotations

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import DTYPE, rel_err
from benchmarks.kernels.spec import Bench, Size

MLA_H, MLA_R, MLA_P = 32, 512, 64
MLA_PEER = "torch-einsum"
MLA_PEER_TOL = 5e-2  # the peer rounds scores and p to bf16: ~1e-2 from the fp32 result on these inputs
MLA_LAYERS = 7  # the 48B-A3B's MLA layers: calls per timed graph

MLA_T = Size("--mla-T", (1024, 32768, 131072), "mla_decode contexts (batch 1)")


def mla_fp32_ref(results: dict, reasons: list[str], ours, ref) -> None:
    """Our MLA decode output against the fp32 torch reference `ref`: its relative RMS error into results, a reason
    past 1e-4."""
    results["rel_err_vs_fp32_ref"] = rel_err(ours, ref)
    if not results["rel_err_vs_fp32_ref"] <= 1e-4:
        reasons.append(f"ours differs from the fp32 torch reference: {results['rel_err_vs_fp32_ref']:.3g} > 1e-4")


def einsum_mla_decode(q_lat, q_pe, c, k_pe, pos, scale):
    """The model's MLA decode attention before the split-K kernel: bf16 einsums over the whole buffer."""
    s = torch.einsum("bhr,blr->bhl", q_lat.to(c.dtype), c).float() + torch.einsum("bhp,blp->bhl", q_pe, k_pe).float()
    valid = torch.arange(c.shape[1], device=c.device) <= pos
    p = torch.softmax((s * scale).masked_fill(~valid, float("-inf")), dim=-1)
    return torch.einsum("bhl,blr->bhr", p.to(c.dtype), c).float()


def mla_inputs(T: int) -> tuple:
    """Seeded inputs of one MLA decode call on the GPU, batch 1, a buffer of T positions, the query at T-1:
    (q_lat, q_pe, c, k_pe, pos, scale)."""
    gen = torch.Generator().manual_seed(T)
    q_lat = 3 * torch.randn(1, MLA_H, MLA_R, generator=gen).cuda()
    q_pe = (3 * torch.randn(1, MLA_H, MLA_P, generator=gen)).cuda().to(DTYPE)
    c = torch.randn(1, T, MLA_R, generator=gen).cuda().to(DTYPE)
    k_pe = torch.randn(1, T, MLA_P, generator=gen).cuda().to(DTYPE)
    pos, scale = torch.tensor(T - 1, device=c.device), 192 ** -0.5
    return q_lat, q_pe, c, k_pe, pos, scale


def cache_layers(T: int, heads: int, rank: int, rope: int, layers: int, device: str = "cuda") -> tuple:
    """Seeded inputs of `layers` MLA layers' decode calls, batch 1, a buffer of T positions each (its own cache),
    one query at T-1: (q_lat, q_pe, [(c, k_pe) per layer], pos, scale)."""
    g = torch.Generator(device=device).manual_seed(T)
    q_lat = 3 * torch.randn(1, heads, rank, generator=g, device=device)
    q_pe = (3 * torch.randn(1, heads, rope, generator=g, device=device)).to(DTYPE)
    caches = [(torch.randn(1, T, rank, generator=g, device=device).to(DTYPE),
               torch.randn(1, T, rope, generator=g, device=device).to(DTYPE)) for _ in range(layers)]
    return q_lat, q_pe, caches, torch.tensor(T - 1, device=device), 192 ** -0.5


def mla_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    from model import ops
    from model.triton.mla_decode import mla_decode
    q_lat, q_pe, c, k_pe, pos, scale = mla_inputs(T)

    def ours():
        return mla_decode(q_lat, q_pe, c, k_pe, pos, scale)

    o = ours()
    res, reasons = {"ours_ms": common.gpu_ms(ours, rep_ms)}, []
    res["gbps"] = (c.numel() + k_pe.numel()) * c.element_size() / res["ours_ms"] / 1e6
    mla_fp32_ref(res, reasons, o, ops.mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, scale))
    if not torch.isfinite(o).all():
        reasons.append("ours produced non-finite values")
    common.time_peer(lambda: einsum_mla_decode(q_lat, q_pe, c, k_pe, pos, scale),
                     lambda out: {"rel_err_vs_peer": rel_err(o, out)}, res, reasons, rep_ms)
    return res, reasons


def _params() -> dict:
    return dict(H=MLA_H, d=MLA_R + MLA_P, ours_scope="split-K kernel + combine, positions 0..T-1 read",
                peer_scope="bf16 einsums + softmax over the whole T-position buffer")


BENCH = Bench(
    op="mla_decode", inputs=mla_inputs, ours="model.triton.mla_decode:mla_decode", peer=MLA_PEER,
    peer_fn="benchmarks.kernels.mla_decode:einsum_mla_decode",
    check="relative RMS error <= 1e-4 against the fp32 torch reference, <= MLA_PEER_TOL against the peer",
    tol=MLA_PEER_TOL, sizes=MLA_T, case=mla_case, params=_params, default=True, targets=(("T", 131072, "<"),))

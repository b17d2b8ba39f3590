"""Triton MoE kernels (routing, expert GEMVs) against the PyTorch references, via the interpreter on CPU."""


import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

from model import ops  # noqa: E402
from model.layers import MLP  # noqa: E402
from model.triton.moe import fused_moe_small_batch, route  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@given(N=st.integers(1, 4), E=st.sampled_from([8, 12, 32]), K=st.sampled_from([1, 2, 4]), seed=st.integers(0, 999),
       renorm=st.booleans())
def test_route_matches_torch(N, E, K, seed, renorm):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g).to(DEV)
    bias = (0.1 * torch.randn(E, generator=g)).to(DEV)
    idx, w = route(logits, bias, K, 2.446, renorm)
    ridx, rw = ops.moe_route_torch(logits, bias, K, 2.446, renorm)
    # the same set of experts per token, with the same weights (order may differ: sorted=False)
    o, ro = idx.sort(-1), ridx.sort(-1)
    assert torch.equal(o.values, ro.values)
    assert rel_err(w.gather(-1, o.indices), rw.gather(-1, ro.indices)) < 1e-6


@given(N=st.integers(1, 3), D=st.sampled_from([16, 40, 64]), I=st.sampled_from([8, 24, 32]), E=st.sampled_from([4, 9]),
       K=st.sampled_from([1, 2, 3]), seed=st.integers(0, 999), with_shared=st.booleans())
def test_experts_match_torch(N, D, I, E, K, seed, with_shared):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(DEV)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(DEV)
    down = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(DEV)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(DEV)
    w = torch.rand(N, K, generator=g).to(DEV)
    shared = MLP(D, I).to(DEV).requires_grad_(False) if with_shared else None
    if shared is not None:
        for p in shared.parameters():
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5, generator=g)
    with ops.use("triton"):
        y = ops.moe_experts(x, idx, w, gate_up, down, shared)
    with ops.use("torch"):
        ref = ops.moe_experts(x, idx, w, gate_up, down, shared)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < 1e-5


def test_experts_reject_wrong_shapes():
    x = torch.randn(1, 16)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_small_batch(x, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.randn(4, 16, 32),
                              torch.randn(4, 16, 4))


@given(N=st.integers(1, 40), E=st.sampled_from([4, 9]), K=st.sampled_from([1, 2, 3]), seed=st.integers(0, 999),
       combine=st.sampled_from(["torch", "triton"]))
def test_grouped_gemm_form_matches_loop(N, E, K, seed, combine):
    g = torch.Generator().manual_seed(seed)
    D, I = 32, 16
    x = torch.randn(N, D, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g)
    with ops.use(combine):  # the combine step's implementation (grouped_mm itself is torch's)
        y = ops.moe_experts_grouped(x, idx, w, gate_up, down)
    assert rel_err(y, ops.moe_experts_torch(x, idx, w, gate_up, down)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest")
def test_bf16_rounds_where_the_prefill_path_rounds():
    """In bf16 the fused decode kernel and the PyTorch path round at the same points, so they differ only by
    fp32 summation order: nearly every output element is bit-identical."""
    g = torch.Generator().manual_seed(3)
    N, D, I, E, K = 2, 64, 32, 8, 3
    bf = torch.bfloat16
    x = torch.randn(N, D, generator=g).to(bf).to(DEV)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(bf).to(DEV)
    down = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(bf).to(DEV)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(DEV)
    w = torch.rand(N, K, generator=g).to(DEV)
    shared = MLP(D, I).to(bf).to(DEV).requires_grad_(False)
    for p in shared.parameters():
        p.copy_((torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5).to(bf))
    with ops.use("triton"):
        y = ops.moe_experts(x, idx, w, gate_up, down, shared)
    with ops.use("torch"):
        ref = ops.moe_experts(x, idx, w, gate_up, down, shared)
    assert rel_err(y, ref) < 5e-3
    assert (y == ref).float().mean() > 0.95

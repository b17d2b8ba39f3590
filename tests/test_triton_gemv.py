"""The split-K GEMV (model/triton/gemv.py) against F.linear, via the interpreter on CPU.

Every buffer the kernel writes (the output and the partial sums) is allocated NaN-filled, so a partial that
the finishing program reads before it is written, or an output element left unwritten, fails the comparison.
Tests marked `gpu` run the decode step's real projection shapes, bf16, inside a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import model.triton as mt
from model import ops
from model.triton.gemv import GEMV, gemv
from tests.conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")


@pytest.fixture(autouse=True, scope="module")
def poisoned_buffers():
    def nan_empty(*shape, dtype, device):
        t = torch.empty(*shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(-1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "empty", nan_empty)
        yield


@settings(max_examples=25)
@given(O=st.sampled_from([1, 7, 16, 40, 100]), D=st.sampled_from([3, 32, 100, 256, 300]),
       block=st.sampled_from([(16, 32, 64), (4, 16, 16), (32, 64, 32), (16, 512, 1024)]),
       lead=st.sampled_from([(), (1,), (1, 1)]), seed=st.integers(0, 999))
def test_gemv_matches_linear(O, D, block, lead, seed):
    """Any shape (masked edges), any split count from 1 up, the token's leading dims kept."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(*lead, D, generator=g).to(DEV), torch.randn(O, D, generator=g).to(DEV)
    cfg = dict(BLOCK_O=block[0], BLOCK_D=block[1], SPLIT=block[2])
    y = gemv(x, w, cfg)
    assert y.shape == (*lead, O) and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    # any fp32 summation order is within D * 2^-24 of the sum of |products| (plus the final rounding)
    err = (y.double() - F.linear(x.double(), w.double())).abs()
    assert (err <= (D + 1) * 2.0 ** -24 * F.linear(x.double().abs(), w.double().abs())).all()
    assert torch.equal(y, gemv(x, w, cfg))                       # the same bits again: counters were put back
    assert int(mt.arrival_counters(x.device, 1)[:64].abs().sum()) == 0


def test_gemv_rejects_what_it_cannot_do():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="one token"):
        gemv(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match="one token"):
        gemv(torch.randn(1, 15), w)
    with pytest.raises(ValueError, match="bfloat16"):
        gemv(torch.randn(1, 16).bfloat16(), w)


def test_linear_dispatch():
    """ops.linear takes the GEMV for one token under Triton kernels, F.linear for more tokens or under torch."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 48, generator=g)
    one, two = torch.randn(1, 48, generator=g), torch.randn(2, 48, generator=g)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        import model.triton.gemv as tg
        mp.setattr(tg, "gemv", lambda x, weight: calls.append(x.shape) or F.linear(x, weight))
        with ops.use("triton"):
            ops.linear(one, w)
            ops.linear(two, w)
        with ops.use("torch"):
            ops.linear(one, w)
    assert calls == [torch.Size([1, 48])]
    with ops.use("triton"):
        assert rel_err(ops.linear(one, w), F.linear(one, w)) < 1e-6


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("O,D", [(2304, 4096), (6144, 2304), (576, 2304)])
def test_gpu_real_shapes_in_a_graph(O, D):
    """The decode step's o_proj, MLA q_proj and kv_a shapes in bf16: within bf16 rounding of cuBLAS (fp32 sums
    in another order, one rounding each), bit-identical across CUDA-graph replays."""
    g = torch.Generator(device="cuda").manual_seed(O)
    x = torch.randn(1, D, generator=g, device="cuda").bfloat16()
    w = (torch.randn(O, D, generator=g, device="cuda") * D ** -0.5).bfloat16()
    y = gemv(x, w)
    ref = F.linear(x.double(), w.double())
    assert rel_err(y, ref) < 4e-3 and rel_err(y, ref) <= 1.5 * rel_err(F.linear(x, w), ref) + 1e-6
    assert (y == F.linear(x, w)).float().mean() > 0.9
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy = gemv(x, w)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gy, y)
    assert GEMV["SPLIT"] % GEMV["BLOCK_D"] == 0

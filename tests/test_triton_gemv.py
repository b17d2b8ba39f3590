"""The decode GEMV (`model.triton.gemv`) against an fp64 product and F.linear, via the interpreter on CPU.

Every buffer the kernel writes is allocated NaN-filled, so an element it leaves unwritten fails the comparison.
Tests marked `gpu` run the model's decode projection shapes in bf16."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import model.triton as mt
from model import ops
from model.triton import gemv as gv
from tests.conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
CFGS = [None, dict(BLOCK_N=1, BLOCK_K=32, num_warps=4), dict(BLOCK_N=8, BLOCK_K=64, num_warps=8),
        dict(BLOCK_N=16, BLOCK_K=16, num_warps=4)]


@pytest.fixture(autouse=True, scope="module")
def poisoned_buffers():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "empty", lambda *shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                         device=device))
        yield


def inputs(M, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, dtype)
    return x, w


@given(M=st.integers(1, gv.MAX_ROWS), N=st.integers(1, 40), K=st.sampled_from([16, 48, 64, 100, 256]),
       cfg=st.sampled_from(CFGS), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 999))
def test_gemv_matches_fp64_and_f_linear(M, N, K, cfg, dtype, seed):
    """Any rows, widths that are and are not multiples of the tiles: the fp64 product to the output dtype's
    rounding, F.linear to two roundings apart, every element written."""
    x, w = inputs(M, N, K, dtype, seed)
    y = gv.gemv(x, w, cfg)
    assert y.shape == (M, N) and y.dtype == dtype
    ref = x.double() @ w.double().T
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # fp32 sums in another order; bf16's one output rounding
    assert rel_err(y, ref) < tol
    assert rel_err(y, F.linear(x, w)) < 2 * tol


def test_gemv_keeps_leading_dims_and_reads_views():
    """x [B, 1, K] (a decode step's rows) gives [B, 1, N]; a weight that is a row slice of a packed tensor (the
    model's packed projections) reads the right rows."""
    x, w = inputs(6, 24, 64, torch.float32, 1)
    packed = torch.cat([torch.randn(5, 64).to(DEV), w, torch.randn(3, 64).to(DEV)])
    y = gv.gemv(x.view(2, 3, 64), packed[5:29])
    assert y.shape == (2, 3, 24) and rel_err(y.view(6, 24), x.double() @ w.double().T) < 1e-6


def test_gemv_poisoned_output_and_nan_weights_never_pass():
    """A NaN weight row gives NaN outputs in that column only (it is not masked away), and the metric fails it."""
    x, w = inputs(2, 9, 64, torch.float32, 2)
    w[4, 7] = float("nan")
    y = gv.gemv(x, w)
    assert torch.isnan(y[:, 4]).all() and torch.isfinite(y[:, [0, 1, 2, 3, 5, 6, 7, 8]]).all()
    assert not rel_err(y, x.double() @ torch.nan_to_num(w).double().T) < 1e-6


def test_gemv_rejects_bad_input():
    x, w = inputs(2, 8, 32, torch.float32, 3)
    with pytest.raises(ValueError, match="rows"):
        gv.gemv(torch.randn(gv.MAX_ROWS + 1, 32).to(DEV), w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 32\]"):
        gv.gemv(x, w[:, :16])
    with pytest.raises(TypeError, match="dtype"):
        gv.gemv(x, w.double())
    with pytest.raises(ValueError, match="unknown cfg keys"):
        gv.gemv(x, w, dict(BLOCK_M=4))


def test_decode_linear_picks_the_gemv_for_few_rows(monkeypatch):
    """`ops.decode_linear`: the GEMV for up to MAX_ROWS rows under "triton", F.linear past them and under
    "torch"; both give F.linear's product."""
    calls = []
    real = gv.gemv
    monkeypatch.setattr(gv, "gemv", lambda x, w, cfg=None: (calls.append(x.shape), real(x, w, cfg))[1])
    x, w = inputs(gv.MAX_ROWS + 1, 16, 64, torch.float32, 4)
    with ops.use("triton"):
        few = ops.decode_linear(x[:3], w)
        many = ops.decode_linear(x, w)
    with ops.use("torch"):
        plain = ops.decode_linear(x[:3], w)
    assert calls == [(3, 64)]
    for y, rows in ((few, 3), (many, gv.MAX_ROWS + 1), (plain, 3)):
        assert rel_err(y, F.linear(x[:rows], w)) < 1e-6


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", [(2304, 4096), (12576, 2304), (6720, 2304)])
@pytest.mark.parametrize("M", [1, 8])
def test_gemv_decode_shapes_on_gpu(M, N, K):
    """The decode projections' shapes in bf16: F.linear's product to bf16 rounding, the same bits twice."""
    x, w = inputs(M, N, K, torch.bfloat16, 5)
    y = gv.gemv(x, w)
    assert rel_err(y, F.linear(x, w)) < 4e-3 and rel_err(y, x.double() @ w.double().T) < 4e-3
    assert torch.equal(y, gv.gemv(x, w))

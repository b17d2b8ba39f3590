"""Prefill-path kernels against their torch references: the causal depthwise conv (model/triton/conv.py vs
model.kda.causal_conv1d), the MoE combine (model/triton/moe_combine.py vs ops.moe_combine_torch, and
that against the index_add form it replaced) and SwiGLU's silu(g) * u (model/triton/act.py vs the torch
expression). Interpreter shapes on the CPU; `gpu` tests run the 48B's shapes and check that the conv and
silu_mul round like torch on CUDA. Kernel outputs are poisoned (NaN) before each run. The sm_90
compile/spill check for these kernels is in tests/test_triton_kda.py."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # also done by conftest.py; needed before the imports below

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

import model.triton as mt  # noqa: E402
from model import kda, ops  # noqa: E402
from model.layers import MLP  # noqa: E402
from model.triton.act import silu_mul  # noqa: E402
from model.triton.conv import causal_conv1d  # noqa: E402
from model.triton.moe_combine import moe_combine  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True, scope="module")
def poisoned_buffers():
    def nan_empty(*shape, dtype, device):
        return torch.empty(*shape, dtype=dtype, device=device).fill_(float("nan"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "empty", nan_empty)
        yield


# ---- causal depthwise conv --------------------------------------------------------------------------

@given(B=st.integers(1, 2), T=st.sampled_from([1, 2, 3, 31, 33, 70]), C=st.sampled_from([4, 96, 130, 260]),
       W=st.sampled_from([1, 2, 4]), with_taps=st.booleans(), strided=st.booleans(), seed=st.integers(0, 999))
def test_conv_matches_torch(B, T, C, W, with_taps, strided, seed):
    g = torch.Generator().manual_seed(seed)
    # strided: x is a column slice of a wider projection output (rows longer than C), as a packed GEMM gives
    wide = torch.randn(B, T, C + (5 if strided else 0), generator=g)
    x = wide[..., :C]
    w = torch.randn(C, W, generator=g) / W ** 0.5
    taps = torch.randn(B, W - 1, C, generator=g) if with_taps else None
    y, new_taps = causal_conv1d(x, w, taps)
    ry, rtaps = kda.causal_conv1d(x, w, taps)
    assert torch.isfinite(y).all()
    assert y.shape == ry.shape and rel_err(y, ry) < 1e-6
    assert torch.equal(new_taps, rtaps)


def test_conv_chunks_carry_taps():
    """Two spans from carried taps equal one span over both (the recompute/prefill-in-chunks contract)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 40, 48, generator=g), torch.randn(48, 4, generator=g)
    y, taps = causal_conv1d(x, w)
    y1, t1 = causal_conv1d(x[:, :2], w)
    y2, t2 = causal_conv1d(x[:, 2:], w, t1)
    assert rel_err(torch.cat([y1, y2], 1), y) < 1e-6 and torch.equal(t2, taps)


@pytest.mark.parametrize("cfg", [dict(BT=16, BC=64, num_warps=2), dict(BT=64, BC=256, num_warps=8)])
def test_conv_tiles_are_a_launch_choice(cfg):
    """The benchmark's sweep tiles (CONFIG keys): partial tiles in both dimensions, the same values."""
    g = torch.Generator().manual_seed(1)
    x, w, taps = torch.randn(1, 70, 300, generator=g), torch.randn(300, 4, generator=g), torch.randn(1, 3, 300, generator=g)
    y = causal_conv1d(x, w, taps, cfg)[0]
    assert torch.isfinite(y).all() and rel_err(y, kda.causal_conv1d(x, w, taps)[0]) < 1e-6


@given(B=st.integers(1, 3), T=st.sampled_from([1, 2, 3, 4, 5, 8, 9, 17]), C=st.sampled_from([8, 24, 40]),
       W=st.sampled_from([1, 2, 3, 4, 5]), tile=st.sampled_from([(1, 8, 1), (2, 8, 1), (4, 16, 2), (4, 8, 4),
                                                               (8, 16, 4), (16, 32, 8), (32, 16, 4)]),
       with_taps=st.booleans(), strided=st.booleans(), seed=st.integers(0, 999))
def test_conv_window_edges_match_torch(B, T, C, W, tile, with_taps, strided, seed):
    """The sliding window at its edges, tiles small enough to put them inside the span: a window that starts in the
    carried taps (T < W-1 too) or in the previous row tile, spans that end inside a tile or a step (BT larger than T,
    T no multiple of BT or STEP), channel strips that end inside C, batches with their own taps, strided rows."""
    BT, BC, STEP = tile
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C + (3 if strided else 0), generator=g)[..., :C]
    w = torch.randn(C, W, generator=g) / W ** 0.5
    taps = torch.randn(B, W - 1, C, generator=g) if with_taps else None
    y, new_taps = causal_conv1d(x, w, taps, dict(BT=BT, BC=BC, STEP=STEP, num_warps=1))
    ry, rtaps = kda.causal_conv1d(x, w, taps)
    assert torch.isfinite(y).all()
    assert y.shape == ry.shape and rel_err(y, ry) < 1e-6
    assert torch.equal(new_taps, rtaps)


def test_conv_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="do not fit"):
        causal_conv1d(torch.randn(1, 4, 8), torch.randn(6, 4))
    with pytest.raises(ValueError, match="unknown cfg keys"):
        causal_conv1d(torch.randn(1, 4, 8), torch.randn(8, 4), cfg=dict(BM=4))
    with pytest.raises(ValueError, match="no multiple of STEP"):
        causal_conv1d(torch.randn(1, 4, 8), torch.randn(8, 4), cfg=dict(BT=8, STEP=3))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,T,with_taps", [(1, 8192, False), (1, 8192, True), (1, 3, True), (4, 1000, True)])
def test_gpu_conv_bf16_bit_exact(B, T, with_taps):
    """The 48B's shape (3 * 32 * 128 channels, 4 taps) in bf16: identical bits to the torch form on CUDA."""
    g = torch.Generator().manual_seed(T)
    C, W = 3 * 32 * 128, 4
    x = torch.randn(B, T, C, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(C, W, generator=g) / 2).to(torch.bfloat16).to(DEV)
    taps = torch.randn(B, W - 1, C, generator=g).to(torch.bfloat16).to(DEV) if with_taps else None
    y, new_taps = causal_conv1d(x, w, taps)
    ry, rtaps = kda.causal_conv1d(x, w, taps)
    assert torch.equal(new_taps, rtaps)
    diff = (y != ry).sum().item()
    assert diff == 0, f"{diff} of {y.numel()} elements differ; max abs diff {(y.float() - ry.float()).abs().max()}"


# ---- silu(g) * u ------------------------------------------------------------------------------------

@given(N=st.integers(1, 40), I=st.sampled_from([1, 8, 96, 1000, 1024, 1300]), packed=st.booleans(),
       lead=st.sampled_from([(), (2,)]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 999))
def test_silu_mul_matches_torch(N, I, packed, lead, dtype, seed):
    """packed: g and u are the two column halves of one [.., 2I] projection output, as the grouped MoE has them;
    else two separate tensors, as the shared expert's two projections give them."""
    g0 = torch.Generator().manual_seed(seed)
    if packed:
        gu = (torch.randn(*lead, N, 2 * I, generator=g0) * 3).to(dtype).to(DEV)
        g, u = gu[..., :I], gu[..., I:]
    else:
        g, u = ((torch.randn(*lead, N, I, generator=g0) * 3).to(dtype).to(DEV) for _ in range(2))
    h = silu_mul(g, u)
    ref = F.silu(g) * u
    assert h.dtype == dtype and h.shape == ref.shape and torch.isfinite(h).all()
    # fp32: the same formula; bf16: the interpreter truncates where CUDA rounds (the gpu test checks the bits)
    assert rel_err(h, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_silu_mul_rejects_mismatches():
    with pytest.raises(ValueError, match="one shape"):
        silu_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(TypeError, match="one float dtype"):
        silu_mul(torch.randn(2, 4), torch.randn(2, 4).to(torch.bfloat16))


def test_ops_silu_mul_routes_and_mlp_uses_it():
    """ops.silu_mul is the torch expression under KIMI_KERNELS=torch and the kernel under triton; the MLP
    (the shared expert, the dense layer) goes through it."""
    g0 = torch.Generator().manual_seed(0)
    mlp = MLP(16, 24).requires_grad_(False)
    x = torch.randn(5, 16, generator=g0)
    ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    with ops.use("torch"):
        assert torch.equal(mlp(x), ref)
    with ops.use("triton"):
        assert rel_err(mlp(x), ref) < 1e-6


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,packed", [(8192 * 8, True), (8192, False), (3, True)])
def test_gpu_silu_mul_bf16_rounds_like_torch(N, packed):
    """The 48B's expert activation (8192 tokens x top 8, I = 1024) in bf16: torch's bits for >= 99.9% of the
    elements, at most 1 ulp off elsewhere (torch's fp32 silu may differ from ours in the last bit before
    rounding)."""
    g0 = torch.Generator(device=DEV).manual_seed(N)
    I, bf = 1024, torch.bfloat16
    if packed:
        gu = (torch.randn(N, 2 * I, generator=g0, device=DEV) * 3).to(bf)
        g, u = gu[:, :I], gu[:, I:]
    else:
        g, u = ((torch.randn(N, I, generator=g0, device=DEV) * 3).to(bf) for _ in range(2))
    h = silu_mul(g, u)
    ref = F.silu(g) * u
    assert torch.isfinite(h).all()
    same = (h == ref).float().mean().item()
    assert same >= 0.999, f"only {same:.5f} of the elements have torch's bits"
    # bf16 bit patterns of finite values of one sign are ordered like the values: 1 ulp = 1 apart
    ulps = (h.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1


# ---- KDA gate ------------------------------------------------------------------------------------------

def gate_inputs(lead, H, d, dtype, seed, strided, device=DEV):
    g0 = torch.Generator().manual_seed(seed)
    f = (4 * torch.randn(*lead, H * d + (7 if strided else 0), generator=g0)).to(dtype)
    f = f[..., 3:3 + H * d] if strided else f                     # a column slice: rows strided
    f[..., 0] = 30.0                                               # the softplus threshold's far side
    A_log = torch.rand(1, 1, H, 1, generator=g0) * 3 - 1
    dt_bias = torch.randn(H * d, generator=g0)
    return [t.to(device) for t in (f, A_log, dt_bias)]


@given(lead=st.sampled_from([(1, 1), (2, 5), (1, 70), (3,)]), H=st.sampled_from([1, 4]), d=st.sampled_from([8, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), strided=st.booleans(), seed=st.integers(0, 999))
def test_kda_gate_matches_torch(lead, H, d, dtype, strided, seed):
    """The one-pass gate against kda.kda_gate (torch's exact softplus and exp): fp32 g, [..., H, d]; large f
    (past softplus's threshold 20) and f = -30 (a tiny softplus) included."""
    f, A_log, dt_bias = gate_inputs(lead, H, d, dtype, seed, strided)
    with ops.use("triton"):
        g = ops.kda_gate(f, A_log, dt_bias, d)
    ref = kda.kda_gate(f, A_log, dt_bias, d)
    assert g.shape == ref.shape == (*lead, H, d) and g.dtype == torch.float32
    assert torch.isfinite(g).all() and (g <= 0).all()
    assert rel_err(g, ref) < 1e-5
    with ops.use("triton"):
        small = ops.kda_gate(torch.full((1, H * d), -30.0, device=DEV), A_log, torch.zeros_like(dt_bias), d)
    ref_small = kda.kda_gate(torch.full((1, H * d), -30.0, device=DEV), A_log, torch.zeros_like(dt_bias), d)
    assert rel_err(small, ref_small) < 1e-5    # softplus(-30) ~ 1e-13: log1p's small-argument branch


def test_kda_gate_rejects_shapes_that_do_not_fit():
    from model.triton.act import kda_gate
    f, A_log, dt_bias = gate_inputs((2,), 4, 8, torch.float32, 0, False)
    with pytest.raises(ValueError, match="do not fit"):
        kda_gate(f, A_log, dt_bias[:8], 8)
    with pytest.raises(ValueError, match="do not fit"):
        kda_gate(f[:, :30], A_log, dt_bias, 8)


@pytest.mark.gpu
@gpu
def test_gpu_kda_gate_real_shapes():
    """8k tokens x 32 heads x 128 in bf16, a strided f (the bmm output's rows), against torch's exact form."""
    f, A_log, dt_bias = gate_inputs((1, 8192), 32, 128, torch.bfloat16, 1, True)
    g = ops.kda_gate(f, A_log, dt_bias, 128)
    ref = kda.kda_gate(f, A_log, dt_bias, 128)
    assert torch.isfinite(g).all() and rel_err(g, ref) < 1e-5


# ---- MoE combine ----------------------------------------------------------------------------------------

def combine_inputs(N, K, D, seed, dtype=torch.float32, shared=True):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(N * K, D, generator=g).to(dtype).to(DEV)
    slot = torch.randperm(N * K, generator=g).view(N, K).to(DEV)
    w = torch.rand(N, K, generator=g).to(DEV)
    s = torch.randn(N, D, generator=g).to(dtype).to(DEV) if shared else None
    return out, slot, w, s


@given(N=st.integers(1, 20), K=st.sampled_from([1, 3, 8]), D=st.sampled_from([8, 40, 600]), shared=st.booleans(),
       seed=st.integers(0, 999))
def test_combine_torch_matches_index_add(N, K, D, shared, seed):
    """The atomic-free combine sums what the index_add form it replaced summed."""
    out, slot, w, s = combine_inputs(N, K, D, seed, shared=shared)
    order = torch.empty_like(slot.view(-1))
    order[slot.view(-1)] = torch.arange(N * K, device=DEV)          # row r of out belongs to pair order[r]
    ref = torch.zeros(N, D, device=DEV).index_add_(0, order // K, out * w.view(-1)[order, None])
    ref = ref if s is None else ref + s
    assert rel_err(ops.moe_combine_torch(out, slot, w, s, torch.float32), ref) < 1e-6


@given(N=st.integers(1, 20), K=st.sampled_from([1, 3, 8]), D=st.sampled_from([8, 40, 600]), shared=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 999))
def test_combine_kernel_matches_torch(N, K, D, shared, dtype, seed):
    out, slot, w, s = combine_inputs(N, K, D, seed, dtype, shared)
    y = moe_combine(out, slot, w, s, dtype)
    ref = ops.moe_combine_torch(out, slot, w, s, dtype)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


def moe_48b(N):
    """The 48B's MoE (256 experts of 1024, top 8, D 2304, one shared expert) in bf16 on the GPU, for N tokens:
    (x, idx, w, gate_up, down, shared)."""
    g = torch.Generator(device=DEV).manual_seed(N)   # on the device: the expert weights are 3.6 GB
    D, I, E, K, bf = 2304, 1024, 256, 8, torch.bfloat16
    x = torch.randn(N, D, generator=g, device=DEV).to(bf)
    gate_up = (torch.randn(E, 2 * I, D, generator=g, device=DEV) / D ** 0.5).to(bf)
    down = (torch.randn(E, D, I, generator=g, device=DEV) / I ** 0.5).to(bf)
    idx, w = ops.moe_route_torch(torch.randn(N, E, generator=g, device=DEV), torch.zeros(E, device=DEV), K, 2.446,
                                 True)
    shared = MLP(D, I).to(bf).to(DEV).requires_grad_(False)
    for p in shared.parameters():
        p.copy_((torch.randn(p.shape, generator=g, device=DEV) * p.shape[-1] ** -0.5).to(bf))
    return x, idx, w, gate_up, down, shared


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [17, 8192])
def test_gpu_grouped_moe_real_shapes(N):
    """The 48B's MoE in bf16: the grouped-GEMM path (torch's grouped GEMMs) against the expert loop, both rounding
    once from the fp32 sum."""
    x, idx, w, gate_up, down, shared = moe_48b(N)
    bf = torch.bfloat16
    y = ops.moe_experts(x, idx, w, gate_up, down, shared)
    ref = (ops.moe_experts_torch(x, idx, w, gate_up, down) + shared(x).float()).to(bf)
    assert y.dtype == bf and torch.isfinite(y).all()
    assert rel_err(y, ref) < 5e-3
    assert (y == ref).float().mean() > 0.8   # the GEMMs' orders differ; rounding elsewhere would differ far more
    again = ops.moe_experts(x, idx, w, gate_up, down, shared)
    assert torch.equal(y, again), "the combine must be deterministic"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [17, 1024, 8192])
@pytest.mark.parametrize("use", [("down",), ("gate_up", "down")])
@pytest.mark.parametrize("loads", [dict(), dict(tma=True), dict(tma=True, persistent=True)])
def test_gpu_triton_grouped_kernels_match_torchs(N, use, loads):
    """The candidate grouped kernels (benchmarks/candidates/moe_grouped.py) in place of torch's grouped GEMMs at the
    48B's shapes, against the torch
    form: both accumulate each output tile in fp32 on the tensor cores over the same k blocks and round once (the
    benchmark's check reads a relative error of 0 at 8192 and 32768 tokens); tiles loaded per thread or by TMA,
    a program a tile or persistent."""
    x, idx, w, gate_up, down, shared = moe_48b(N)
    from benchmarks.candidates import moe_grouped
    ref = ops.moe_experts(x, idx, w, gate_up, down, shared)
    with moe_grouped.installed(dict(use=list(use), gate_up=loads, down=loads)):
        y = ops.moe_experts(x, idx, w, gate_up, down, shared)
    assert torch.isfinite(y).all() and rel_err(y, ref) < 1e-3


"""Triton MoE kernels (router, routing, expert GEMVs) against the PyTorch references, via the interpreter on CPU.

Every buffer a kernel writes is allocated NaN-filled (`model.triton.empty` patched), so an element a kernel
leaves unwritten fails the comparison. Tests marked `gpu` run the model's real shapes (D=2304, I=1024,
E=256, top-8 + shared expert, bf16) and the bf16 rounding points."""


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer  # noqa: E402

import model.triton as mt  # noqa: E402
from model import ops  # noqa: E402
from model.layers import MLP  # noqa: E402
from model.triton.moe import (expert_down, expert_gate_up, fused_moe_decode, fused_moe_small_batch,  # noqa: E402
                              fused_router, route)
from model.triton.moe_combine import _moe_combine_kernel  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")


_REAL_EMPTY = mt.empty  # the early-start tests need it: a poisoning fill would be a kernel between two launches


def _nan_empty(*shape, dtype, device):
    t = torch.empty(*shape, dtype=dtype, device=device)
    return t.fill_(-1) if not (dtype.is_floating_point or dtype.is_complex) else t.fill_(float("nan"))


@pytest.fixture(autouse=True, scope="module")
def poisoned_buffers():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "empty", _nan_empty)
        yield


def same_routing(idx, w, ridx, rw, tol=1e-6):
    """The same set of experts per token, with the same weights (order may differ: sorted=False)."""
    o, ro = idx.sort(-1), ridx.sort(-1)
    assert torch.equal(o.values, ro.values)
    assert torch.isfinite(w).all()
    assert rel_err(w.gather(-1, o.indices), rw.gather(-1, ro.indices)) < tol


@given(N=st.integers(1, 4), E=st.sampled_from([8, 12, 32]), K=st.sampled_from([1, 2, 4]), seed=st.integers(0, 999),
       renorm=st.booleans())
def test_route_matches_torch(N, E, K, seed, renorm):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g).to(DEV)
    bias = (0.1 * torch.randn(E, generator=g)).to(DEV)
    idx, w = route(logits, bias, K, 2.446, renorm)
    ridx, rw = ops.moe_route_torch(logits, bias, K, 2.446, renorm)
    same_routing(idx, w, ridx, rw)


def router_inputs(N, E, D, seed, exact):
    """x (bf16-representable) [N, D], fp32 router weight [E, D], bias [E]. With `exact`, small integers over a
    power of two: every partial sum is exact in fp32, so logits agree to the bit in any summation order and
    the chosen experts must agree exactly."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        x = torch.randint(-4, 5, (N, D), generator=g).float()
        wr = torch.randint(-8, 9, (E, D), generator=g).float() / 64
    else:
        x = torch.randn(N, D, generator=g).bfloat16().float()
        wr = torch.randn(E, D, generator=g) / D ** 0.5
    bias = 0.1 * torch.randn(E, generator=g)
    return x.to(DEV), wr.to(DEV), bias.to(DEV)


@given(N=st.integers(1, 5), E=st.sampled_from([8, 12, 32, 64]), D=st.sampled_from([16, 40, 96]),
       K=st.sampled_from([1, 2, 4, 8]), block_e=st.sampled_from([1, 2, 4]), seed=st.integers(0, 999),
       renorm=st.booleans())
def test_fused_router_matches_torch(N, E, D, K, block_e, seed, renorm):
    """Exact-arithmetic inputs: the same experts and weights as GEMM + torch routing, for every tile width
    (E not a multiple of BLOCK_E included); two calls in a row show the arrival counters were put back."""
    K = min(K, E)
    x, wr, bias = router_inputs(N, E, D, seed, exact=True)
    with ops.use("torch"):
        ridx, rw = ops.moe_router(x, wr, bias, K, 2.446, renorm)
    for _ in range(2):
        idx, w = fused_router(x, wr, bias, K, 2.446, renorm, cfg=dict(BLOCK_E=block_e))
        same_routing(idx, w, ridx, rw)


@given(N=st.integers(1, 3), seed=st.integers(0, 999))
def test_router_dispatch_matches_torch_on_random_weights(N, seed):
    """Random (inexact) inputs through ops.moe_router, both sides of the batch-size dispatch; logits may
    differ by fp32 summation order, so only tokens whose K-th and (K+1)-th choices are apart are compared."""
    E, D, K = 32, 64, 4
    x, wr, bias = router_inputs(N, E, D, seed, exact=False)
    with ops.use("torch"):
        ridx, rw = ops.moe_router(x, wr, bias, K, 2.446, True)
        choice = (torch.sigmoid(x @ wr.T) + bias).sort(-1, descending=True).values
    clear = (choice[:, K - 1] - choice[:, K]) > 1e-5
    with ops.use("triton"):
        big = x.repeat(ops.SMALL_BATCH + 1, 1)
        for idx, w in (ops.moe_router(x, wr, bias, K, 2.446, True),
                       tuple(t[:N] for t in ops.moe_router(big, wr, bias, K, 2.446, True))):
            same_routing(idx[clear], w[clear], ridx[clear], rw[clear], tol=1e-5)


def test_router_keeps_a_bf16_copy_only_of_bf16_values():
    """`Router.pack_` keeps a bf16 copy for the prefill GEMM only when bf16 holds the weight exactly (checkpoint
    values); a weight bf16 would round keeps the fp32 GEMM."""
    from model.config import PRESETS
    from model.layers import Router
    r = Router(PRESETS["tiny"])
    r.weight.data = torch.randn(r.weight.shape)
    r.pack_()
    assert r.weight_bf16 is None
    r.weight.data = r.weight.data.bfloat16().float()
    r.pack_()
    assert r.weight_bf16.dtype == torch.bfloat16 and torch.equal(r.weight_bf16.float(), r.weight)


@pytest.mark.gpu
@gpu
def test_router_bf16_gemm_routes_as_the_fp32_gemm():
    """Prefill-sized bf16 batches: logits from the bf16 GEMM with fp32 output pick the fp32 GEMM's experts with
    its weights (tokens with a near-tie at the K-th choice aside)."""
    E, D, K, N = 256, 2304, 8, 4096
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEV)
    wr = (torch.randn(E, D, generator=g) / D ** 0.5).bfloat16().float().to(DEV)
    bias = (0.01 * torch.randn(E, generator=g)).to(DEV)
    idx, w = ops.moe_router(x, wr, bias, K, 2.446, True)
    idx2, w2 = ops.moe_router(x, wr, bias, K, 2.446, True, wr.bfloat16())
    choice = (torch.sigmoid(x.float() @ wr.T) + bias).sort(-1, descending=True).values
    clear = (choice[:, K - 1] - choice[:, K]) > 1e-5
    assert clear.float().mean() > 0.9
    same_routing(idx2[clear], w2[clear], idx[clear], w[clear], tol=1e-5)


def test_router_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="do not fit"):
        fused_router(torch.randn(1, 16), torch.randn(8, 12), torch.zeros(8), 2, 1.0, True)
    with pytest.raises(ValueError, match="power of two"):
        fused_router(torch.randn(1, 16), torch.randn(8, 16), torch.zeros(8), 3, 1.0, True)
    with pytest.raises(ValueError, match="unknown cfg keys"):   # a sweep's typo is an error, not the default
        fused_router(torch.randn(1, 16, device=DEV), torch.randn(8, 16, device=DEV), torch.zeros(8, device=DEV), 2,
                     1.0, True, cfg=dict(BLOCK_D=4))


def expert_inputs(N, D, I, E, K, seed, with_shared, dtype=torch.float32):
    """Drawn on the device (the real shapes' 3.6 GB of experts would take long on the host)."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

    x = rnd(N, D)
    gate_up, down = rnd(E, 2 * I, D, scale=D ** -0.5), rnd(E, D, I, scale=I ** -0.5)
    idx = torch.stack([torch.randperm(E, generator=g, device=DEV)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g, device=DEV)
    shared = None
    if with_shared:
        shared = MLP(D, I).to(dtype).to(DEV).requires_grad_(False)
        for p in shared.parameters():
            p.copy_(rnd(*p.shape, scale=p.shape[-1] ** -0.5))
    return x, idx, w, gate_up, down, shared


# D: a whole gate_up tile (16) and a masked one (40); the down kernel runs one program per output row of a token
@given(N=st.integers(1, 3), D=st.sampled_from([16, 40]), I=st.sampled_from([8, 24, 32]), E=st.sampled_from([4, 9]),
       K=st.sampled_from([1, 2, 3]), seed=st.integers(0, 999), with_shared=st.booleans())
def test_experts_match_torch(N, D, I, E, K, seed, with_shared):
    x, idx, w, gate_up, down, shared = expert_inputs(N, D, I, E, K, seed, with_shared)
    with ops.use("triton"):
        y = ops.moe_experts(x, idx, w, gate_up, down, shared)
    with ops.use("torch"):
        ref = ops.moe_experts(x, idx, w, gate_up, down, shared)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < 1e-5


@given(D=st.sampled_from([40, 64]), I=st.sampled_from([24, 32]), K=st.sampled_from([3, 4]),
       gu=st.sampled_from([(8, 16), (4, 32), (16, 64)]), dn=st.sampled_from([(1, 8), (4, 16), (8, 32), (2, 64)]),
       seed=st.integers(0, 999), with_shared=st.booleans())
def test_expert_tiles_match_torch(D, I, K, gu, dn, seed, with_shared):
    """Every tile shape the benchmark's sweep may pick computes the same thing (masked edges included)."""
    x, idx, w, gate_up, down, shared = expert_inputs(2, D, I, 6, K, seed, with_shared)
    sw = None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    y = fused_moe_small_batch(x, idx, w, gate_up, down, sw,
                              gate_up_cfg=dict(BLOCK_I=gu[0], BLOCK_D=gu[1]), down_cfg=dict(BLOCK_D=dn[0], BLOCK_I=dn[1]))
    with ops.use("torch"):
        ref = ops.moe_experts(x, idx, w, gate_up, down, shared)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < 1e-5


def test_experts_reject_wrong_shapes():
    x = torch.randn(1, 16)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_small_batch(x, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.randn(4, 16, 32),
                              torch.randn(4, 16, 4))
    x, idx = x.to(DEV), torch.zeros(1, 2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="unknown cfg keys"):   # a sweep's typo is an error, not the default
        expert_gate_up(x, idx, torch.randn(4, 8, 16, device=DEV), cfg=dict(BLOCK_K=16))
    with pytest.raises(ValueError, match="unknown cfg keys"):
        expert_down(torch.randn(2, 4, device=DEV), idx, torch.ones(1, 2, device=DEV), torch.randn(4, 16, 4, device=DEV),
                    cfg=dict(BLOCK_K=16))


# The grouped form at small fp32 shapes runs on the CPU (torch's grouped_mm); its Triton combine step can take CPU
# tensors only through the interpreter, so on a GPU box (compiled kernels) only the torch combine is drawn here.
_INTERPRETED = type(_moe_combine_kernel).__name__ == "InterpretedFunction"


@given(N=st.integers(1, 40), E=st.sampled_from([4, 9]), K=st.sampled_from([1, 2, 3]), seed=st.integers(0, 999),
       combine=st.sampled_from(["torch", "triton"] if _INTERPRETED else ["torch"]), held=st.sampled_from([None, "bf16"]))
def test_grouped_gemm_form_matches_loop(N, E, K, seed, combine, held):
    """fp32 tokens against fp32 stacks (torch's grouped GEMM) or against stacks held in bf16 (`ops.grouped_mm`'s
    per-group GEMMs, each stack widened), both held against the reference loop on the same stacks."""
    g = torch.Generator().manual_seed(seed)
    D, I = 32, 16
    x = torch.randn(N, D, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    if held:
        gate_up, down = gate_up.bfloat16(), down.bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g)
    with ops.use(combine):  # the combine step's implementation (grouped_mm itself is torch's)
        y = ops.moe_experts_grouped(x, idx, w, gate_up, down)
    assert y.dtype == torch.float32
    assert rel_err(y, ops.moe_experts_torch(x, idx, w, gate_up, down)) < 1e-5


@given(N=st.integers(1, 40), K=st.sampled_from([1, 3, 8]), D=st.sampled_from([8, 40, 300]), seed=st.integers(0, 999),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_dispatch_matches_torch(N, K, D, seed, dtype):
    """The grouped form's dispatch (token rows in expert order) copies exactly torch's x[order // K], every row
    (outputs NaN-poisoned), at widths that leave a partial column block."""
    from model.triton.moe_dispatch import moe_dispatch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    order, _ = ops.sort_by_expert(torch.randint(0, 7, (N, K), generator=g), 7)
    assert torch.equal(moe_dispatch(x, order, K), ops.moe_dispatch_torch(x, order, K))


def test_dispatch_rejects_wrong_shapes():
    from model.triton.moe_dispatch import moe_dispatch
    with pytest.raises(ValueError, match="do not fit K=2"):
        moe_dispatch(torch.zeros(4, 8), torch.arange(6), 2)


@given(N=st.integers(1, 50), K=st.sampled_from([1, 2, 8]), E=st.sampled_from([3, 64, 40_000]), seed=st.integers(0, 999))
def test_sort_by_expert_equals_a_stable_argsort_and_counts(N, K, E, seed):
    """The grouped form's pair order and expert offsets against the obvious forms (a stable argsort of the int64
    ids, a cumulative bincount), with experts left empty anywhere; E = 40,000 takes the int32 keys."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E, (N, K), generator=g)
    idx[0, 0] = E - 1  # the largest id is always present
    order, offs = ops.sort_by_expert(idx, E)
    flat = idx.reshape(-1)
    assert order.dtype == torch.int64 and torch.equal(order, torch.argsort(flat, stable=True))
    assert offs.dtype == torch.int32 and offs.shape == (E,)
    assert torch.equal(offs, torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32))


@pytest.mark.gpu
@gpu
def test_prefill_moe_layer_does_not_sync():
    """A prefill-sized MoE layer (router, sort, grouped GEMMs, shared expert, combine) never waits on the host,
    so the CPU stays ahead of the GPU: a bincount in the sort synced twice a layer and left the GPU idle about
    0.4 ms a layer in the 8k prefill."""
    from model.config import PRESETS
    from model.layers import MoE
    cfg = PRESETS["tiny"]
    moe = MoE(cfg).to(DEV, torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(0)
    for p in moe.parameters():
        p.data.normal_(0, 0.05, generator=g)
    x = torch.randn(4, 256, cfg.hidden_size, device=DEV, dtype=torch.bfloat16, generator=g)
    want = moe(x)  # warm up: first calls compile kernels and may query the device
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, want)


@given(counts=st.lists(st.integers(0, 70), min_size=1, max_size=9), BM=st.sampled_from([1, 4, 16, 64]))
def test_expert_tiles_cover_every_row_once(counts, BM):
    """The fused grouped GEMMs' row tiles: each of an expert's rows in exactly one tile of that expert, tiles in
    expert order, and the grid's spare tiles (room for any routing) marked dead."""
    from benchmarks.candidates.moe_grouped import expert_tiles
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    M = int(offs[-1])
    tile_e, tile_r0 = expert_tiles(offs, M, BM)
    assert tile_e.numel() == -(-M // BM) + len(counts)
    covered = torch.zeros(M, dtype=torch.int64)
    starts = [0] + offs.tolist()[:-1]
    for e, r0 in zip(tile_e.tolist(), tile_r0.tolist()):
        if e < 0:
            continue
        rows = range(r0, min(r0 + BM, int(offs[e])))
        assert r0 >= starts[e] and len(rows) > 0
        covered[list(rows)] += 1
    assert torch.equal(covered, torch.ones(M, dtype=torch.int64))
    live = tile_e[tile_e >= 0]
    assert torch.equal(live, live.sort().values) and (tile_e[live.numel():] == -1).all()


@given(N=st.integers(1, 24), E=st.sampled_from([4, 9]), K=st.sampled_from([1, 2, 4]), seed=st.integers(0, 999),
       shared=st.booleans(), n_fastest=st.booleans(), use=st.sampled_from([("gate_up", "down"), ("down",), ("gate_up",)]),
       tma=st.booleans(), persistent=st.booleans())
def test_fused_grouped_form_matches_the_torch_form(N, E, K, seed, shared, n_fastest, use, tma, persistent):
    """The candidate Triton grouped GEMMs with the dispatch and SwiGLU fused in (`benchmarks.candidates.moe_grouped`,
    installed in the model's grouped experts) against the torch grouped form and the reference loop, bf16, at widths
    that leave partial tiles in every dimension, in either program order, with either or both kernels in place of
    torch's, their tiles loaded by TMA descriptors or per thread, a program a tile or persistent programs; outputs
    NaN-poisoned."""
    from benchmarks.candidates import moe_grouped
    g = torch.Generator().manual_seed(seed)
    D, I = 40, 24
    x = torch.randn(N, D, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).bfloat16()
    down = (torch.randn(E, D, I, generator=g) / I ** 0.5).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g)
    s = torch.randn(N, D, generator=g).bfloat16() if shared else None
    with ops.use("triton"):
        torch_form = ops.moe_experts_grouped(x, idx, w, gate_up, down, s)
        with moe_grouped.installed(dict(
                use=use, n_fastest=n_fastest,
                gate_up=dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=2, tma=tma, persistent=persistent),
                down=dict(BM=32, BN=16, BK=16, num_warps=4, num_stages=2, tma=tma, persistent=persistent))):
            fused = ops.moe_experts_grouped(x, idx, w, gate_up, down, s)
    loop = ops.moe_experts_torch(x, idx, w, gate_up, down) + (0 if s is None else s.float())
    assert fused.dtype == torch.bfloat16 and torch.isfinite(fused).all()
    # bf16 roundings at the same points, sums in another order (measured ~0.003 against the loop, ~0.008 against
    # the torch form, whose interpreted silu_mul truncates where the GPU rounds: with use=("down",) h is the torch
    # form's, so then the loop is as far as the torch form, up to ~0.012)
    assert rel_err(fused.float(), loop) < (1e-2 if "gate_up" in use else 2e-2)
    assert rel_err(fused.float(), torch_form.float()) < 2e-2


@pytest.mark.parametrize("use", [("gate_up",), ("down",)])
@pytest.mark.parametrize("tma", [False, True])
def test_control_grouped_kernels_on_the_wrong_experts_are_caught(use, tma, monkeypatch):
    """The fused-form test's checks see a kernel that multiplies a row tile by its neighbour expert's weights (each
    tile's expert shifted by one, and with it the tile's live rows): non-finite rows (left unwritten) or far past
    its tolerance, with the tiles loaded either way."""
    from benchmarks.candidates import moe_grouped
    x, idx, w, gate_up, down = _small_moe(seed=1, N=20, D=40, I=24)
    E = gate_up.shape[0]
    real = moe_grouped.expert_tiles

    def shifted(offs, M, BM):
        e, r0 = real(offs, M, BM)
        return torch.where(e >= 0, (e + 1) % E, e), r0
    monkeypatch.setattr(moe_grouped, "expert_tiles", shifted)
    tiles = dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=2, tma=tma, persistent=False)
    with ops.use("triton"), moe_grouped.installed(dict(use=use, gate_up=tiles, down=tiles)):
        wrong = ops.moe_experts_grouped(x, idx, w, gate_up, down)
    loop = ops.moe_experts_torch(x, idx, w, gate_up, down)
    assert not (torch.isfinite(wrong).all() and rel_err(wrong.float(), loop) < 2e-2)


def _small_moe(seed=0, N=3, E=4, K=2, D=16, I=8, dtype=torch.bfloat16):
    """(x, idx, w, gate_up, down): a small seeded MoE layer's inputs, each token's K experts distinct."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(dtype)
    down = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return x, idx, torch.rand(N, K, generator=g), gate_up, down


def test_experts_kernel_runs_its_function_inside_its_block_alone():
    """`ops.experts_kernel(fn)`: inside the block `moe_experts_grouped` combines what fn returns for the sorted pairs
    (here the torch form's outputs doubled, so the fp32 result doubles exactly); outside it, after an inner block of
    None, after a block that raised, and in another thread inside the block, the torch form's bits."""
    import threading
    x, idx, w, gate_up, down = _small_moe(dtype=torch.float32)
    ref = ops.moe_experts_grouped(x, idx, w, gate_up, down)
    seen = []

    def doubled(x_, order, offs, gate_up_, down_, K):
        seen.append((order, offs, K))
        return 2 * ops.grouped_experts(x_, order, offs, gate_up_, down_, K)
    with ops.experts_kernel(doubled):
        y = ops.moe_experts_grouped(x, idx, w, gate_up, down)
        with ops.experts_kernel(None):
            assert torch.equal(ops.moe_experts_grouped(x, idx, w, gate_up, down), ref)
        other = []
        t = threading.Thread(target=lambda: other.append(ops.moe_experts_grouped(x, idx, w, gate_up, down)))
        t.start()
        t.join()
    assert torch.equal(y, 2 * ref) and not torch.equal(y, ref)
    assert len(seen) == 1 and seen[0][2] == idx.shape[1]
    order, offs = ops.sort_by_expert(idx, gate_up.shape[0])
    assert torch.equal(seen[0][0], order) and torch.equal(seen[0][1], offs)
    assert torch.equal(other[0], ref)
    with pytest.raises(RuntimeError, match="inside the block"):
        with ops.experts_kernel(doubled):
            raise RuntimeError("a failure inside the block")
    assert torch.equal(ops.moe_experts_grouped(x, idx, w, gate_up, down), ref) and len(seen) == 1
    with pytest.raises(TypeError, match="takes a function"):
        with ops.experts_kernel("moe_grouped"):
            pass


def test_an_installed_candidate_reaches_the_models_grouped_experts(monkeypatch):
    """`installed` runs the candidate inside `moe_experts_grouped`: its down kernel is called with the block's tiles
    inside the block, and not outside it, where torch's grouped GEMM runs (the negative control)."""
    from benchmarks.candidates import moe_grouped
    x, idx, w, gate_up, down = _small_moe()
    calls, real = [], moe_grouped.down
    monkeypatch.setattr(moe_grouped, "down", lambda h, offs, down_w, cfg=None: (calls.append(cfg["down"]),
                                                                                 real(h, offs, down_w, cfg))[1])
    tiles = dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=2)
    with ops.use("triton"):
        ref = ops.moe_experts_grouped(x, idx, w, gate_up, down)
        assert calls == []
        with moe_grouped.installed(dict(use=["down"], down=tiles)):
            y = ops.moe_experts_grouped(x, idx, w, gate_up, down)
        assert len(calls) == 1 and {k: calls[0][k] for k in tiles} == tiles
        ops.moe_experts_grouped(x, idx, w, gate_up, down)
    assert len(calls) == 1
    assert torch.isfinite(y).all() and rel_err(y.float(), ref.float()) < 2e-2


def test_the_candidate_refuses_what_it_cannot_run():
    """An unknown key (nested too), a value of another kind, or a `use` naming none or another of its kernels is
    refused before the block runs; fp32 inputs are `Unsupported` (bf16 kernels); its CONFIG is read-only."""
    from benchmarks.candidates import Unsupported, moe_grouped
    ran = []
    for bad, why in ((dict(down=dict(BQ=1)), r"\['down'\]: unknown cfg keys \['BQ'\]"),
                     (dict(tiles=1), r"unknown cfg keys \['tiles'\]"),
                     (dict(n_fastest="yes"), "'n_fastest' must be true/false"),
                     (dict(use=()), "'use' must name one or both of"),
                     (dict(use=("gate_up", "up")), "'use' must name one or both of")):
        with pytest.raises(mt.UnknownConfigKeys, match=why):
            with moe_grouped.installed(bad):
                ran.append(bad)
    assert ran == []
    assert moe_grouped.config(dict(use=["down"]))["use"] == ["down"]  # a list names kernels as a tuple does
    x, idx, w, gate_up, down = _small_moe(dtype=torch.float32)
    with ops.use("triton"), moe_grouped.installed():
        with pytest.raises(Unsupported, match="bf16 tokens and expert stacks only, got x torch.float32"):
            ops.moe_experts_grouped(x, idx, w, gate_up, down)
    with pytest.raises(TypeError):
        moe_grouped.CONFIG["use"] = ("down",)
    with pytest.raises(TypeError):
        moe_grouped.CONFIG["down"]["tma"] = True
    assert moe_grouped.CONFIG["use"] == ("gate_up", "down") and moe_grouped.CONFIG["down"]["tma"] is False


def _imports_of(src: str) -> set[str]:
    """The modules a Python source imports, by their full names (`from a import b` as a and a.b)."""
    import ast
    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_model_imports_no_candidate():
    """`model/` holds only what the default path runs: none of its sources imports `benchmarks` (where candidates
    live), so a candidate reaches the model only through `ops.experts_kernel`. The check sees such an import."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "model"
    found = {str(p.relative_to(root)): sorted(m for m in _imports_of(p.read_text()) if m.split(".")[0] == "benchmarks")
             for p in sorted(root.rglob("*.py"))}
    assert len(found) >= 20 and {p: m for p, m in found.items() if m} == {}
    assert not (root / "triton" / "moe_grouped.py").exists()
    assert "benchmarks.candidates.moe_grouped" in _imports_of("def f():\n    from benchmarks.candidates import "
                                                              "moe_grouped\n")


def test_grouped_mm_per_group_form_equals_torchs():
    """The per-group fallback of `ops.grouped_mm` (bf16 stacks under fp32 rows) against torch's grouped GEMM on the
    widened stacks, with empty groups at the ends and in the middle."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(10, 24, generator=g)
    b = (torch.randn(5, 24, 8, generator=g)).bfloat16()
    offs = torch.tensor([0, 3, 3, 10, 10], dtype=torch.int32)
    got = ops.grouped_mm(a, b, offs)
    want = F.grouped_mm(a, b.float(), offs=offs)
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6
    assert rel_err(got[3:], a[3:] @ b[3].float()) < 1e-6  # group 3 holds rows 3:10 (groups 0, 2 and 4 are empty)


# ---- real shapes on the GPU ---------------------------------------------------------------------

@pytest.mark.gpu
@gpu
def test_bf16_rounds_where_the_prefill_path_rounds():
    """In bf16 the fused decode kernel and the PyTorch path round at the same points, so they differ only by
    fp32 summation order: nearly every output element is bit-identical. (Not on CPU: Triton's interpreter
    truncates fp32 -> bf16 instead of rounding to nearest.)"""
    x, idx, w, gate_up, down, shared = expert_inputs(2, 64, 32, 8, 3, 3, True, torch.bfloat16)
    with ops.use("triton"):
        y = ops.moe_experts(x, idx, w, gate_up, down, shared)
    with ops.use("torch"):
        ref = ops.moe_experts(x, idx, w, gate_up, down, shared)
    assert rel_err(y, ref) < 5e-3
    assert (y == ref).float().mean() > 0.95


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1, 8, 16])
def test_gpu_real_shapes(N, no_tf32):
    """48B-A3B shapes (E=256 experts, D=2304, I=1024, top-8 + shared, bf16): the router picks the torch
    reference's experts (tokens with a near-tie at the K-th choice aside), the experts match the torch loop
    closely (bf16 rounding points aligned), repeated runs and CUDA graph replays give identical bits."""
    E, D, I, K = 256, 2304, 1024, 8
    x, idx, w, gate_up, down, shared = expert_inputs(N, D, I, E, K, N, True, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    wr = (torch.randn(E, D, generator=g) / D ** 0.5).to(DEV)
    bias = (0.01 * torch.randn(E, generator=g)).to(DEV)
    with ops.use("torch"):
        ridx, rw = ops.moe_router(x, wr, bias, K, 2.446, True)
        ref = ops.moe_experts(x, idx, w, gate_up, down, shared)
        choice = (torch.sigmoid(x.float() @ wr.T) + bias).sort(-1, descending=True).values
    clear = (choice[:, K - 1] - choice[:, K]) > 1e-5
    assert clear.float().mean() > 0.5
    with ops.use("triton"):
        ridx2, rw2 = ops.moe_router(x, wr, bias, K, 2.446, True)
        y = ops.moe_experts(x, idx, w, gate_up, down, shared)
        same_routing(ridx2[clear], rw2[clear], ridx[clear], rw[clear], tol=1e-5)
        assert rel_err(y, ref) < 5e-3
        assert (y == ref).float().mean() > 0.9
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gi, gw = ops.moe_router(x, wr, bias, K, 2.446, True)
            gy = ops.moe_experts(x, gi, gw, gate_up, down, shared)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(gi, ridx2) and torch.equal(gw, rw2)
            assert torch.equal(gy, ops.moe_experts(x, ridx2, rw2, gate_up, down, shared))


def decode_inputs(N, D, I, E, K, seed, with_shared, dtype=torch.float32):
    """`expert_inputs` plus a router: fp32 weight [E, D] and bias [E]."""
    x, _, _, gate_up, down, shared = expert_inputs(N, D, I, E, K, seed, with_shared, dtype)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    wr = torch.randn(E, D, generator=g, device=DEV) / D ** 0.5
    bias = 0.01 * torch.randn(E, generator=g, device=DEV)
    sw = None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    return x, wr, bias, gate_up, down, shared, sw


# D: whole tiles (16) and masked ones (24) in the router and gate_up; the down kernel runs one program per output row
@given(N=st.integers(1, 3), D=st.sampled_from([16, 24]), I=st.sampled_from([8, 24]), E=st.sampled_from([8, 12]),
       K=st.sampled_from([1, 2, 4]), seed=st.integers(0, 999), with_shared=st.booleans())
def test_fused_moe_decode_equals_router_then_experts(N, D, I, E, K, seed, with_shared):
    """The model's MoE block (`fused_moe_decode`) gives the bits of the router followed by the expert launches, and
    the torch reference's values."""
    x, wr, bias, gate_up, down, shared, sw = decode_inputs(N, D, I, E, K, seed, with_shared)
    idx, w = fused_router(x, wr, bias, K, 2.446, True)
    y = fused_moe_decode(x, wr, bias, K, 2.446, True, gate_up, down, sw)
    assert torch.equal(y, fused_moe_small_batch(x, idx, w, gate_up, down, sw))
    with ops.use("torch"):
        ref = ops.moe_experts(x, *ops.moe_router(x, wr, bias, K, 2.446, True), gate_up, down, shared)
    assert rel_err(y, ref) < 1e-5


def test_early_starts_only_when_nothing_is_copied_before_them(monkeypatch):
    """PDL is asked for only on CUDA, compiled, and when the block copies none of its inputs: a copy would be the
    kernel just before an early launch, which the launch may overtake (here, on the CPU, never)."""
    from model.triton import moe
    seen = []
    real = moe.pdl
    monkeypatch.setattr(moe, "pdl", lambda kernel, device, early: (seen.append(early), real(kernel, device, early))[1])
    x, wr, bias, gate_up, down, shared, sw = decode_inputs(2, 16, 8, 8, 2, 0, True)
    fused_moe_decode(x, wr, bias, 2, 2.446, True, gate_up, down, sw)
    fused_moe_decode(x, wr, bias.double(), 2, 2.446, True, gate_up, down, sw)  # the bias is copied to fp32
    fused_moe_decode(x.t().contiguous().t(), wr, bias, 2, 2.446, True, gate_up, down, sw)  # x is copied
    assert seen == [True] * 3 + [False] * 6  # router, gate_up and down, per call
    want = fused_moe_decode(x, wr, bias, 2, 2.446, True, gate_up, down, sw)
    for i in range(3):  # one of the shared expert's weights would be copied (just before gate_up or down)
        strided = tuple(t.t().contiguous().t() if j == i else t for j, t in enumerate(sw))
        del seen[:]
        y = fused_moe_decode(x, wr, bias, 2, 2.446, True, gate_up, down, strided)
        assert seen == [False] * 3 and torch.equal(y, want)
    assert real(moe._moe_router_kernel, torch.device(DEV), True) == (
        dict(PDL=True, launch_pdl=True) if DEV == "cuda" and mt.compiled(moe._moe_router_kernel) else dict(PDL=False))


def test_model_moe_block_takes_the_fused_decode_path(monkeypatch):
    """`ops.moe` (the model's MoE block): `fused_moe_decode` for decode-sized batches under "triton", routing
    then `moe_experts` past SMALL_BATCH and under "torch"; all agree with the torch reference."""
    from model.layers import MoE
    from model.triton import moe
    cfg = type("Cfg", (), dict(num_experts=8, num_experts_per_token=2, routed_scaling_factor=2.446,
                               moe_renormalize=True, hidden_size=32, moe_intermediate_size=16, num_shared_experts=1))()
    block = MoE(cfg).to(DEV).requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    block.gate.pack_()
    calls = []
    real = moe.fused_moe_decode
    monkeypatch.setattr(moe, "fused_moe_decode", lambda x, *a: (calls.append(x.shape[0]), real(x, *a))[1])
    x = torch.randn(ops.SMALL_BATCH + 1, 32, generator=g).to(DEV)
    with ops.use("torch"):
        ref = block(x)
    with ops.use("triton"):
        few, many = block(x[:3]), block(x)
    assert calls == [3]
    assert rel_err(few, ref[:3]) < 1e-5 and rel_err(many, ref) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.parametrize("before", ["copy", "norm"])
def test_gpu_early_starts_keep_the_bits(N, before, monkeypatch):
    """At 48B-A3B's shapes in bf16, behind a kernel that writes x: a plain copy, or the model's add+norm (which
    lets the router launch as it starts): the early (PDL) launches give the plain launches' bits, eagerly and in
    CUDA graph replays, each replay on new inputs (a launch that read x before the kernel before it wrote x would
    see the last replay's x, or zeros). Buffers come unpoisoned, as in the model: a fill kernel between two
    launches would be the one the second waits for."""
    from model.triton.norms import add_rmsnorm
    monkeypatch.setattr(mt, "empty", _REAL_EMPTY)
    E, D, I, K = 256, 2304, 1024, 8
    x, wr, bias, gate_up, down, shared, sw = decode_inputs(N, D, I, E, K, N, True, torch.bfloat16)
    g = torch.Generator(device=DEV).manual_seed(7)
    res, nw = torch.randn(N, D, generator=g, device=DEV).to(torch.bfloat16), torch.rand(D, generator=g, device=DEV)
    ins = [torch.randn(N, D, generator=g, device=DEV).to(torch.bfloat16) for _ in range(4)]
    buf = ins[0].clone()

    def block():
        if before == "copy":
            torch.mul(buf, 1.0, out=x)  # the kernel just before the block writes its input
            return fused_moe_decode(x, wr, bias, K, 2.446, True, gate_up, down, sw)
        return fused_moe_decode(add_rmsnorm(buf, res, nw, 1e-5)[0], wr, bias, K, 2.446, True, gate_up, down, sw)

    refs = []
    for t in ins:
        src = t if before == "copy" else add_rmsnorm(t, res, nw, 1e-5)[0]
        refs.append(fused_moe_small_batch(src, *fused_router(src, wr, bias, K, 2.446, True), gate_up, down, sw))
    x.zero_()
    assert torch.equal(block(), refs[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy = block()
    for t, ref in zip(ins[1:] + ins[:1], refs[1:] + refs[:1]):
        buf.copy_(t)
        x.zero_()
        gy.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gy, ref)


@triton.jit
def _late_copy_kernel(src, dst, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr):
    """dst <- src, stored DELAY_NS after the program starts, which first lets a launch made after it with PDL start."""
    gdc_launch_dependents()
    t0 = globaltimer()
    while globaltimer() - t0 < DELAY_NS:
        pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def late_copy(src: torch.Tensor, dst: torch.Tensor, delay_us: int = 50) -> None:
    _late_copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), DELAY_NS=delay_us * 1000, BLOCK=1024)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("launch", ["router", "gate_up", "down"])
def test_gpu_early_launches_wait_for_the_kernel_before(launch, monkeypatch):
    """Each early (PDL) launch reads what the kernel just before it writes only once that kernel has finished:
    behind a kernel that lets it start at once and stores its input 50 us later, it gives the plain launch's result,
    eagerly and in CUDA graph replays.
    Checked on the H200 (1508a73): with the router's or gate_up's wait removed, this test fails (down: see
    docs/RESULTS.md, "The early starts' tests"). Two things had hidden
    that. The module's NaN-poisoning fill put a kernel between the launches, so the launch waited for the fill.
    And eager launches alone passed without the router's wait; the graph replays below are what catch it. So the
    buffers are allocated as the model allocates them."""
    from model.triton import moe
    monkeypatch.setattr(mt, "empty", _REAL_EMPTY)
    E, D, I, K = 256, 2304, 1024, 8
    x, wr, bias, gate_up, down, shared, sw = decode_inputs(1, D, I, E, K, 1, True, torch.bfloat16)
    idx, w = fused_router(x, wr, bias, K, 2.446, True)
    if launch == "router":
        ref, dst = (idx, w), torch.zeros_like(x)

        def run():
            late_copy(x, dst)
            return moe.fused_router(dst, wr, bias, K, 2.446, True, early=True)
    elif launch == "gate_up":
        ref, dst = (moe.expert_gate_up(x, idx, gate_up, sw[:2]),), torch.zeros_like(idx)

        def run():
            late_copy(idx, dst)
            return (moe.expert_gate_up(x, dst, gate_up, sw[:2], early=True),)
    else:  # down reads its first weight tiles, then waits for act
        act = moe.expert_gate_up(x, idx, gate_up, sw[:2])
        ref, dst = (moe.expert_down(act, idx, w, down, sw[2]),), torch.zeros_like(act)

        def run():
            late_copy(act, dst)
            return (moe.expert_down(dst, idx, w, down, sw[2], early=True),)
    for _ in range(3):
        dst.zero_()
        out = run()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
    graph = torch.cuda.CUDAGraph()  # as the decode step runs them
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        dst.zero_()
        for t in out:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_arrival_counters_are_one_buffer_made_once():
    """A captured CUDA graph keeps the counters' address: asking for more must never replace the buffer."""
    import model.triton as mt
    dev = torch.device("cpu")
    first = mt.arrival_counters(dev, 4)
    assert mt.arrival_counters(dev, mt.ARRIVAL_COUNTERS) is first and not first.any()
    with pytest.raises(ValueError, match="arrival counters"):
        mt.arrival_counters(dev, mt.ARRIVAL_COUNTERS + 1)
    # the router's logits are such a buffer too, another one: fused_router writes into it, it is never replaced
    from model.triton import moe
    logits = mt.kept_buffer("router logits", torch.device(DEV), 1, moe.ROUTER_LOGITS, torch.float32)
    x, wr, bias, *_ = decode_inputs(2, 16, 8, 8, 2, 0, False)
    logits.zero_()
    fused_router(x, wr, bias, 2, 1.0, True)
    assert logits[:16].ne(0).all() and not logits[16:].any()
    assert mt.kept_buffer("router logits", torch.device(DEV), 5, moe.ROUTER_LOGITS, torch.float32) is logits
    assert mt.kept_buffer("router logits", dev, 1, moe.ROUTER_LOGITS, torch.float32) is not first

"""MLA decode over the latent cache: the Triton split-K kernel and the fp32 absorbed projections against fp64
references (the torch forms in model.ops, run in float64), via the interpreter on CPU; real shapes on the GPU.

Every buffer the kernels write is allocated NaN-filled, so an element left unwritten (or a workspace split
that the combine reads although it never ran) fails the finiteness check.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # also done by conftest.py; needed before the imports below

import pytest  # noqa: E402
from hypothesis import assume, given, strategies as st  # noqa: E402

import model.triton as mt  # noqa: E402
from model import ops  # noqa: E402
from model.triton.mla_decode import _BL, ROWS, SHORT, mla_absorb, mla_decode, plan  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# fp32 cache: IEEE dots; bf16 cache: fp32 operand split into bf16 head + tail (the interpreter truncates the
# tail to bf16 instead of rounding: 2^-16 relative, measured ~1e-5)
TOL = {torch.float32: 2e-6, torch.bfloat16: 5e-5}
SHORT_BL = SHORT["BL"]


@pytest.fixture(autouse=True, scope="module")
def poisoned_buffers():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "empty", lambda *s, dtype, device: torch.full(s[0] if len(s) == 1 and not isinstance(s[0], int)
                                                                      else s, float("nan"), dtype=dtype, device=device))
        yield


def decode_inputs(B, H, R, P, L, dtype, seed, sharp=1.0, device=DEV, qpe_dtype=None):
    """q_lat fp32, q_pe in `qpe_dtype` (default: `dtype`) and the cache in `dtype`; `sharp` scales the query
    (peakier softmax)."""
    g = torch.Generator().manual_seed(seed)
    q_lat = sharp * torch.randn(B, H, R, generator=g)
    q_pe = (sharp * torch.randn(B, H, P, generator=g)).to(qpe_dtype or dtype)
    c = torch.randn(B, L, R, generator=g).to(dtype)
    k_pe = torch.randn(B, L, P, generator=g).to(dtype)
    return [t.to(device) for t in (q_lat, q_pe, c, k_pe)]


def fp64_reference(q_lat, q_pe, c, k_pe, pos, scale):
    return ops.mla_decode_attention_torch(*(t.double() for t in (q_lat, q_pe, c, k_pe)), pos, scale)


def skip_unless_runs(rows, L, B, H, dtype, device, split=None, heads=None):
    """Skip a case whose layout runs the other split kernel than `rows` names (an fp32 cache, SHORT's steps of 32
    positions): it would repeat the heads kernel's case."""
    if plan(L, B, H, dtype, torch.device(device), split, heads, cfg=dict(rows=rows)).rows != rows:
        pytest.skip("this layout runs the heads kernel whatever rows says")


def check(o, ref, tol, what):
    assert torch.isfinite(o).all(), f"{what}: non-finite values (a poisoned element left unwritten or read?)"
    err = rel_err(o, ref)
    assert err <= tol, f"{what}: relative RMS error {err:.3e} > {tol:.1e}"


@given(B=st.sampled_from([1, 2]), H=st.sampled_from([2, 4]), R=st.sampled_from([32, 64]), L=st.integers(1, 300),
       split=st.sampled_from([2 * _BL, 3 * _BL]), where=st.sampled_from(["0", "boundary-1", "boundary", "last"]),
       dtype=st.sampled_from(["fp32", "bf16"]), seed=st.integers(0, 999), rows=st.sampled_from(ROWS),
       qpe=st.sampled_from(["fp32", "bf16", None]))
def test_decode_matches_fp64(B, H, R, L, split, where, dtype, seed, rows, qpe):
    """Either split kernel (`rows`; an fp32 cache takes the heads-as-rows one whatever `rows` says); q_pe in
    the cache's dtype (None) or another (a bf16 q_pe takes one dot, an fp32 one a head and a tail)."""
    P, scale = 16, 0.17
    pos = {"0": 0, "boundary-1": split - 1, "boundary": split, "last": L - 1}[where]
    pos = torch.tensor(min(pos, L - 1), device=DEV)
    q_lat, q_pe, c, k_pe = decode_inputs(B, H, R, P, L, DTYPES[dtype], seed, sharp=2.0,
                                         qpe_dtype=qpe and DTYPES[qpe])
    o = mla_decode(q_lat, q_pe, c, k_pe, pos, scale, split=split, cfg=dict(rows=rows))
    assert o.shape == (B, H, R) and o.dtype == torch.float32
    check(o, fp64_reference(q_lat, q_pe, c, k_pe, pos, scale), TOL[DTYPES[dtype]], f"pos={int(pos)}")


@given(B=st.sampled_from([1, 2]), H=st.sampled_from([2, 4, 6]), heads=st.sampled_from([1, 2, 4]),
       R=st.sampled_from([32, 64]), L=st.integers(1, 300), split=st.sampled_from([2 * SHORT_BL, 3 * SHORT_BL, 2 * _BL]),
       where=st.sampled_from(["0", "boundary-1", "boundary", "last"]), dtype=st.sampled_from(["fp32", "bf16"]),
       seed=st.integers(0, 999), rows=st.sampled_from(ROWS))
def test_head_groups_match_fp64(B, H, heads, R, L, split, where, dtype, seed, rows):
    """The short-buffer layout: heads in groups of `heads` (the last one partly masked at H=6, heads=4),
    splits of SHORT's step (the positions-as-rows kernel where the step is _BL)."""
    assume(heads < H)
    P, scale = 16, 0.17
    pos = {"0": 0, "boundary-1": split - 1, "boundary": split, "last": L - 1}[where]
    pos = torch.tensor(min(pos, L - 1), device=DEV)
    q_lat, q_pe, c, k_pe = decode_inputs(B, H, R, P, L, DTYPES[dtype], seed, sharp=2.0)
    o = mla_decode(q_lat, q_pe, c, k_pe, pos, scale, split=split, heads=heads, cfg=dict(rows=rows))
    assert o.shape == (B, H, R) and o.dtype == torch.float32
    check(o, fp64_reference(q_lat, q_pe, c, k_pe, pos, scale), TOL[DTYPES[dtype]], f"pos={int(pos)}")


@pytest.mark.parametrize("layout", [(2 * _BL, None, "heads"), (2 * _BL, None, "positions"), (2 * SHORT_BL, 2, "heads"),
                                    (2 * _BL, 2, "positions")],
                         ids=["all-heads", "all-heads-positions-rows", "head-groups", "head-groups-positions-rows"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("pos", [0, _BL - 1, 2 * _BL, 3 * _BL + 5])
def test_positions_past_pos_are_not_read(pos, dtype, layout):
    """Huge and NaN values past pos leave the output bit for bit unchanged: they are never loaded."""
    B, H, R, P, L = 2, 4, 32, 16, 5 * _BL
    split, heads, rows = layout
    cfg = dict(rows=rows)
    skip_unless_runs(rows, L, B, H, DTYPES[dtype], DEV, split, heads)
    q_lat, q_pe, c, k_pe = decode_inputs(B, H, R, P, L, DTYPES[dtype], pos)
    p = torch.tensor(pos, device=DEV)
    clean = mla_decode(q_lat, q_pe, c, k_pe, p, 0.2, split=split, heads=heads, cfg=cfg)
    for fill in (float("nan"), 3e38):
        c2, k2 = c.clone(), k_pe.clone()
        c2[:, pos + 1:], k2[:, pos + 1:] = fill, fill
        dirty = mla_decode(q_lat, q_pe, c2, k2, p, 0.2, split=split, heads=heads, cfg=cfg)
        assert torch.isfinite(dirty).all() and torch.equal(dirty, clean), fill
    # and the cache up to pos is read: changing position pos changes the result
    c[:, pos] += 1
    assert not torch.equal(mla_decode(q_lat, q_pe, c, k_pe, p, 0.2, split=split, heads=heads, cfg=cfg), clean)


@pytest.mark.parametrize("H,heads,L,pos", [(6, 4, 300, 299), (4, 1, 200, 150), (4, 2, 130, 129)],
                         ids=["last-group-masked", "one-head-groups", "two-head-groups"])
@pytest.mark.parametrize("rows", ROWS)
def test_head_groups_at_steps_of_64_match_fp64(H, heads, L, pos, rows):
    """Head groups at splits of 2 * _BL (loop steps of _BL: the positions kernel's layout), the query deep in the
    buffer so that every group's softmax spans many positions: a kernel that gave a group another group's query
    fails here (hypothesis's draws reached the positions kernel's head groups only at pos 0, where any query
    gives the same output)."""
    P, scale, split = 16, 0.17, 2 * _BL
    skip_unless_runs(rows, L, 2, H, torch.bfloat16, DEV, split, heads)
    q_lat, q_pe, c, k_pe = decode_inputs(2, H, 32, P, L, torch.bfloat16, H * 100 + heads, sharp=2.0)
    p = torch.tensor(pos, device=DEV)
    o = mla_decode(q_lat, q_pe, c, k_pe, p, scale, split=split, heads=heads, cfg=dict(rows=rows))
    check(o, fp64_reference(q_lat, q_pe, c, k_pe, p, scale), TOL[torch.bfloat16], f"H={H} heads={heads}")


def test_split_kernels_agree_and_rows_is_checked():
    """The two split kernels on one bf16 input: the same value within the products' rounding (their fp32 sums run
    in other orders), not the same bits; an unknown `rows` or cfg key is an error, not a silent default."""
    B, H, R, P, L = 1, 4, 64, 16, 3 * _BL
    q_lat, q_pe, c, k_pe = decode_inputs(B, H, R, P, L, torch.bfloat16, 7, sharp=2.0)
    p = torch.tensor(L - 1, device=DEV)
    a, b = (mla_decode(q_lat, q_pe, c, k_pe, p, 0.2, split=2 * _BL, cfg=dict(rows=r)) for r in ROWS)
    assert rel_err(a, b) <= 2e-6 and not torch.equal(a, b)
    with pytest.raises(ValueError, match="rows must be one of"):
        mla_decode(q_lat, q_pe, c, k_pe, p, 0.2, cfg=dict(rows="columns"))
    with pytest.raises(ValueError, match="positions_warps must be 4 or 8"):
        mla_decode(q_lat, q_pe, c, k_pe, p, 0.2, cfg=dict(rows="positions", positions_warps=6))
    with pytest.raises(ValueError, match="unknown cfg keys"):
        mla_decode(q_lat, q_pe, c, k_pe, p, 0.2, cfg=dict(kernel="positions"))
    # a cache whose offsets within a sequence pass 2^31 (meta tensors: nothing allocated, refused before any launch)
    big = [torch.empty(1, 2 ** 22 + 1, n, dtype=torch.bfloat16, device="meta") for n in (512, 64)]
    q = [torch.empty(1, 4, n, dtype=dt, device="meta") for n, dt in ((512, torch.float32), (64, torch.bfloat16))]
    with pytest.raises(ValueError, match="32 bits"):
        mla_decode(*q, *big, torch.empty((), dtype=torch.long, device="meta"), 0.2, cfg=dict(rows="positions"))


def test_default_layout_groups_heads_only_for_short_buffers(monkeypatch):
    """At the H200's 132 SMs and 32 heads: SHORT's layout up to buffers whose grouped shortest splits fit on
    the SMs at once, the standard one beyond (where it already fills them), and always with SHORT's heads None."""
    from model.triton import mla_decode as ml
    monkeypatch.setattr(ml, "_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert ml.default_layout(1056, 1, 32, cuda) == (64, 16)          # 17 splits x 2 groups, against 9 programs
    assert ml.default_layout(8192, 1, 32, cuda) == (128, 16)         # 64 x 2
    assert ml.default_layout(16384, 1, 32, cuda) == (128, 32)        # the standard layout: 128 programs
    assert ml.default_layout(131072, 1, 32, cuda) == (1024, 32)
    assert ml.default_layout(1056, 8, 32, cuda) == (ml.default_split(1056, 8, cuda), 32)
    with mt.overrides({"mla_decode.SHORT": dict(heads=None)}):
        assert ml.default_layout(1056, 1, 32, cuda) == (ml.MIN_SPLIT, 32)
    assert ml.default_layout(1056, 1, 32, cuda) == (64, 16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_reference_scores_are_fp32(dtype):
    """The torch form keeps scores and p in fp32: close to fp64 where bf16 scores (the old einsum) were ~1e-2 off."""
    q_lat, q_pe, c, k_pe = decode_inputs(1, 4, 64, 16, 200, DTYPES[dtype], 0, sharp=4.0)
    pos = torch.tensor(150)
    ref = fp64_reference(q_lat, q_pe, c, k_pe, pos, 0.17)
    check(ops.mla_decode_attention_torch(q_lat, q_pe, c, k_pe, pos, 0.17), ref, 1e-5, "torch fp32 form")
    s = torch.einsum("bhr,blr->bhl", q_lat.to(c.dtype), c).float()   # the old, rounded score path
    old = torch.einsum("bhl,blr->bhr", torch.softmax((s * 0.17)[..., :151], -1).to(c.dtype), c[:, :151]).float()
    if dtype == "bf16":  # the control: rounding the scores to bf16 is visibly worse
        assert rel_err(old, ref) > 1e-3


@given(B=st.sampled_from([1, 3]), H=st.sampled_from([2, 4]), K=st.sampled_from([8, 16, 96]),
       N=st.sampled_from([16, 40]), x_dtype=st.sampled_from(["fp32", "bf16"]), w_dtype=st.sampled_from(["fp32", "bf16"]),
       transposed=st.booleans(), seed=st.integers(0, 999),
       cfg=st.sampled_from([None, dict(BN=16, BK=32, num_warps=2), dict(BN=32, BK=128, num_warps=8)]))
def test_absorb_matches_fp64(B, H, K, N, x_dtype, w_dtype, transposed, seed, cfg):
    """Every tile config the benchmark's sweep may pick (cfg) computes the same thing, masked edges included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, K, generator=g).to(DTYPES[x_dtype]).to(DEV)
    w = torch.randn(H, N, K, generator=g).to(DTYPES[w_dtype]).to(DEV).transpose(1, 2) if transposed else \
        torch.randn(H, K, N, generator=g).to(DTYPES[w_dtype]).to(DEV)
    y = mla_absorb(x, w, cfg)
    assert y.shape == (B, H, N) and y.dtype == torch.float32
    ref = torch.einsum("bhk,hkn->bhn", x.double(), w.double())
    check(y, ref, 2e-6 if w_dtype == "fp32" or x_dtype == "bf16" else 5e-5, "absorb")
    with ops.use("torch"):
        check(ops.mla_absorb(x, w), ref, 2e-6, "torch absorb")


def cache_append_inputs(B, R, P, L, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    kv = (3 * torch.randn(B, R + P, generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype)
    c, k_pe = torch.randn(B, L, R, generator=g).to(dtype), torch.randn(B, L, P, generator=g).to(dtype)
    return [t.to(device) for t in (kv, weight, c, k_pe)]


@given(B=st.sampled_from([1, 3]), R=st.sampled_from([16, 40, 64]), P=st.sampled_from([8, 16]), L=st.integers(1, 70),
       where=st.sampled_from(["first", "middle", "last"]), dtype=st.sampled_from(["fp32", "bf16"]),
       seed=st.integers(0, 999))
def test_cache_append_matches_torch(B, R, P, L, where, dtype, seed):
    """The one-launch latent append writes rmsnorm(c) and k_pe at pos, as the torch form (norm, two index
    copies) does, and leaves every other position bit for bit as it was."""
    kv, weight, c, k_pe = cache_append_inputs(B, R, P, L, DTYPES[dtype], seed)
    pos = torch.tensor({"first": 0, "middle": L // 2, "last": L - 1}[where], device=DEV)
    c_ref, k_ref = c.clone(), k_pe.clone()
    with ops.use("torch"):
        ops.mla_cache_append(kv, weight, 1e-6, c_ref, k_ref, pos)
    with ops.use("triton"):
        ops.mla_cache_append(kv, weight, 1e-6, c, k_pe, pos)
    others = torch.arange(L, device=DEV) != pos
    assert torch.equal(c[:, others], c_ref[:, others]) and torch.equal(k_pe[:, others], k_ref[:, others])
    assert torch.equal(k_pe[:, pos], k_ref[:, pos])
    # fp32: the same math; bf16: the interpreter truncates where the GPU rounds (one bf16 ulp)
    check(c[:, pos], c_ref[:, pos].double(), 1e-6 if dtype == "fp32" else 1e-2, "c at pos")


def test_absorb_rejects_an_unknown_cfg_key():
    """A sweep's typo is an error, not a silent run of the default tiles."""
    with pytest.raises(ValueError, match="unknown cfg keys"):
        mla_absorb(torch.randn(1, 2, 8, device=DEV), torch.randn(2, 8, 16, device=DEV), dict(BM=16))


def test_cache_append_rejects_shapes_that_do_not_fit():
    kv, weight, c, k_pe = cache_append_inputs(1, 32, 16, 8, torch.float32, 0)
    from model.triton.mla_decode import mla_cache_append
    with pytest.raises(ValueError, match="do not fit"):
        mla_cache_append(kv[:, :40], weight, 1e-6, c, k_pe, torch.tensor(0))
    with pytest.raises(ValueError, match="do not fit"):
        mla_cache_append(kv, weight[:16], 1e-6, c, k_pe, torch.tensor(0))


# ---- real shapes on the GPU ---------------------------------------------------------------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 8])
def test_gpu_cache_append_real_shapes(B):
    """bf16 at the 48B-A3B's R=512, P=64: the same bits as the norm kernel and two index copies, nearly
    everywhere (the norm's fp32 sum may round differently in the last place)."""
    kv, weight, c, k_pe = cache_append_inputs(B, 512, 64, 4096, torch.bfloat16, B, device="cuda")
    pos = torch.tensor(1234, device="cuda")
    c_ref, k_ref = c.clone(), k_pe.clone()
    ops.mla_cache_append(kv, weight, 1e-6, c, k_pe, pos)
    c_ref[:, 1234] = ops.rmsnorm(kv[:, :512], weight, 1e-6)
    k_ref[:, 1234] = kv[:, 512:]
    assert torch.equal(k_pe, k_ref)
    assert (c == c_ref).float().mean() > 0.999 and rel_err(c[:, 1234], c_ref[:, 1234]) < 1e-3

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,rows", [("fp32", "heads"), ("bf16", "heads"), ("bf16", "positions")])
@pytest.mark.parametrize("B,L", [(1, 1056), (1, 4096), (1, 131072), (4, 4096), (8, 32768)])
@pytest.mark.parametrize("where", ["first", "small", "boundary", "last"])
def test_gpu_decode_real_shapes(B, L, where, dtype, rows):
    from model.triton.mla_decode import default_layout
    H, R, P, scale = 32, 512, 64, 192 ** -0.5
    split = default_layout(L, B, H, torch.device("cuda"))[0]
    skip_unless_runs(rows, L, B, H, DTYPES[dtype], "cuda")
    pos = {"first": 0, "small": 37, "boundary": split, "last": L - 1}[where]
    q_lat, q_pe, c, k_pe = decode_inputs(B, H, R, P, L, DTYPES[dtype], L + B, sharp=3.0)
    p = torch.tensor(pos, device="cuda")
    o = mla_decode(q_lat, q_pe, c, k_pe, p, scale, cfg=dict(rows=rows))
    check(o, fp64_reference(q_lat, q_pe, c, k_pe, p, scale), 4e-5, f"B={B} L={L} pos={pos}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("L", [1056, 8192, 65536])  # head groups (SHORT) at the first two, on the H200
@pytest.mark.parametrize("rows", ROWS)
def test_gpu_decode_under_cuda_graph(L, rows):
    """One capture, replayed at several positions (pos updated in place), matches eager calls."""
    H, R, P = 32, 512, 64
    cfg = dict(rows=rows)
    skip_unless_runs(rows, L, 1, H, torch.bfloat16, "cuda")
    q_lat, q_pe, c, k_pe = decode_inputs(1, H, R, P, L, torch.bfloat16, 3, device="cuda")
    pos = torch.tensor(0, device="cuda")
    mla_decode(q_lat, q_pe, c, k_pe, pos, 0.07, cfg=cfg)     # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q_lat, q_pe, c, k_pe, pos, 0.07, cfg=cfg)
    for p in (5, L // 2, L - 1):
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mla_decode(q_lat, q_pe, c, k_pe, pos, 0.07, cfg=cfg)), p


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 8])
def test_gpu_absorb_real_shapes(B):
    g = torch.Generator().manual_seed(B)
    w = torch.randn(32, 256, 512, generator=g).bfloat16().cuda()            # kv_b_proj.weight as [H, dn+dv, R]
    w_uk, w_uv = w[:, :128], w[:, 128:]
    q_nope = torch.randn(B, 32, 128, generator=g).bfloat16().cuda()
    o_lat = torch.randn(B, 32, 512, generator=g).cuda()
    check(mla_absorb(q_nope, w_uk), torch.einsum("bhn,hnr->bhr", q_nope.double(), w_uk.double()), 2e-6, "q_lat")
    check(mla_absorb(o_lat, w_uv.transpose(1, 2)), torch.einsum("bhr,hvr->bhv", o_lat.double(), w_uv.double()),
          2e-5, "o")


def same_bits_either_dtype(B, H, R, P, L, device):
    """A bf16 q_pe (q_nope) takes one product where its fp32 copy takes a head and an all-zero tail (`_dot_f32`):
    the dropped product only added zeros, so each kernel's output must keep its bits."""
    q_lat, q_pe, c, k_pe = decode_inputs(B, H, R, P, L, torch.bfloat16, L, sharp=2.0, device=device)
    pos = torch.tensor(L - 3, device=device)
    for rows in ROWS:
        assert plan(L, B, H, c.dtype, c.device, 2 * _BL, cfg=dict(rows=rows)).rows == rows
        one, two = (mla_decode(q_lat, q, c, k_pe, pos, 0.11, split=2 * _BL, cfg=dict(rows=rows))
                    for q in (q_pe, q_pe.float()))
        assert torch.isfinite(one).all() and torch.equal(one, two), rows
    x = q_pe.repeat(1, 1, 2)                      # [B, H, 2P] bf16, as the model's q_nope
    w = torch.randn(H, 2 * P, R, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    assert torch.equal(mla_absorb(x, w), mla_absorb(x.float(), w))


def test_a_bf16_query_takes_one_product_and_keeps_the_bits():
    same_bits_either_dtype(2, 4, 64, 16, 300, DEV)


@pytest.mark.gpu
@gpu
def test_gpu_a_bf16_query_takes_one_product_and_keeps_the_bits():
    same_bits_either_dtype(1, 32, 512, 64, 8192, "cuda")


def test_decode_refuses_a_split_that_compiles_to_the_spilling_variant():
    from model.triton.mla_decode import MIN_SPLIT
    q_lat, q_pe, c, k_pe = (torch.randn(1, 2, 32), torch.randn(1, 2, 16), torch.randn(1, 4 * _BL, 32),
                            torch.randn(1, 4 * _BL, 16))
    for bad in (_BL, MIN_SPLIT + 1):
        with pytest.raises(ValueError, match="split must be a multiple"):
            mla_decode(q_lat, q_pe, c, k_pe, torch.tensor(3), 0.2, split=bad)
    for bad in (SHORT_BL, 3 * SHORT_BL // 2):   # head groups: at least two of SHORT's steps
        with pytest.raises(ValueError, match="split must be a multiple"):
            mla_decode(q_lat, q_pe, c, k_pe, torch.tensor(3), 0.2, split=bad, heads=1)
    with pytest.raises(ValueError, match="needs its split"):
        mla_decode(q_lat, q_pe, c, k_pe, torch.tensor(3), 0.2, heads=1)


@pytest.mark.parametrize("pos_at", ["middle", "last"])
def test_combine_merges_more_splits_than_one_tile(pos_at):
    """40 splits: the combine merges them in [32, BR] tiles, so the second, partly masked tile must count too."""
    B, H, R, P, split = 1, 2, 32, 16, 2 * _BL
    L = 40 * split
    q_lat, q_pe, c, k_pe = decode_inputs(B, H, R, P, L, torch.float32, 7, sharp=0.5)
    pos = torch.tensor({"middle": 35 * split + 3, "last": L - 1}[pos_at], device=DEV)
    o = mla_decode(q_lat, q_pe, c, k_pe, pos, 0.17, split=split)
    check(o, fp64_reference(q_lat, q_pe, c, k_pe, pos, 0.17), TOL[torch.float32], f"pos={int(pos)}")

"""Triton KDA kernels (model/triton/) against the torch references in model/kda.py, the fp64 naive
recurrence, and HF transformers' RMSNorm modules.

Without CUDA the kernels run on the CPU in Triton's interpreter: TRITON_INTERPRET is read by triton
when the kernel modules are imported, so it is set here before those imports. Interpreter shapes are
small (H <= 2, head dim 16..128, T <= 130). Tests marked `gpu` run the real shapes (32 heads, head
dim 128, T up to 65,536, batch up to 64) and are skipped without CUDA.

Every buffer a kernel writes is allocated NaN-filled (`poisoned_buffers`), and every comparison
fails on a non-finite value, so an element a kernel forgets to write can never pass. The interpreter
never compiles a kernel, so one test (in the slow tier: about 45 s of compiling on an empty Triton cache) also
compiles them all for the H200 (sm_90) with Triton's bundled ptxas, which needs no GPU, and bounds their register
spills.
"""
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # also done by conftest.py; needed before the imports below

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import example, given, settings, strategies as st  # noqa: E402
from transformers.models.kimi_linear.modeling_kimi_linear import (  # noqa: E402
    KimiLinearRMSNorm, KimiLinearRMSNormGated)

import model.triton as mt  # noqa: E402
from model import kda  # noqa: E402
from model.triton.kda_chunk import chunk_kda_fwd  # noqa: E402
from model.triton.kda_decode import GRIDS, _kda_decode_kernel, fused_kda_decode  # noqa: E402
from model.triton.norms import add_rmsnorm, gated_rmsnorm, rmsnorm  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _nan_empty(*shape, dtype, device):
    return torch.empty(*shape, dtype=dtype, device=device).fill_(float("nan"))


@pytest.fixture(autouse=True, scope="module")
def poisoned_buffers():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mt, "empty", _nan_empty)
        yield


def assert_close(x, ref, tol, what):
    assert torch.isfinite(x).all(), f"{what}: non-finite values (a kernel left a poisoned element unwritten?)"
    err = rel_err(x, ref)
    assert err <= tol, f"{what}: relative RMS error {err:.3e} > {tol:.1e}"


def assert_same_state(x, ref, what):
    """Bit for bit under the interpreter. Compiled, two specialisations of the decode kernel (another block of columns,
    the output norm fused or not) may contract a multiply and an add of the state update differently: equal to fp32
    rounding there (the bits differed on the H200, before and after 5cd2081)."""
    if mt.compiled(_kda_decode_kernel):
        assert_close(x, ref, 1e-6, what)
    else:
        assert torch.equal(x, ref), what


# ---- inputs -------------------------------------------------------------------------------------

def gates(regime, shape, gen):
    """Log decays g <= 0 in the regimes KDA kernels get wrong: near 0, -5, -1000, and mixtures."""
    B, T, H, K = shape
    if regime == "model":       # the model's own gate on random activations
        A_log = torch.rand(H, generator=gen) * 3 - 1
        f = torch.randn(B, T, H * K, generator=gen) * 2
        return kda.kda_gate(f, A_log, torch.randn(H * K, generator=gen), K)
    if regime == "near0":
        return -1e-4 * torch.rand(shape, generator=gen)
    if regime == "minus5":
        return -5 + 0.1 * torch.rand(shape, generator=gen)
    if regime == "minus1000":
        return torch.full(shape, -1000.0)
    if regime == "spikes":      # slow decay with a few -1000 tokens: G spans a huge range in one chunk
        g = -0.05 * torch.rand(shape, generator=gen)
        g[:, torch.randint(0, T, (max(1, T // 40),), generator=gen)] = -1000.0
        return g
    if regime == "mixed":       # per token and channel either -1000 or about 0
        slow = -1e-3 * torch.rand(shape, generator=gen)
        return torch.where(torch.rand(shape, generator=gen) < 0.3, -1000.0, slow)
    raise ValueError(regime)


REGIMES = ["model", "near0", "minus5", "minus1000", "spikes", "mixed"]


def kda_inputs(B, T, H, K, V, regime, seed, dtype=torch.float32, with_state=True, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = gates(regime, (B, T, H, K), gen)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) if with_state else None
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out = [x.to(device) for x in (q, k, v, g, beta)]
    return (*out, None if h0 is None else h0.to(device))


def decode_inputs(B, H, d, W, dtype, seed, A_shift=0.0, device=DEV):
    """Raw decode-step inputs as the model holds them: pre-conv projections, taps, gate and beta inputs."""
    gen = torch.Generator().manual_seed(seed)
    C = 3 * H * d
    return dict(
        qkv_raw=torch.randn(B, C, generator=gen).to(dtype).to(device),
        conv_taps=torch.randn(B, W - 1, C, generator=gen).to(dtype).to(device),
        conv_weight=(0.5 * torch.randn(C, W, generator=gen)).to(dtype).to(device),
        f=torch.randn(B, H * d, generator=gen).to(dtype).to(device),
        A_log=(torch.rand(H, generator=gen) * 3 - 1 + A_shift).to(device),
        dt_bias=torch.randn(H * d, generator=gen).to(device),
        b_raw=torch.randn(B, H, generator=gen).to(dtype).to(device),
        state=torch.randn(B, H, d, d, generator=gen).to(device),
    )


def decode_reference(inp, H, d):
    """causal_conv1d + kda_gate + sigmoid + recurrent_kda_step: (o fp32, new state, new taps)."""
    y, taps = kda.causal_conv1d(inp["qkv_raw"][:, None], inp["conv_weight"], inp["conv_taps"])
    q, k, v = (t.unflatten(-1, (H, d)) for t in y[:, 0].chunk(3, dim=-1))
    g = kda.kda_gate(inp["f"], inp["A_log"], inp["dt_bias"], d)
    beta = torch.sigmoid(inp["b_raw"].float())
    state = inp["state"].clone()
    o = kda.recurrent_kda_step(q, k, v, g, beta, state)
    return o, state, taps


def run_decode(inp, **kw):
    state, taps = inp["state"].clone(), inp["conv_taps"].clone()
    o = fused_kda_decode(inp["qkv_raw"], taps, inp["conv_weight"], inp["f"], inp["A_log"], inp["dt_bias"],
                         inp["b_raw"], state, **kw)
    return o, state, taps


# ---- chunked prefill ----------------------------------------------------------------------------

def chunk_example(dots="bf16", **kw):
    """An explicit case of test_chunk_matches_torch_and_fp64, both kernels' dot operands set to `dots`."""
    return example(**kw, prep_dots=dots, scan_dots=dots)


@chunk_example(T=1, B=1, K=16, V=16, regime="minus1000", with_state=True, dtype="fp32", seed=0)
@chunk_example(T=63, B=2, K=32, V=16, regime="minus5", with_state=True, dtype="fp32", seed=1)
@chunk_example(T=65, B=1, K=16, V=32, regime="near0", with_state=True, dtype="bf16", seed=2)
@chunk_example(T=65, B=1, K=16, V=32, regime="near0", with_state=True, dtype="bf16", seed=2, dots="tf32")
@chunk_example(T=33, B=1, K=32, V=16, regime="spikes", with_state=True, dtype="fp32", seed=5)
@chunk_example(T=130, B=1, K=32, V=32, regime="mixed", with_state=True, dtype="fp32", seed=3)
@chunk_example(T=130, B=2, K=32, V=32, regime="spikes", with_state=False, dtype="fp32", seed=4)
@given(T=st.sampled_from([1, 2, 17, 31, 32, 33, 63, 64, 65, 100, 128, 130]), B=st.integers(1, 2),
       K=st.sampled_from([16, 32]), V=st.sampled_from([16, 32]), regime=st.sampled_from(REGIMES),
       with_state=st.booleans(), dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**16),
       prep_dots=st.sampled_from(["tf32", "bf16"]), scan_dots=st.sampled_from(["tf32", "bf16"]))
def test_chunk_matches_torch_and_fp64(T, B, K, V, regime, with_state, dtype, seed, prep_dots, scan_dots):
    """prep_dots and scan_dots (CONFIG) choose the dot operands for bf16 inputs; fp32 inputs ignore them (tf32x3)."""
    q, k, v, g, beta, h0 = kda_inputs(B, T, 2, K, V, regime, seed, DTYPES[dtype], with_state)
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, cfg=dict(prep_dots=prep_dots, scan_dots=scan_dots))
    assert o.dtype == v.dtype and o.shape == v.shape and ht.dtype == torch.float32
    ro, rh = kda.chunk_kda(q, k, v, g, beta, initial_state=h0)
    no, nh = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    if dtype == "bf16":
        assert_close(o, no, 1e-2, "o vs fp64")
        assert_close(ht, nh, 1e-2, "state vs fp64")
        assert_close(o, ro, 1e-2, "o vs torch chunk")
        return
    assert_close(o, no, 1e-5, "o vs fp64")
    assert_close(ht, nh, 1e-5, "state vs fp64")
    # The torch chunked form takes exp(G_t - G_s) from differences of the chunk-long prefix sum, which
    # loses digits after a -1000 gate (about 3e-4 off fp64 for "mixed"); ours sums the spanned gates.
    assert_close(o, ro, 1e-5 + 2 * rel_err(ro, no), "o vs torch chunk")
    assert_close(ht, rh, 1e-5 + 2 * rel_err(rh, nh), "state vs torch chunk")


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("regime", ["model", "mixed"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chunk_lengths_of_the_config_agree_with_fp64(chunk, regime, dtype):
    """The chunk length is a launch choice (CONFIG, swept by the benchmark): each is as exact as the default, in
    fp32 and with bf16 inputs (the bf16 dot operands of the default CONFIG)."""
    q, k, v, g, beta, h0 = kda_inputs(1, 70, 2, 32, 32, regime, chunk, DTYPES[dtype], True)
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, cfg=dict(chunk=chunk, slice=16))
    no, nh = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    tol = 1e-5 if dtype == "fp32" else 1e-2
    assert_close(o, no, tol, "o vs fp64")
    assert_close(ht, nh, tol, "state vs fp64")


def test_chunk_rejects_a_bad_config():
    q, k, v, g, beta, h0 = kda_inputs(1, 5, 1, 16, 16, "model", 0)
    with pytest.raises(ValueError, match="chunk must be"):
        chunk_kda_fwd(q, k, v, g, beta, cfg=dict(chunk=48))
    with pytest.raises(ValueError, match="unknown cfg keys"):
        chunk_kda_fwd(q, k, v, g, beta, cfg=dict(warps=4))
    with pytest.raises(ValueError, match="scan_dots must be"):
        chunk_kda_fwd(q, k, v, g, beta, cfg=dict(scan_dots="fp16"))


def test_chunk_fp32_inputs_take_the_exact_config_unless_cfg_names_a_key():
    """CONFIG["exact"] (the compiler fault at chunks of 16 in fp32): fp32 inputs run the exact keys, bf16 inputs the
    defaults, and a key that cfg names wins over both. Seen through the bits: each chunk length sums in its own
    order, so the runs that must differ do (the check can fail)."""
    from model.triton.kda_chunk import CONFIG
    exact = CONFIG["exact"]
    assert exact["chunk"] != CONFIG["chunk"]
    for dtype, cfg in ((torch.float32, exact), (torch.bfloat16, {k: CONFIG[k] for k in exact})):
        q, k, v, g, beta, h0 = kda_inputs(1, 70, 2, 32, 32, "model", 3, dtype)
        o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
        o_c, ht_c = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, cfg=cfg)
        assert torch.equal(o, o_c) and torch.equal(ht, ht_c), f"{dtype}: the default is not {cfg}"
        other = exact["chunk"] if dtype == torch.bfloat16 else CONFIG["chunk"]
        o_n, _ = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, cfg=dict(chunk=other))
        assert not torch.equal(o_n, o), f"{dtype}: cfg chunk={other} did not reach the kernel"


def test_chunk_empty_sequence_returns_the_initial_state():
    q, k, v, g, beta, h0 = kda_inputs(2, 0, 2, 16, 16, "model", 0)
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    assert o.shape == (2, 0, 2, 16) and torch.equal(ht, h0)
    _, ht = chunk_kda_fwd(q, k, v, g, beta)
    assert torch.equal(ht, torch.zeros_like(h0))


def test_chunk_without_l2norm_and_explicit_scale():
    q, k, v, g, beta, h0 = kda_inputs(1, 70, 2, 32, 16, "model", 1)
    q, k = kda.l2norm(q), kda.l2norm(k)
    o, ht = chunk_kda_fwd(q, k, v, g, beta, scale=0.3, initial_state=h0, l2norm_qk=False)
    no, nh = kda.naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, l2norm_qk=False)
    assert_close(o, no, 1e-5, "o")
    assert_close(ht, nh, 1e-5, "state")
    o2, none = chunk_kda_fwd(q, k, v, g, beta, scale=0.3, initial_state=h0, l2norm_qk=False,
                             output_final_state=False)
    assert none is None and torch.equal(o2, o)


@pytest.mark.parametrize("t0", [1, 5, 64, 70, 129])
def test_chunk_prefix_is_bitwise_blind_to_the_future(t0):
    """Changing tokens t >= t0 must not change one bit of the outputs before t0 (chunk-internal leaks)."""
    q, k, v, g, beta, h0 = kda_inputs(1, 130, 2, 32, 32, "model", 7)
    o, _ = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    q2, k2, v2, g2, beta2, _ = kda_inputs(1, 130, 2, 32, 32, "spikes", 8)
    fut = slice(t0, None)
    for x, y in ((q, q2), (k, k2), (v, v2), (g, g2), (beta, beta2)):
        x[:, fut] = 3 * y[:, fut]
    o_changed, _ = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    assert torch.equal(o_changed[:, :t0], o[:, :t0])
    assert not torch.equal(o_changed[:, t0:], o[:, t0:])


def test_chunk_output_does_not_depend_on_batch_size():
    q, k, v, g, beta, h0 = kda_inputs(3, 70, 2, 16, 16, "model", 3)
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    one = slice(1, 2)
    o1, ht1 = chunk_kda_fwd(q[one], k[one], v[one], g[one], beta[one], initial_state=h0[one])
    assert torch.equal(o1, o[one]) and torch.equal(ht1, ht[one])


@pytest.mark.parametrize("B,T,H,K,dtype", [(1, 70, 2, 32, "fp32"), (2, 65, 2, 32, "bf16"), (2, 1, 1, 32, "fp32"),
                                           (2, 3, 2, 32, "fp32"),
                                           pytest.param(1, 8192, 32, 128, "bf16", marks=[pytest.mark.gpu, gpu])])
def test_chunk_reads_column_slices_in_place(B, T, H, K, dtype):
    """q, k, v as the column slices of one packed [B, T, 3*H*K + pad] tensor (as the conv output gives them)
    and g as a slice of a wider one are read through their row stride, not copied: the same bits as from
    contiguous copies, and the NaN padding beside them is never read. A slice along T of a batch is not
    evenly spaced by rows and is copied."""
    from model.triton.kda_chunk import _token_rows
    q, k, v, g, beta, h0 = kda_inputs(B, T, H, K, K, "model", 9, DTYPES[dtype])
    pad = torch.full((B, T, 8), float("nan"), device=DEV)
    packed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2), pad.to(q.dtype)], -1)
    qs, ks, vs = (packed[..., i * H * K:(i + 1) * H * K].unflatten(-1, (H, K)) for i in range(3))
    gs = torch.cat([g.flatten(-2), pad], -1)[..., :H * K].unflatten(-1, (H, K))
    assert all(_token_rows(x)[0] is x for x in (qs, ks, vs, gs)) and not qs.is_contiguous()
    o, ht = chunk_kda_fwd(qs, ks, vs, gs, beta, initial_state=h0)
    ro, rh = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    assert torch.isfinite(o).all() and torch.equal(o, ro) and torch.equal(ht, rh)
    if B > 1 and T > 1:
        assert _token_rows(q[:, 1:])[0].is_contiguous()


@pytest.mark.parametrize("split", [1, 64, 70])
def test_chunk_prefill_in_two_spans_equals_one(split):
    q, k, v, g, beta, h0 = kda_inputs(2, 130, 2, 32, 16, "model", 4)
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    a, b = slice(None, split), slice(split, None)
    oa, sa = chunk_kda_fwd(q[:, a], k[:, a], v[:, a], g[:, a], beta[:, a], initial_state=h0)
    ob, sb = chunk_kda_fwd(q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], initial_state=sa)
    assert_close(torch.cat([oa, ob], 1), o, 1e-5, "o")
    assert_close(sb, ht, 1e-5, "state")


def test_prefill_then_decode_equals_one_recurrence():
    """Prefill with the chunk kernel, carry state and conv taps, decode with the fused step: the outputs
    must be those of one fp64 recurrence over the whole sequence (state layout, taps, gates all agree).
    d=64 gives two state blocks per head, so the per-head finishing (taps shift, counter reset) is used."""
    B, H, d, W, T, steps = 2, 2, 64, 4, 66, 3
    gen = torch.Generator().manual_seed(5)
    inp = decode_inputs(B, H, d, W, torch.float32, 5)
    x = torch.randn(B, T + steps, 3 * H * d, generator=gen).to(DEV)
    f = torch.randn(B, T + steps, H * d, generator=gen).to(DEV)
    b_raw = torch.randn(B, T + steps, H, generator=gen).to(DEV)
    cw, A_log, dt_bias = inp["conv_weight"], inp["A_log"], inp["dt_bias"]

    def qkv(y):
        return (t.unflatten(-1, (H, d)) for t in y.chunk(3, dim=-1))

    y, _ = kda.causal_conv1d(x, cw)
    no, _ = kda.naive_recurrent_kda(*qkv(y), kda.kda_gate(f, A_log, dt_bias, d), torch.sigmoid(b_raw))

    y, taps = kda.causal_conv1d(x[:, :T], cw)
    o, state = chunk_kda_fwd(*qkv(y), kda.kda_gate(f[:, :T], A_log, dt_bias, d), torch.sigmoid(b_raw[:, :T]))
    outs = [o]
    for i in range(T, T + steps):
        outs.append(fused_kda_decode(x[:, i], taps, cw, f[:, i], A_log, dt_bias, b_raw[:, i], state)[:, None])
    assert_close(torch.cat(outs, 1), no, 1e-5, "prefill + decode vs one recurrence")
    assert_close(outs[-1][:, 0], no[:, -1], 1e-5, "last decoded token")


# ---- decode step --------------------------------------------------------------------------------

@given(B=st.sampled_from([1, 2, 5]), H=st.integers(1, 2), d=st.sampled_from([16, 32, 64]), W=st.integers(2, 4),
       dtype=st.sampled_from(sorted(DTYPES)), A_shift=st.sampled_from([-6.0, 0.0, 7.0]),
       seed=st.integers(0, 2**16))
def test_decode_matches_reference_composition(B, H, d, W, dtype, A_shift, seed):
    """A_shift 7 puts g near -1000 for most channels, -6 near 0."""
    inp = decode_inputs(B, H, d, W, DTYPES[dtype], seed, A_shift)
    ro, rstate, rtaps = decode_reference(inp, H, d)
    o, state, taps = run_decode(inp)
    assert o.dtype == inp["qkv_raw"].dtype and o.shape == (B, H, d)
    assert torch.equal(taps, rtaps)
    tol = 1e-5 if dtype == "fp32" else 1e-2
    assert_close(o, ro, tol, "o")
    assert_close(state, rstate, tol, "state")


@given(B=st.sampled_from([1, 2, 5]), H=st.integers(1, 2), d=st.sampled_from([16, 32, 64]), W=st.integers(2, 4),
       dtype=st.sampled_from(sorted(DTYPES)), A_shift=st.sampled_from([-6.0, 0.0, 7.0]),
       grid=st.sampled_from(GRIDS), BV=st.sampled_from([8, 16, 32]), early_o=st.booleans(),
       seed=st.integers(0, 2**16))
def test_decode_grids_match_the_default(B, H, d, W, dtype, A_shift, grid, BV, early_o, seed):
    """Every grid, with one to eight column blocks per head, and o from the state before or after the update, is
    the default's step: the same taps, o and state, and at fp32 the reference composition's.
    (At bf16 the interpreter truncates where torch rounds, which the reference test's draws stay clear of.)"""
    inp = decode_inputs(B, H, d, W, DTYPES[dtype], seed, A_shift)
    o0, state0, taps0 = run_decode(inp)
    o, state, taps = run_decode(inp, cfg=dict(grid=grid, BV=BV, early_o=early_o))
    assert o.dtype == inp["qkv_raw"].dtype and o.shape == (B, H, d)
    assert torch.equal(taps, taps0)
    tol = 1e-6 if dtype == "fp32" else 1e-2
    assert_close(o, o0, tol, "o vs default")
    assert_close(state, state0, 1e-6, "state vs default")
    if dtype == "fp32":
        ro, rstate, rtaps = decode_reference(inp, H, d)
        assert torch.equal(taps, rtaps)
        assert_close(o, ro, 1e-5, "o")
        assert_close(state, rstate, 1e-5, "state")


@given(B=st.sampled_from([1, 3]), d=st.sampled_from([16, 32, 128]), dtype=st.sampled_from(sorted(DTYPES)),
       grid=st.sampled_from(GRIDS), BV=st.sampled_from([16, 128]), seed=st.integers(0, 2**16))
def test_decode_fused_output_norm(B, d, dtype, grid, BV, seed):
    """The norm finished by the head's last block (BV < d), or in registers by the head's one block (BV >= d)."""
    H = 2
    inp = decode_inputs(B, H, d, 4, DTYPES[dtype], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    gate = torch.randn(B, H * d, generator=gen).to(DTYPES[dtype]).to(DEV)
    weight = torch.randn(d, generator=gen).to(DEV)
    cfg = dict(grid=grid, BV=BV)
    normed, state, _ = run_decode(inp, out_gate=gate, norm_weight=weight, norm_eps=1e-5, cfg=cfg)
    o, state_unfused, _ = run_decode(inp, cfg=cfg)
    assert_same_state(state, state_unfused, "state with and without the fused norm")
    unfused = gated_rmsnorm(o, gate.view(B, H, d), weight, 1e-5)
    assert_close(normed, unfused, 1e-6 if dtype == "fp32" else 1e-2, "fused vs unfused norm")
    ro, _, _ = decode_reference(inp, H, d)
    ref = hf_norm(KimiLinearRMSNormGated, d, weight)(ro.to(o.dtype), gate.view(B, H, d))
    assert_close(normed, ref, 1e-5 if dtype == "fp32" else 2e-2, "vs HF")


# The interpreter runs a launch's programs one after another: batch 64 (the largest batch the decode config was
# measured at; slow tier) takes the paths batch 5 takes, with 13 times the programs.
@pytest.mark.parametrize("B", [5, pytest.param(64, marks=pytest.mark.slow)])
def test_decode_batch(B):
    """At batch B: blocks of 16 columns (two per head here), the fused norm finished by the head's last block,
    give the result of one 32-column block and of the default config; and so do four 8-column blocks in each
    grid."""
    inp = decode_inputs(B, 1, 32, 4, torch.float32, 9)
    ro, rstate, rtaps = decode_reference(inp, 1, 32)
    o, state, taps = run_decode(inp)
    assert torch.equal(taps, rtaps)
    assert_close(o, ro, 1e-5, "o")
    assert_close(state, rstate, 1e-5, "state")
    gen = torch.Generator().manual_seed(10)
    norm = dict(out_gate=torch.randn(B, 32, generator=gen).to(DEV), norm_weight=torch.randn(32, generator=gen).to(DEV))
    blocks, state16, taps16 = run_decode(inp, **norm, cfg=dict(BV=16, grid="strided"))
    whole, state32, _ = run_decode(inp, **norm, cfg=dict(BV=32))
    assert_same_state(state16, state32, "16- vs 32-column blocks: state")
    assert_close(blocks, whole, 1e-6, "16- vs 32-column blocks")
    default, state_d, taps_d = run_decode(inp, **norm)
    assert_same_state(state_d, state16, "default config vs 16-column blocks: state")
    assert torch.equal(taps_d, taps16)
    assert_close(default, blocks, 1e-6, "default config vs 16-column blocks")
    for grid in GRIDS:  # the blocks of a head far apart or adjacent: the same step
        o_grid, state_grid, taps_grid = run_decode(inp, **norm, cfg=dict(grid=grid, BV=8))
        assert torch.equal(taps_grid, taps16), grid
        assert_close(state_grid, state16, 1e-6, f"{grid} grid: state")
        assert_close(o_grid, blocks, 1e-6, f"{grid} grid: o")


def test_decode_reads_column_slices_in_place(monkeypatch):
    """At batch > 1 the model hands the step column slices of wider tensors (q|k|v and b_raw of its packed
    projection): read through their row strides, not copied first, with the bits of contiguous inputs. A tensor
    whose own row is strided is copied (the control: the spy sees copies when there are some). The NaN padding
    around the slices is never read (a read of it would reach the outputs)."""
    B, H, d = 3, 2, 16
    inp = decode_inputs(B, H, d, 4, torch.float32, 7)
    gen = torch.Generator().manual_seed(8)
    norm = dict(out_gate=torch.randn(B, H * d, generator=gen).to(DEV),
                norm_weight=torch.randn(d, generator=gen).to(DEV))
    want = run_decode(inp, **norm)

    def in_wider(x, every=1):  # x's values as a column slice of a NaN-padded wider tensor, `every` apart in it
        wide = torch.full((x.shape[0], 5 + every * x.shape[1]), float("nan"), dtype=x.dtype, device=DEV)
        wide[:, 5::every] = x
        return wide[:, 5::every]

    copies = []
    real = torch.Tensor.contiguous

    def spy(self, *a, **kw):
        if not self.is_contiguous():
            copies.append(tuple(self.shape))
        return real(self, *a, **kw)

    for every in (1, 2):
        sliced = {k: in_wider(inp[k], every) for k in ("qkv_raw", "f", "b_raw")}
        gate = in_wider(norm["out_gate"], every)
        assert not any(t.is_contiguous() for t in [gate, *sliced.values()])
        del copies[:]
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "contiguous", spy)
            got = run_decode({**inp, **sliced}, out_gate=gate, norm_weight=norm["norm_weight"])
        assert all(torch.equal(a, b) for a, b in zip(got, want)), every
        assert len(copies) == (0 if every == 1 else 4), (every, copies)


def test_decode_rejects_an_unknown_grid_or_cfg_key():
    inp = decode_inputs(1, 1, 16, 4, torch.float32, 0)
    for grid in ("diagonal", "head"):   # "head" was measured slower and removed
        with pytest.raises(ValueError, match="grid must be one of"):
            run_decode(inp, cfg=dict(grid=grid))
    with pytest.raises(ValueError, match="unknown cfg keys"):   # a sweep's typo is an error, not the default
        run_decode(inp, cfg=dict(warps=4))


# ---- norms --------------------------------------------------------------------------------------

def assert_within_ulps(y, ref):
    """Equal to within two units in the last place of ref on the GPU. rmsnorm rounds twice: h =
    bf16(x * rsqrt(var)), then bf16(weight * h). Our fp32 variance is summed in another order than
    torch's, so when x * rsqrt(var) lies within an fp32 ulp of a bf16 rounding midpoint, h lands one
    bf16 unit away, and weight * h (|weight| up to ~1.3 here) moves up to two units of the result (seen on
    the H200: 1 element in 9.4M). The interpreter truncates fp32 -> bf16 where CUDA rounds to nearest, so
    there up to four units. The callers also bound how many elements may differ at all."""
    ulps = 2 if torch.cuda.is_available() else 4
    assert y.dtype == ref.dtype and torch.isfinite(y).all()
    eps = torch.finfo(ref.dtype).eps
    y, ref = y.double(), ref.double()
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30)))) * eps
    assert ((y - ref).abs() <= ulps * ulp).all()


def hf_norm(cls, D, weight):
    m = cls(D, eps=1e-5).to(DEV).requires_grad_(False)
    m.weight.data = weight
    return m


@settings(max_examples=10)
@given(N=st.integers(1, 40), D=st.sampled_from([16, 100, 128, 2304]), dtype=st.sampled_from(sorted(DTYPES)),
       seed=st.integers(0, 2**16))
def test_norms_match_hf(N, D, dtype, seed):
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    x, gate, res = (torch.randn(N, D, generator=gen).to(dt).to(DEV) for _ in range(3))
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEV)

    ref = hf_norm(KimiLinearRMSNormGated, D, w)(x, gate)
    y = gated_rmsnorm(x, gate, w, 1e-5)
    ref_plain = hf_norm(KimiLinearRMSNorm, D, w.to(dt))(x)
    y_plain = rmsnorm(x, w.to(dt), 1e-5)
    y_add, new_res = add_rmsnorm(x, res, w.to(dt), 1e-5)
    if dtype == "fp32":
        assert_close(y, ref, 1e-6, "gated")
        assert_close(y_plain, ref_plain, 1e-6, "plain")
        assert torch.equal(new_res, x + res)
        assert_close(y_add, hf_norm(KimiLinearRMSNorm, D, w)(x + res), 1e-6, "add")
    else:
        assert_within_ulps(y, ref)
        assert_within_ulps(y_plain, ref_plain)
        assert_within_ulps(new_res, x + res)
        assert_close(y_add, hf_norm(KimiLinearRMSNorm, D, w.to(dt))(new_res), 1e-2, "add")


@pytest.mark.parametrize("lead,D", [((1, 9), 48), ((2, 5), 48), ((1, 1), 48),
                                    pytest.param((1, 8192), 512, marks=[pytest.mark.gpu, gpu])])
def test_norms_read_column_slices_in_place(lead, D):
    """x as the first D columns of a wider tensor (MLA's latent c beside k_pe): the same bits as from a
    contiguous copy, the NaN columns beside it never read; a transposed x, whose rows are not evenly
    spaced, is copied first and still right."""
    wide = torch.cat([torch.randn(*lead, D), torch.full((*lead, 8), float("nan"))], -1).to(DEV)
    x, w, res = wide[..., :D], (1 + 0.1 * torch.randn(D)).to(DEV), torch.randn(*lead, D, device=DEV)
    assert not x.is_contiguous() or lead == (1, 1)
    assert torch.equal(rmsnorm(x, w, 1e-5), rmsnorm(x.contiguous(), w, 1e-5))
    assert torch.equal(gated_rmsnorm(x, res, w, 1e-5), gated_rmsnorm(x.contiguous(), res, w, 1e-5))
    y, new_res = add_rmsnorm(x, res, w, 1e-5)
    y_ref, new_res_ref = add_rmsnorm(x.contiguous(), res, w, 1e-5)
    assert torch.isfinite(y).all() and torch.equal(y, y_ref) and torch.equal(new_res, new_res_ref)
    xt = torch.randn(D, 7, device=DEV).t()
    assert torch.equal(rmsnorm(xt, w, 1e-5), rmsnorm(xt.contiguous(), w, 1e-5))


def test_rmsnorm_output_dtype_follows_torch_promotion():
    x = torch.randn(3, 16, dtype=torch.bfloat16, device=DEV)
    assert rmsnorm(x, torch.ones(16, device=DEV), 1e-5).dtype == torch.float32   # fp32 weight * bf16
    assert rmsnorm(x, torch.ones(16, dtype=torch.bfloat16, device=DEV), 1e-5).dtype == torch.bfloat16
    assert gated_rmsnorm(x, x, torch.ones(16, device=DEV), 1e-5).dtype == torch.bfloat16


# ---- bad input ----------------------------------------------------------------------------------

def test_bad_inputs_get_clear_errors():
    q, k, v, g, beta, h0 = kda_inputs(1, 8, 2, 16, 16, "model", 0)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_kda_fwd(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda_fwd(q[..., :12], k[..., :12], v, g[..., :12], beta)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_kda_fwd(q, k, v, g, beta, initial_state=h0.transpose(0, 1))
    with pytest.raises(TypeError, match="float"):
        chunk_kda_fwd(q, k, v.long(), g, beta)
    inp = decode_inputs(2, 2, 16, 4, torch.float32, 0)
    with pytest.raises(TypeError, match="fp32"):
        run_decode({**inp, "state": inp["state"].bfloat16()})
    with pytest.raises(ValueError, match="contiguous"):
        run_decode({**inp, "state": inp["state"].transpose(-1, -2)})
    with pytest.raises(ValueError, match="conv_taps must be"):
        run_decode({**inp, "conv_taps": inp["conv_taps"][:, :2]})
    with pytest.raises(ValueError, match="conv_weight must be"):
        run_decode({**inp, "conv_weight": inp["conv_weight"][:, None]})
    with pytest.raises(ValueError, match="together"):
        run_decode(inp, norm_weight=torch.ones(16, device=DEV))
    with pytest.raises(ValueError, match="weight must be"):
        rmsnorm(q, torch.ones(3, device=DEV), 1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-tensor error only exists without CUDA")
def test_compiled_kernels_refuse_cpu_tensors():
    class Compiled:  # what a kernel is when TRITON_INTERPRET was unset at import
        pass
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        mt.require_runnable(Compiled(), torch.device("cpu"))


# ---- negative controls: the checks above can fail -----------------------------------------------

def test_control_unwritten_buffers_and_wrong_values_fail_the_check():
    ref = torch.randn(4, 8)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(mt.empty(4, 8, dtype=torch.float32, device="cpu"), ref, 1.0, "unwritten")
    with pytest.raises(AssertionError, match="relative RMS"):
        assert_close(ref * 1.001, ref, 1e-5, "scaled")


def test_control_dropped_initial_state_is_caught():
    q, k, v, g, beta, h0 = kda_inputs(1, 65, 2, 16, 16, "model", 2)
    no, _ = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    o, _ = chunk_kda_fwd(q, k, v, g, beta)
    assert rel_err(o, no) > 1e-2


def test_control_transposed_decode_state_is_caught():
    inp = decode_inputs(2, 2, 16, 4, torch.float32, 3)
    ro, _, _ = decode_reference(inp, 2, 16)
    o, _, _ = run_decode({**inp, "state": inp["state"].transpose(-1, -2).contiguous()})
    assert rel_err(o, ro) > 1e-2


def test_control_future_leak_check_sees_a_leak():
    """The bitwise prefix test compares exact bits: one ulp moved in the prefix fails it."""
    o = torch.randn(1, 10, 2, 16)
    leaked = o.clone()
    leaked[0, 3, 0, 0] = torch.nextafter(leaked[0, 3, 0, 0], torch.tensor(float("inf")))
    assert not torch.equal(leaked[:, :5], o[:, :5])


# ---- compiled for the H200, on any machine -------------------------------------------------------
# The interpreter runs the kernels' math but never compiles them, so a kernel that cannot be compiled
# would pass every CPU test above. Triton's bundled ptxas compiles for sm_90 without a GPU.

def _segment_sums_kernel(broken: bool):
    """Row sums of arange(BT) viewed as [BT // half, half] for half = 1, 2. `broken` binds half to a
    name, which turns the constexpr into a tensor that cannot be a shape (a real past mistake)."""
    if broken:
        @triton.jit
        def segment_sums(x, BT: tl.constexpr):
            for lvl in tl.static_range(2):
                half = 1 << lvl
                tl.store(x + tl.arange(0, BT // half), tl.sum(tl.reshape(tl.arange(0, BT), (BT // half, half)), 1))
    else:
        @triton.jit
        def segment_sums(x, BT: tl.constexpr):
            for lvl in tl.static_range(2):
                tl.store(x + tl.arange(0, BT // (1 << lvl)),
                         tl.sum(tl.reshape(tl.arange(0, BT), (BT // (1 << lvl), 1 << lvl)), 1))
    return segment_sums


def launched(fn, sig: dict, consts: dict, values: dict) -> tuple[dict, dict, dict]:
    """(signature, constants, attributes) of the build Triton's launcher makes for a call of fn whose int arguments
    have `values`, by the launcher's own rule (`native_specialize_impl`): an int equal to 1 becomes a constant, an
    int that is a multiple of 16 is compiled as one (tt.divisibility), and its type is i32 or i64 by its size.
    Pointers are taken 16-byte aligned, as torch's allocations and the model's column slices are. Every int
    argument needs a value: without the multiples of 16, a build keeps the address arithmetic of unknown strides,
    so its loads are narrower and Triton's pipeliner leaves them synchronous (seen: the MLA split kernel, whose
    cache loads the H200 runs as multi-buffered async copies, built without them), and its registers and
    spills are not those of the kernel that runs."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    ints = {name for name, t in sig.items() if t in ("i32", "i64")}
    if set(values) != ints:
        raise ValueError(f"{fn.__name__}: values needed for the int arguments {sorted(ints)}, got {sorted(values)}")
    sig, consts = dict(sig), dict(consts)
    multiple_of_16 = set()
    for name, v in values.items():
        kind, spec = native_specialize_impl(BaseBackend, v, False, True, True)
        if kind == "constexpr":
            consts[name] = v
        else:
            sig[name] = kind
            if spec == "D":
                multiple_of_16.add(name)
    sig = {**sig, **{name: "constexpr" for name in consts}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, t in sig.items() if t[0] == "*" or name in multiple_of_16}
    return sig, consts, attrs


KDA_ROWS = 3 * 32 * 128 + 2 * 128 + 32      # the KDA layer's packed q|k|v|f_a|g_a|b projection output
# the decode kernel's arguments in the bf16 model, and the values of its int ones (the packed projection's row strides)
DECODE_SIG = {**dict.fromkeys(["qkv", "taps", "conv_w", "f"], "*bf16"), "A_log": "*fp32", "dt_bias": "*fp32",
              "b_raw": "*bf16", "state": "*fp32", "o": "*bf16", "out_gate": "*bf16", "norm_w": "*bf16",
              **dict.fromkeys(["S_X", "S_F", "S_B", "S_G"], "i32"), "arrivals": "*i32", "scale": "fp32", "eps": "fp32"}
DECODE_INTS = dict(S_X=KDA_ROWS, S_F=32 * 128, S_B=KDA_ROWS, S_G=32 * 128)


def sm90_spills() -> dict:
    """Compile each kernel at the model's shapes (32 heads of 128, bf16) for sm_90: bytes of stack
    (register spills) per thread, by kernel; `broken` is None when the deliberately broken twin of
    `control` fails to compile, as it must."""
    import subprocess, tempfile  # noqa: E401
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from model.triton import kda_chunk as kc, kda_decode as kd, norms as nm

    def build(fn, sig, consts, ints, **opts):
        """fn's sm_90 build for a launch whose int arguments have the values `ints` (`launched`)."""
        s, c, attrs = launched(fn, sig, consts, ints)
        return triton.compile(ASTSource(fn, s, c, attrs), target=GPUTarget("cuda", 90, 32), options=opts)

    def stack_bytes(fn, sig, consts, ints=None, **opts):
        """The most stack (spilled registers) a thread uses in fn's sm_90 builds, one build per launch in `ints`: the
        values of fn's int arguments at a launch the model makes (a dict, or a list of them where the model's
        launches specialise differently), each build specialised as Triton's launcher specialises that launch."""
        worst = 0
        for values in [ints or {}] if not isinstance(ints, list) else ints:
            k = build(fn, sig, consts, values, **opts)
            # an H200 refuses a launch past 227 KB of shared memory per block (seen: the fp32 MLA tile at BL=64)
            assert k.metadata.shared <= 232448, f"{fn.__name__}: {k.metadata.shared} B of shared memory"
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
                usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
            worst = max(worst, int(usage.split("STACK:")[1].split()[0]))
        return worst

    def async_copies(fn, sig, consts, ints, **opts):
        """Whether fn's sm_90 build for a launch with these ints loads through async copies (Triton's pipeliner)."""
        return "ttg.async_copy_global_to_local" in build(fn, sig, consts, ints, **opts).asm["ttgir"]

    bf, f32 = "*bf16", "*fp32"
    c = kc.CONFIG
    # The int arguments of the model's launches at its shapes (hidden 2304, 32 heads, bf16). Lengths that vary
    # (tokens T of a prefill, rows N) at a multiple of 16 and at one that is not, as the launcher builds one
    # kernel for each; rows also at 1 (decode), which it builds as a constant.
    Ts = (8192, 1000)
    mla_rows = 32 * 192 + 512 + 64             # the MLA layer's packed q|kv_a output
    L = 2048                                   # an MLA cache buffer's positions (strides L*512, L*64)
    mla_ints = dict(s_qpe_b=mla_rows, s_qpe_h=192, s_c_b=L * 512, s_c_l=512, s_kpe_b=L * 64, s_kpe_l=64)

    def chunk_prep(io, prec, bf16_dots):
        """The chunk prep kernel at the default tiles, q/k/v and its outputs of pointer type io (g fp32 or io)."""
        return stack_bytes(kc._kda_chunk_prep_kernel,
                           {**dict.fromkeys("qkv", io), "g": f32, "beta": io,
                            **dict.fromkeys(["w", "qw", "kd", "u", "ou"], io), "eglast": f32,
                            "T": "i32", "NT": "i32", "scale": "fp32"},
                           dict(H=32, K=128, V=128, BT=c["chunk"], BK=c["slice"], LOG2_BT=c["chunk"].bit_length() - 1,
                                L2NORM=True, PREC=prec, S_Q=3 * 32 * 128, S_K=3 * 32 * 128, S_V=3 * 32 * 128,
                                S_G=32 * 128, BF16_DOTS=bf16_dots, COMPILED=True),
                           [dict(T=T, NT=triton.cdiv(T, c["chunk"])) for T in Ts], num_warps=c["prep_warps"],
                           num_stages=c["prep_stages"])

    def chunk_scan(io, prec, bf16_dots):
        return stack_bytes(kc._kda_chunk_scan_kernel,
                           {**dict.fromkeys(["w", "qw", "kd", "u", "ou", "o"], io),
                            **dict.fromkeys(["eglast", "h0", "ht"], f32), "T": "i32", "NT": "i32"},
                           dict(H=32, K=128, V=128, BT=c["chunk"], BV=c["scan_bv"], HAS_H0=True, STORE_HT=True,
                                PREC=prec, BF16_DOTS=bf16_dots, COMPILED=True, STAGES=c["scan_stages"]),
                           [dict(T=T, NT=triton.cdiv(T, c["chunk"])) for T in Ts], num_warps=c["scan_warps"])

    out = {
        "prep": chunk_prep(bf, "tf32", kc.CONFIG["prep_dots"] == "bf16"),
        "scan": chunk_scan(bf, "tf32", kc.CONFIG["scan_dots"] == "bf16"),
        "decode": stack_bytes(kd._kda_decode_kernel, DECODE_SIG,
                              dict(H=32, D=128, W=4, WP=4, BV=kd.DECODE["BV"], HAS_NORM=True, ADJACENT=False,
                                   EARLY_O=kd.DECODE["early_o"]), DECODE_INTS, num_warps=kd.DECODE["num_warps"]),
        "norm": stack_bytes(nm._rmsnorm_kernel, {**dict.fromkeys(["x", "res", "gate", "weight", "y", "res_out"], bf),
                                                 "N": "i32", "stride_x": "i32",
                                                 "eps": "fp32"},
                            dict(D=2304, BD=4096, ROWS=1, ADD_RES=True, GATED=False, SIGNAL=True),
                            [dict(N=n, stride_x=2304) for n in (1,) + Ts], num_warps=8),
    }
    # the norm's other launches: the KDA output norm of a prefill (gated; rows of 128, T*32 of them) and MLA's kv_a
    # norm (rows of 512, a column slice of the packed projection's 6720, or of kv_a's own 576 with last_only)
    norm_sig = {**dict.fromkeys(["x", "res", "gate", "weight", "y", "res_out"], bf), "N": "i32", "stride_x": "i32",
                "eps": "fp32"}
    out["norm_gated"] = stack_bytes(nm._rmsnorm_kernel, norm_sig,
                                    dict(D=128, BD=128, ROWS=16, ADD_RES=False, GATED=True, SIGNAL=True),
                                    [dict(N=T * 32, stride_x=128) for T in Ts], num_warps=4)
    out["norm_kv_a"] = stack_bytes(nm._rmsnorm_kernel, norm_sig,
                                   dict(D=512, BD=512, ROWS=8, ADD_RES=False, GATED=False, SIGNAL=True),
                                   [dict(N=T, stride_x=sx) for T in Ts for sx in (mla_rows, 512 + 64)], num_warps=4)
    # both kernels for fp32 inputs (tf32x3 dots, fp32 operands stored; Gate A's path on CUDA), at the default's tiles
    out["prep_fp32"], out["scan_fp32"] = chunk_prep(f32, "tf32x3", False), chunk_scan(f32, "tf32x3", False)
    # the other decode grids at the configs of bench_kernels' DECODE_SWEEP: the largest spill of each
    # one program per head (BV = D), which normalises o in registers and shifts the taps without the counter
    out["decode_whole"] = max(
        stack_bytes(kd._kda_decode_kernel, DECODE_SIG,
                    dict(H=32, D=128, W=4, WP=4, BV=128, HAS_NORM=norm, ADJACENT=False, EARLY_O=False), DECODE_INTS,
                    num_warps=4)
        for norm in (True, False))
    out["decode_adjacent"] = max(
        stack_bytes(kd._kda_decode_kernel, DECODE_SIG,
                    dict(H=32, D=128, W=4, WP=4, BV=bv, HAS_NORM=True, ADJACENT=True, EARLY_O=e), DECODE_INTS,
                    num_warps=nw)
        for bv, nw, e in ((8, 2, False), (16, 4, False), (32, 4, False), (32, 1, True), (32, 2, True)))
    from model.triton import moe
    I, D, K = 1024, 2304, 8
    gu, dn, ro = moe.GATE_UP, moe.DOWN, moe.ROUTER
    gu_sig = {"x_ptr": bf, "idx_ptr": "*i64", "w_ptr": bf, "sg_ptr": bf, "su_ptr": bf, "act_ptr": bf}
    dn_sig = {"act_ptr": bf, "idx_ptr": "*i64", "wt_ptr": f32, "w_ptr": bf, "sd_ptr": bf, "y_ptr": bf}
    out["moe_gate_up"] = stack_bytes(moe._moe_expert_gate_up_kernel, gu_sig,
                                     dict(D=D, I=I, K=K, SLOTS=K + 1, BLOCK_I=gu["BLOCK_I"], BLOCK_D=gu["BLOCK_D"], PDL=True),
                                     num_warps=gu["num_warps"])
    out["moe_down"] = stack_bytes(moe._moe_expert_down_kernel, dn_sig,
                                  dict(D=D, I=I, K=K, KP=K, SHARED=True, BLOCK_D=dn["BLOCK_D"], BLOCK_I=dn["BLOCK_I"], PDL=True),
                                  num_warps=dn["num_warps"])
    # Gate A's precision on CUDA: an fp32 model whose routed experts stay bf16 (the shared expert is fp32)
    mixed = {**dict.fromkeys(["x_ptr", "sg_ptr", "su_ptr", "act_ptr", "sd_ptr", "y_ptr", "wt_ptr"], f32), "w_ptr": bf}
    out["moe_gate_up_fp32_bf16"] = stack_bytes(
        moe._moe_expert_gate_up_kernel, {**gu_sig, **{n: mixed[n] for n in gu_sig if n in mixed}},
        dict(D=D, I=I, K=K, SLOTS=K + 1, BLOCK_I=gu["BLOCK_I"], BLOCK_D=gu["BLOCK_D"], PDL=True), num_warps=gu["num_warps"])
    out["moe_down_fp32_bf16"] = stack_bytes(
        moe._moe_expert_down_kernel, {**dn_sig, **{n: mixed[n] for n in dn_sig if n in mixed}},
        dict(D=D, I=I, K=K, KP=K, SHARED=True, BLOCK_D=dn["BLOCK_D"], BLOCK_I=dn["BLOCK_I"], PDL=True), num_warps=dn["num_warps"])
    out["decode_fp32"] = stack_bytes(kd._kda_decode_kernel, {n: (f32 if t == bf else t) for n, t in DECODE_SIG.items()},
                                     dict(H=32, D=128, W=4, WP=4, BV=kd.DECODE["BV"], HAS_NORM=True, ADJACENT=False,
                                          EARLY_O=kd.DECODE["early_o"]), DECODE_INTS,
                                     num_warps=kd.DECODE["num_warps"])
    out["moe_route"] = stack_bytes(moe._moe_route_kernel, {"logits_ptr": f32, "bias_ptr": f32, "idx_ptr": "*i64",
                                                          "w_ptr": f32, "scaling": "fp32"},
                                   dict(E=256, K=K, BLOCK_E=256, RENORM=True))
    out["moe_router"] = stack_bytes(moe._moe_router_kernel, {"x_ptr": bf, "wr_ptr": f32, "bias_ptr": f32,
                                                            "logits_ptr": f32, "arrivals": "*i32", "idx_ptr": "*i64",
                                                            "w_ptr": f32, "scaling": "fp32"},
                                    dict(D=D, E=256, K=K, BLOCK_E=ro["BLOCK_E"], BLOCK_D=4096, EP=256, RENORM=True),
                                    num_warps=ro["num_warps"])
    from model.triton import mla_decode as ml
    H, R, P = 32, 512, 64
    split_sig = {"q_lat": f32, "q_pe": bf, "c": bf, "k_pe": bf, "pos_ptr": "*i64",
                 **dict.fromkeys(["o_part", "m_part", "l_part"], f32), "qk_scale": "fp32",
                 **dict.fromkeys(["s_qpe_b", "s_qpe_h", "s_c_b", "s_c_l", "s_kpe_b", "s_kpe_l"], "i32")}
    split_fp32_sig = {**split_sig, **dict.fromkeys(["q_pe", "c", "k_pe"], f32)}
    split_consts = dict(H=H, R=R, P=P, HG=H, HP=H, RP=R, PP=P, SPLIT=1024, BL=ml._BL, BF16=True, MMA=True)
    out["mla_split"] = stack_bytes(ml._mla_decode_split_kernel, split_sig, split_consts, mla_ints, num_warps=ml._WARPS)
    # the split kernel's cache loads: async copies into shared memory, multi-buffered, in the build the model's
    # launch gets; not with strides that are not multiples of 16 (which the model never has): the control that
    # shows the build depends on the launch's ints, and that this check can tell
    out["mla_split_async"] = [
        async_copies(ml._mla_decode_split_kernel, split_sig, split_consts, ints, num_warps=ml._WARPS)
        for ints in (mla_ints, {name: v + 1 for name, v in mla_ints.items()})]
    # the positions-as-rows split kernel (CONFIG["rows"] = "positions"), at all heads and at SHORT's head groups
    pos_consts = {**split_consts, "HG": H, "HP": H}
    del pos_consts["BF16"]
    for warps in (4, 8):
        out[f"mla_positions_{warps}"] = [
            stack_bytes(ml._mla_decode_positions_kernel, split_sig, {**pos_consts, "HG": hg, "HP": hg}, mla_ints,
                        num_warps=warps, num_stages=ml._POSITIONS_STAGES) for hg in (H, ml.SHORT["heads"])]
    out["mla_positions_async"] = async_copies(ml._mla_decode_positions_kernel, split_sig, pos_consts, mla_ints,
                                              num_warps=ml.CONFIG["positions_warps"], num_stages=ml._POSITIONS_STAGES)
    out["mla_split_min"] = stack_bytes(ml._mla_decode_split_kernel, split_sig, {**split_consts, "SPLIT": ml.MIN_SPLIT},
                                       mla_ints, num_warps=ml._WARPS)
    hs, bls = ml.SHORT["heads"], ml.SHORT["BL"]
    # head groups (short buffers): SHORT's step at its shortest split, and _BL's where the split allows it
    for name, split, step in (("mla_split_short", 2 * bls, bls), ("mla_split_short_step64", 2 * ml._BL, ml._BL),
                              ("mla_split_short_long", 1024, ml._BL)):
        out[name] = stack_bytes(ml._mla_decode_split_kernel, split_sig,
                                {**split_consts, "HG": hs, "HP": hs, "SPLIT": split, "BL": step}, mla_ints,
                                num_warps=ml._WARPS)
    fp32_consts = {**split_consts, "BF16": False}
    out["mla_split_short_fp32"] = stack_bytes(ml._mla_decode_split_kernel, split_fp32_sig,
                                              {**fp32_consts, "HG": hs, "HP": hs, "SPLIT": 2 * bls,
                                               "BL": ml._BL_FP32}, mla_ints, num_warps=ml._WARPS)
    out["mla_split_fp32"] = stack_bytes(ml._mla_decode_split_kernel, split_fp32_sig,
                                        {**fp32_consts, "BL": ml._BL_FP32}, mla_ints, num_warps=ml._WARPS)
    try:  # the shared-memory bound must be able to fail: the fp32 tile the H200 refused (BL=64, 377 KB)
        stack_bytes(ml._mla_decode_split_kernel, split_fp32_sig, {**fp32_consts, "BL": 64}, mla_ints,
                    num_warps=ml._WARPS)
        out["smem_guard"] = "missed"
    except AssertionError as e:
        out["smem_guard"] = "caught" if "shared memory" in str(e) else str(e)
    out["mla_cache_append"] = stack_bytes(ml._mla_cache_append_kernel, {
        "kv": bf, "weight": bf, "c_cache": bf, "kpe_cache": bf, "pos_ptr": "*i64", "eps": "fp32",
        **dict.fromkeys(["s_kv", "s_cb", "s_cl", "s_kb", "s_kl"], "i32")}, dict(R=R, P=P, RP=R, PP=P),
        dict(s_kv=mla_rows, s_cb=L * 512, s_cl=512, s_kb=L * 64, s_kl=64), num_warps=4)
    out["mla_combine"] = stack_bytes(ml._mla_decode_combine_kernel, {**dict.fromkeys(["o_part", "m_part", "l_part"],
                                                                                     f32), "pos_ptr": "*i64",
                                                                     "out": f32},
                                     dict(SPLIT=1024, NS=128, H=H, R=R, NSP=128, BR=128, SB=32))
    # the two absorbed products of MLA decode, at their configs and the strides of their operands (decode at batch 1
    # and 8): q_nope (bf16, a column slice of the packed projection) @ W_uk [H, 128, 512], a view of kv_b_proj's
    # weight; o_lat (fp32) @ W_uv^T [H, 512, 128], a transposed view of it
    absorb_sig = {"x": f32, "w": bf, "out": f32, "B": "i32",
                  **dict.fromkeys(["s_xb", "s_xh", "s_wh", "s_wk", "s_wn"], "i32")}

    def absorb(K, N, x, ints):
        cfg = ml.absorb_config(K)
        return stack_bytes(ml._mla_absorb_kernel, {**absorb_sig, "x": x},
                           dict(K=K, N=N, BP=16, BK=min(K, cfg["BK"]), BN=min(N, cfg["BN"]), BF16=True, MMA=True),
                           [dict(B=b, **ints) for b in (1, 8)], num_warps=cfg["num_warps"])

    out["mla_absorb"] = max(absorb(128, R, bf, dict(s_xb=mla_rows, s_xh=192, s_wh=256 * R, s_wk=R, s_wn=1)),
                            absorb(R, 128, f32, dict(s_xb=H * R, s_xh=R, s_wh=256 * R, s_wk=1, s_wn=R)))
    from model.triton import conv, moe_combine
    out["conv"] = stack_bytes(conv._causal_conv1d_kernel, {**dict.fromkeys(["x", "taps", "w", "y"], bf), "T": "i32",
                                                          "C": "i32", "stride_xb": "i64", "stride_xt": "i64"},
                              dict(W=4, HAS_TAPS=True, BT=conv.CONFIG["BT"], BC=conv.CONFIG["BC"],
                                   STEP=conv.CONFIG["STEP"], LIBDEVICE=True),
                              [dict(T=T, C=3 * 32 * 128, stride_xb=T * KDA_ROWS, stride_xt=KDA_ROWS) for T in Ts],
                              num_warps=conv.CONFIG["num_warps"])
    out["moe_combine"] = stack_bytes(moe_combine._moe_combine_kernel, {"out": bf, "slot": "*i64", "w": f32,
                                                                      "shared": bf, "y": bf, "D": "i32"},
                                     dict(K=K, HAS_SHARED=True, BD=512), dict(D=2304), num_warps=4)
    from model.triton import moe_dispatch
    out["moe_dispatch"] = stack_bytes(moe_dispatch._moe_dispatch_kernel, {"x": bf, "order": "*i64", "y": bf, "M": "i32"},
                                      dict(K=K, D=2304, BR=moe_dispatch.DISPATCH["BR"], BD=moe_dispatch.DISPATCH["BD"]),
                                      [dict(M=T * K) for T in (8192, 1001)],
                                      num_warps=moe_dispatch.DISPATCH["num_warps"])
    from benchmarks.candidates import moe_grouped as mg
    gc = mg.CONFIG

    def tiles(k):
        return dict(BM=gc[k]["BM"], BN=gc[k]["BN"], BK=gc[k]["BK"], N_FASTEST=gc["n_fastest"], TMA=gc[k]["tma"],
                    PERSISTENT=gc[k]["persistent"], COMPILED=True)

    def desc(k, rows):
        """A TMA descriptor argument of kernel k's tiles (`rows` x BK), or None (a constexpr) without TMA."""
        return ({"sig": f"tensordesc<bf16[{gc[k][rows]},{gc[k]['BK']}]>"} if gc[k]["tma"] else {"const": None})

    def with_descs(sig, consts, descs):
        for name, d in descs.items():
            if "sig" in d:
                sig[name] = d["sig"]
            else:
                consts[name] = d["const"]
        return sig, consts

    sig, consts = with_descs({"x": bf, "order": "*i64", "w": bf, "h": bf, **dict.fromkeys(
        ["tile_e", "tile_r0", "offs"], "*i32"), "n_tiles": "i32"}, dict(K=K, D=2304, I=1024, **tiles("gate_up")),
        {"w_desc": desc("gate_up", "BN")})
    n_tiles = [dict(n_tiles=n) for n in (512, 77)]
    out["moe_grouped_gate_up"] = stack_bytes(mg._moe_grouped_gate_up_kernel, sig, consts, n_tiles,
                                             num_warps=gc["gate_up"]["num_warps"],
                                             num_stages=gc["gate_up"]["num_stages"])
    sig, consts = with_descs({"h": bf, "w": bf, "out": bf, **dict.fromkeys(["tile_e", "tile_r0", "offs"], "*i32"),
                              "n_tiles": "i32"}, dict(D=2304, I=1024, **tiles("down")),
                             {"h_desc": desc("down", "BM"), "w_desc": desc("down", "BN")})
    out["moe_grouped_down"] = stack_bytes(mg._moe_grouped_down_kernel, sig, consts, n_tiles,
                                          num_warps=gc["down"]["num_warps"], num_stages=gc["down"]["num_stages"])
    from model.triton import act
    out["silu_mul"] = stack_bytes(act._silu_mul_kernel, {**dict.fromkeys("guh", bf), "N": "i32", "I": "i32",
                                                         "stride_g": "i32", "stride_u": "i32"},
                                  dict(ROWS=act._BLOCK // 1024, BI=1024, LIBDEVICE=True),
                                  # MLP's separate gate and up (the shared expert's, 1024 wide; layer 0's, 9216), and
                                  # the routed experts' halves of one gate|up output (a prefill without the grouped
                                  # kernel)
                                  [dict(N=n, I=i, stride_g=i, stride_u=i) for n in (1,) + Ts for i in (1024, 9216)]
                                  + [dict(N=T, I=1024, stride_g=2048, stride_u=2048) for T in Ts], num_warps=4)
    out["kda_gate"] = stack_bytes(act._kda_gate_kernel, {"f": bf, "A_log": f32, "dt_bias": f32, "g": f32, "N": "i32",
                                                         "C": "i32", "stride_f": "i32"},
                                  dict(D=128, ROWS=act._BLOCK // 1024, BC=1024),
                                  [dict(N=T, C=32 * 128, stride_f=32 * 128) for T in Ts], num_warps=4)
    out["control"] = stack_bytes(_segment_sums_kernel(broken=False), {"x": "*i32"}, dict(BT=4))
    try:
        out["broken"] = stack_bytes(_segment_sums_kernel(broken=True), {"x": "*i32"}, dict(BT=4))
    except triton.CompilationError:  # the negative control: this one must not compile
        out["broken"] = None
    return out


def sm90_child(expr: str):
    """(The JSON value of `expr`, over this module as `t`, and the stderr) of a child process with TRITON_INTERPRET=0,
    so that the kernel modules hold compilable kernels."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import json, tests.test_triton_kda as t; print(json.dumps({expr}))"
    child = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "TRITON_INTERPRET": "0"})
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1]), child.stderr


@pytest.mark.slow
def test_kernels_compile_for_the_h200():
    spills, _ = sm90_child("t.sm90_spills()")
    assert spills["control"] == 0 and spills["broken"] is None, "the compile check cannot tell good from bad"
    assert spills["smem_guard"] == "caught", spills["smem_guard"]
    assert spills["decode"] == 0 and spills["norm"] == spills["norm_gated"] == spills["norm_kv_a"] == 0, spills
    assert spills["decode_adjacent"] == 0 and spills["decode_whole"] == 0, spills
    assert spills["moe_gate_up"] == 0 and spills["moe_down"] == 0 and spills["moe_route"] == 0, spills
    assert "moe_gate_up_fp32_bf16" in spills and "moe_down_fp32_bf16" in spills and "decode_fp32" in spills, spills
    assert spills["mla_split"] == 0 and spills["mla_combine"] == 0 and spills["mla_absorb"] == 0, spills
    assert spills["mla_split_fp32"] == 0 and spills["mla_split_min"] == 0, spills
    assert spills["mla_split_async"] == [True, False], f"async copies (launched, odd strides): " \
                                                       f"{spills['mla_split_async']}"
    # 4 warps at 32 heads: 8 bytes, one value stored before the loop and loaded after it (kernel's CONFIG note)
    assert spills["mla_positions_4"][0] <= 8 and spills["mla_positions_4"][1] == 0, spills
    assert spills["mla_positions_8"] == [0, 0] and spills["mla_positions_async"], spills
    assert spills["mla_split_short"] == spills["mla_split_short_step64"] == spills["mla_split_short_long"] == 0, spills
    assert spills["mla_split_short_fp32"] == 0 and spills["mla_cache_append"] == 0, spills
    # measured trade-offs, see model/triton/kda_chunk.py: the 4-warp prep spills and is still the fastest
    assert spills["scan"] <= 16 and spills["prep"] <= 512, spills
    # the fp32 path (tf32x3, fp32 operands) spills more: 792 and 1328 B when these bounds were set, the prep 1,576 B
    # since its prefix sums of the gates became tl.dots (tf32x3 splits each operand in two); it serves the exact
    # gates, whose prompts are short, and is not tuned for speed
    assert spills["prep_fp32"] <= 2048 and spills["scan_fp32"] <= 1536, spills
    assert spills["moe_router"] == 0, spills
    assert spills["conv"] == 0 and spills["moe_combine"] == 0 and spills["moe_dispatch"] == 0, spills
    assert spills["moe_grouped_gate_up"] == 0 and spills["moe_grouped_down"] == 0, spills
    assert spills["silu_mul"] == 0 and spills["kda_gate"] == 0, spills


def decode_cluster_build(num_ctas: int) -> str:
    """Build the decode kernel as one program a head (BV = D, the default) for sm_90 with `num_ctas` CTAs a
    program (a thread-block cluster): 'built' or 'failed'."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from model.triton import kda_decode as kd
    s, c, attrs = launched(kd._kda_decode_kernel, DECODE_SIG, dict(H=32, D=128, W=4, WP=4, BV=128, HAS_NORM=True,
                                                                   ADJACENT=False, EARLY_O=False), DECODE_INTS)
    try:
        triton.compile(ASTSource(kd._kda_decode_kernel, s, c, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=kd.DECODE["num_warps"], num_ctas=num_ctas))
    except RuntimeError:  # which pass failed, MLIR says on the process's stderr
        return "failed"
    return "built"


@pytest.mark.slow  # a trip-wire for a new Triton (pinned in pyproject.toml), compiling for sm_90 in a child
def test_the_decode_kernel_cannot_be_built_as_a_cluster_yet():
    """A trip-wire for issue 4's batch-1 target. The output norm needs a head's whole row of o. Split over several
    SMs, a head hands its row over through global memory; one cluster of CTAs a head could sum it through
    distributed shared memory instead. Triton 3.6 cannot build this kernel so: its CTA planning pass fails (a
    minimal 2-D reduce fails there too). When this test fails, the installed Triton builds it: try the cluster
    (docs/RESULTS.md, "Missed, issue 4"). The control, one CTA, must build in the same child."""
    (one, two), stderr = sm90_child("[t.decode_cluster_build(1), t.decode_cluster_build(2)]")
    assert one == "built", f"the control did not build: {stderr[-4000:]}"
    assert two == "failed", "a cluster of 2 CTAs built: the installed Triton can now make it"
    assert "TritonGPUPlanCTAPass" in stderr, f"the cluster failed elsewhere: {stderr[-4000:]}"


def test_offline_builds_specialise_ints_as_the_launcher_does():
    """`launched`: an int of 1 becomes a constant, a multiple of 16 is compiled as one, any other stays a plain
    int; an int argument without a value is refused (a build that guesses is not the one that runs)."""
    @triton.jit
    def three_ints(x, n, m, k):
        tl.store(x, n + m + k)

    sig = {"x": "*i32", "n": "i32", "m": "i32", "k": "i64"}
    s, c, attrs = launched(three_ints, sig, {}, dict(n=1, m=4096, k=4097))
    assert c == {"n": 1} and s == {"x": "*i32", "n": "constexpr", "m": "i32", "k": "i32"}
    assert set(attrs) == {(0,), (2,)}          # x (a pointer) and m (a multiple of 16)
    assert launched(three_ints, sig, {}, dict(n=2, m=2 ** 40, k=3))[0]["m"] == "i64"
    with pytest.raises(ValueError, match="values needed"):
        launched(three_ints, sig, {}, dict(n=1, m=16))


# ---- real shapes on the GPU ---------------------------------------------------------------------

@pytest.fixture
def no_tf32():
    """The fp32 torch references must really be fp32 (cuDNN convs default to TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 63), (1, 64), (1, 65), (1, 1000), (1, 8192), (1, 65536), (4, 2048),
                                 (64, 65)])
def test_gpu_chunk_real_shapes(B, T, dtype, no_tf32):
    check_chunk_real_shapes(B, T, dtype)


def check_chunk_real_shapes(B, T, dtype, cfg=None):
    """Ours at 32 heads of 128 against the torch chunked form and (up to 8192 tokens) fp64; `cfg` overrides
    CONFIG."""
    q, k, v, g, beta, h0 = kda_inputs(B, T, 32, 128, 128, "model", T, DTYPES[dtype])
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, cfg=cfg)
    ro, rh = kda.chunk_kda(q, k, v, g, beta, initial_state=h0)
    tol = 1e-4 if dtype == "fp32" else 1e-2
    assert_close(o, ro, tol, "o vs torch chunk")
    assert_close(ht, rh, tol, "state vs torch chunk")
    if B * T <= 8192:
        no, nh = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
        assert_close(o, no, tol, "o vs fp64")
        assert_close(ht, nh, tol, "state vs fp64")


@pytest.mark.gpu
@gpu
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="Triton 3.6 on the H200: the prep kernel's tf32x3 dots at chunks of 16 on one warp come out "
                          "wrong, so fp32 inputs take CONFIG['exact']; an unexpected pass says the override can go")
def test_gpu_chunk_fp32_fault_at_chunks_of_16(no_tf32):
    """The compiler fault behind CONFIG["exact"]: fp32 inputs at the bf16 default's chunks of 16 on one warp.
    Strict: when a Triton release fixes it, this test fails (XPASS) and says so."""
    check_chunk_real_shapes(1, 1000, "fp32", cfg=dict(chunk=16, prep_warps=1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,T", [(1, 65), (1, 8192), (4, 2048)])
def test_gpu_chunk_tf32_dots(B, T, no_tf32):
    """bf16 inputs with the other dot operands (CONFIG prep_dots, scan_dots = "tf32": fp32 operands in tf32)."""
    check_chunk_real_shapes(B, T, "bf16", cfg=dict(prep_dots="tf32", scan_dots="tf32"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 65), (1, 4096), (4, 1000)])
def test_gpu_chunk_scan_stages_give_the_same_bits(B, T, dtype):
    """The scan's pipeline stages move loads, not arithmetic: every stage count gives the default's bits (the
    interpreter always runs the plain loop, so only the GPU can check this); and a changed input is seen."""
    q, k, v, g, beta, h0 = kda_inputs(B, T, 32, 128, 128, "model", T, DTYPES[dtype])
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    for stages in (1, 2, 4):
        o_s, ht_s = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, cfg=dict(scan_stages=stages))
        assert torch.equal(o_s, o) and torch.equal(ht_s, ht), f"scan_stages={stages}"
    v[:, -1] += 1  # the comparison can fail: the last token's value reaches its o and the final state
    o_s, ht_s = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0, cfg=dict(scan_stages=1))
    assert not torch.equal(o_s, o) and not torch.equal(ht_s, ht)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("regime", ["near0", "minus5", "minus1000", "spikes", "mixed"])
def test_gpu_chunk_saturated_gates(regime):
    q, k, v, g, beta, h0 = kda_inputs(1, 4096, 32, 128, 128, regime, 11)
    o, ht = chunk_kda_fwd(q, k, v, g, beta, initial_state=h0)
    no, nh = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    assert_close(o, no, 1e-4, "o vs fp64")
    assert_close(ht, nh, 1e-4, "state vs fp64")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("cfg", [None, dict(grid="adjacent", BV=16, num_warps=4), dict(grid="strided", BV=16, num_warps=4),
                                 dict(grid="adjacent", BV=32, num_warps=2), dict(grid="strided", BV=128, num_warps=8),
                                 dict(early_o=True), dict(grid="adjacent", BV=32, num_warps=1, early_o=True)],
                         ids=["default", "adjacent16", "strided16", "adjacent32", "whole128", "early_o",
                              "adjacent32_early_o"])
def test_gpu_decode_real_shapes(B, dtype, cfg, no_tf32):
    """Several steps in a row at 32 heads x 128 (several state blocks per head, finished by whichever
    block comes last): every step's o, state and taps against the composition
    of the torch references."""
    inp = decode_inputs(B, 32, 128, 4, DTYPES[dtype], B)
    gen = torch.Generator().manual_seed(B)
    gate = torch.randn(B, 32 * 128, generator=gen).to(DTYPES[dtype]).cuda()
    weight = torch.randn(128, generator=gen).cuda()
    tol = 1e-5 if dtype == "fp32" else 1e-2
    state, taps = inp["state"].clone(), inp["conv_taps"].clone()
    for step in range(4):
        inp = {**inp, "qkv_raw": torch.randn_like(inp["qkv_raw"]), "state": state, "conv_taps": taps}
        ro, rstate, rtaps = decode_reference(inp, 32, 128)
        normed, got_state, got_taps = run_decode(inp, out_gate=gate, norm_weight=weight, cfg=cfg)
        assert torch.equal(got_taps, rtaps), f"step {step}: conv taps"
        assert_close(got_state, rstate, tol, f"step {step}: state")
        ref = hf_norm(KimiLinearRMSNormGated, 128, weight)(ro.to(normed.dtype), gate.view(B, 32, 128))
        assert_close(normed, ref, tol if dtype == "fp32" else 2e-2, f"step {step}: normed o")
        state, taps = rstate, rtaps  # each step starts from the reference, so errors do not compound


@pytest.mark.gpu
@gpu
def test_gpu_norms_are_exact_in_bf16():
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(4096, 2304, generator=gen).bfloat16().cuda() for _ in range(2))
    w = (1 + 0.1 * torch.randn(2304, generator=gen)).bfloat16().cuda()
    ref = hf_norm(KimiLinearRMSNorm, 2304, w)(x)
    y = rmsnorm(x, w, 1e-5)
    assert_within_ulps(y, ref)
    assert (y == ref).float().mean() > 0.999
    y_add, new_res = add_rmsnorm(x, res, w, 1e-5)
    assert torch.equal(new_res, x + res)
    ref_add = hf_norm(KimiLinearRMSNorm, 2304, w)(x + res)
    assert_within_ulps(y_add, ref_add)
    assert (y_add == ref_add).float().mean() > 0.999
    o, gate = (torch.randn(4096, 32, 128, generator=gen).bfloat16().cuda() for _ in range(2))
    wg = torch.randn(128, generator=gen).cuda()
    ref = hf_norm(KimiLinearRMSNormGated, 128, wg)(o, gate)
    y = gated_rmsnorm(o, gate, wg, 1e-5)
    assert_within_ulps(y, ref)
    assert (y == ref).float().mean() > 0.999

"""The KDA forms in model/kda.py against each other and an fp64 naive recurrence."""
import torch
from hypothesis import given, strategies as st

from model.kda import causal_conv1d, chunk_kda, naive_recurrent_kda, recurrent_kda_step
from tests.conftest import rel_err

GATES = {"near0": (-1e-3, 0.0), "minus5": (-5.0, -5.0), "mixed": (-3.0, 0.0), "very_neg": (-1000.0, -1000.0)}


def inputs(B, T, H, K, V, gate, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lo, hi = GATES[gate]
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    gg = lo + (hi - lo) * torch.rand(B, T, H, K, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    s0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, gg, beta, s0


shape = dict(T=st.integers(1, 200), gate=st.sampled_from(sorted(GATES)), seed=st.integers(0, 2**16),
             chunk=st.sampled_from([16, 64]), init=st.booleans())


@given(**shape)
def test_chunk_and_recurrent_match_fp64_naive(T, gate, seed, chunk, init):
    q, k, v, g, beta, s0 = inputs(1, T, 2, 16, 8, gate, seed)
    s0 = s0 if init else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert rel_err(o_c, o_ref) < 1e-5 and rel_err(s_c, s_ref) < 1e-5
    state = (s0.clone() if init else torch.zeros(1, 2, 16, 8))
    o_r = torch.stack([recurrent_kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state) for t in range(T)], 1)
    assert rel_err(o_r, o_ref) < 1e-5 and rel_err(state, s_ref) < 1e-5


@given(T=st.integers(2, 160), split=st.integers(1, 159), seed=st.integers(0, 2**16), gate=st.sampled_from(sorted(GATES)))
def test_state_carry_prefix_then_rest_equals_whole(T, split, seed, gate):
    split = min(split, T - 1)
    q, k, v, g, beta, _ = inputs(1, T, 2, 16, 16, gate, seed)
    o_all, s_all = chunk_kda(q, k, v, g, beta)
    o_a, s_a = chunk_kda(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split])
    o_b, s_b = chunk_kda(q[:, split:], k[:, split:], v[:, split:], g[:, split:], beta[:, split:], initial_state=s_a)
    assert rel_err(torch.cat([o_a, o_b], 1), o_all) < 1e-5
    assert rel_err(s_b, s_all) < 1e-5


@given(T=st.integers(2, 150), cut=st.integers(1, 149), seed=st.integers(0, 2**16))
def test_future_tokens_never_change_earlier_outputs(T, cut, seed):
    """Perturb only positions >= cut: outputs before cut must be bit-identical (no leak through a chunk)."""
    cut = min(cut, T - 1)
    q, k, v, g, beta, s0 = inputs(1, T, 2, 16, 16, "mixed", seed)
    o1, _ = chunk_kda(q, k, v, g, beta, initial_state=s0)
    q2, k2, v2, g2, b2 = (t.clone() for t in (q, k, v, g, beta))
    for t in (q2, k2, v2):
        t[:, cut:] += 3.0 * torch.randn_like(t[:, cut:])
    g2[:, cut:] = -torch.rand_like(g2[:, cut:]) * 4
    b2[:, cut:] = torch.rand_like(b2[:, cut:])
    o2, _ = chunk_kda(q2, k2, v2, g2, b2, initial_state=s0)
    assert torch.equal(o1[:, :cut], o2[:, :cut])
    assert not torch.equal(o1[:, cut:], o2[:, cut:])


def test_batch_rows_are_independent():
    q, k, v, g, beta, s0 = inputs(3, 70, 2, 16, 16, "mixed", 7)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0)
    for b in range(3):
        ob, sb = chunk_kda(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], initial_state=s0[b:b + 1])
        assert rel_err(ob, o[b:b + 1]) < 1e-6 and rel_err(sb, s[b:b + 1]) < 1e-6


def test_empty_sequence_keeps_state():
    q, k, v, g, beta, s0 = inputs(1, 0, 2, 16, 16, "mixed", 1)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0)
    assert o.shape == (1, 0, 2, 16) and torch.equal(s, s0)


def test_conv_taps_carry_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 23, 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    y_all, taps_all = causal_conv1d(x, w)
    y1, t1 = causal_conv1d(x[:, :9], w)
    ys = [y1]
    for t in range(9, 23):
        y, t1 = causal_conv1d(x[:, t:t + 1], w, t1)
        ys.append(y)
    assert rel_err(torch.cat(ys, 1), y_all) < 1e-6 and torch.equal(t1, taps_all)
    # the current token is multiplied by w[:, -1]
    y0, _ = causal_conv1d(x[:, :1], w)
    assert torch.allclose(y0[:, 0], torch.nn.functional.silu(x[:, 0] * w[:, -1]))

"""Packed projections (`KimiDeltaAttention.pack_`, `MultiLatentAttention.pack_`): the same parameters, the same
numbers, fewer launches.

The reference is the unpacked form: each nn.Linear applied on its own (`separate_projections`, the code the
packing replaced). On a CPU in fp32 the packed q|k|v, f and gate come out bit-identical to it; b_proj (4 or
32 output columns) may differ in the last bits, since BLAS picks another kernel for that narrow a GEMM.
"""
import contextlib

import pytest
import torch

from model.build import from_state_dict, load_model
from model.checkpoint import internal_names, save_checkpoint
from model.config import PRESETS
from model.generate import generate_incremental, generate_recompute
from model.layers import KimiDeltaAttention, MultiLatentAttention
from model.weights import synthetic_weights, weights_id
from tests.conftest import rel_err

CFG = PRESETS["tiny"]
PROMPTS = [[500, 300, 1, 44, 45, 46, 47, 200, 19, 91, 3], [500] + list(range(60, 130))]
PACKED = ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "g_a_proj", "b_proj",
          "forget_gate.f_b_proj", "g_b_proj")


def separate_projections(self, x):
    """The unpacked reference of `KimiDeltaAttention._project`: eight launches, one per nn.Linear."""
    fg = self.forget_gate
    qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
    return qkv, fg.f_b_proj(fg.f_a_proj(x)), self.g_b_proj(self.g_a_proj(x)), self.b_proj(x)


@contextlib.contextmanager
def unpacked():
    """Run every KDA layer through the separate projections inside the block."""
    packed = KimiDeltaAttention._project
    KimiDeltaAttention._project = separate_projections
    try:
        yield
    finally:
        KimiDeltaAttention._project = packed


def kda_layers(model):
    return [(i, layer.self_attn) for i, layer in enumerate(model.model.layers) if layer.kind == "kda"]


@pytest.fixture(scope="module")
def state():
    return synthetic_weights(CFG, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny(state):
    return from_state_dict(CFG, state)


def test_parameters_are_views_of_the_packed_buffers(tiny):
    H, d, D = CFG.kda_num_heads, CFG.kda_head_dim, CFG.hidden_size
    assert kda_layers(tiny)
    for _, a in kda_layers(tiny):
        assert a.in_proj_weight.shape == (3 * H * d + 2 * d + H, D) and a.gate_b_weight.shape == (2, H * d, d)
        row = 0
        for name in PACKED[:6]:
            w = a.get_submodule(name).weight
            assert w.data_ptr() == a.in_proj_weight[row].data_ptr(), name
            row += w.shape[0]
        assert row == a.in_proj_weight.shape[0]
        assert a.forget_gate.f_b_proj.weight.data_ptr() == a.gate_b_weight[0].data_ptr()
        assert a.g_b_proj.weight.data_ptr() == a.gate_b_weight[1].data_ptr()


def test_state_dict_round_trip_is_unchanged(tiny, state):
    sd = tiny.state_dict()
    assert sorted(sd) == sorted(internal_names(CFG))        # no packed buffer leaks into the state dict
    for n, t in state.items():
        assert sd[n].shape == t.shape and sd[n].dtype == t.dtype and torch.equal(sd[n], t), n
    assert weights_id(sd, CFG) == weights_id(state, CFG)
    again = from_state_dict(CFG, sd).state_dict()           # the packed model's own views, packed again
    assert all(torch.equal(again[n], t) for n, t in state.items())


def test_caller_tensors_of_packed_weights_are_copied_the_rest_shared(tiny, state):
    sd = tiny.state_dict()
    for i, _ in kda_layers(tiny):
        p = f"model.layers.{i}.self_attn."
        for name in PACKED:
            assert sd[p + name + ".weight"].data_ptr() != state[p + name + ".weight"].data_ptr(), name
        assert sd[p + "o_proj.weight"].data_ptr() == state[p + "o_proj.weight"].data_ptr()
    assert sd["lm_head.weight"].data_ptr() == state["lm_head.weight"].data_ptr()
    # a later write to the caller's tensor does not reach the packed model
    own = {n: t.clone() for n, t in state.items()}
    m = from_state_dict(CFG, own)
    ids = torch.tensor([PROMPTS[0]])
    before = m(ids)
    own["model.layers.0.self_attn.q_proj.weight"].zero_()
    assert torch.equal(m(ids), before)


def test_forward_reads_the_packed_buffers(state):
    """Poisoning a packed buffer must reach the logits (so the nn.Linear weights are not what runs)."""
    for buf in ("in_proj_weight", "gate_b_weight"):
        m = from_state_dict(CFG, {n: t.clone() for n, t in state.items()})
        getattr(kda_layers(m)[0][1], buf).fill_(float("nan"))
        assert torch.isnan(m(torch.tensor([PROMPTS[0]]))).all(), buf


@pytest.mark.parametrize("prompt", PROMPTS)
def test_packed_equals_unpacked_recompute_and_incremental(tiny, prompt):
    ids = torch.tensor([prompt])
    packed_rec = tiny(ids)
    packed_inc = generate_incremental(tiny, prompt, 8, keep_logits=True)
    with unpacked():
        ref_rec = tiny(ids)
        ref_inc = generate_incremental(tiny, prompt, 8, keep_logits=True)
    assert rel_err(packed_rec, ref_rec) < 1e-6
    assert packed_inc.tokens == ref_inc.tokens
    assert max(rel_err(a, b) for a, b in zip(packed_inc.logits, ref_inc.logits)) < 1e-6
    assert generate_recompute(tiny, prompt, 8).tokens == packed_inc.tokens


def test_packed_projections_bit_identical_except_b_on_cpu(tiny):
    """Rows of several tokens: the packed GEMM gives the separate projections' bits (b, 32 columns, sums in
    another order). A single row goes down the BLAS's GEMV path, whose blocking over the output columns follows N:
    with MKL on an Intel Xeon (AVX-512) about 1% of the packed q|k|v outputs then differ in the last bits (relative
    1e-8), where on an AMD EPYC they did not; so one row is held to fp32 rounding instead."""
    _, a = kda_layers(tiny)[0]
    for x in (torch.randn(3, 7, CFG.hidden_size), torch.randn(1, CFG.hidden_size), torch.randn(4, CFG.hidden_size)):
        outs, refs = a._project(x), separate_projections(a, x)
        one_row = x.reshape(-1, x.shape[-1]).shape[0] == 1
        for name, o, r in zip(("qkv", "f", "gate", "b"), outs, refs):
            assert o.shape == r.shape, name
            if name == "b" or one_row:
                assert rel_err(o, r) < 1e-6, name
            else:
                assert torch.equal(o, r), name


def test_checkpoint_of_a_packed_model_loads_back_the_same(tiny, tmp_path):
    save_checkpoint(tiny.state_dict(), CFG, tmp_path / "ckpt")
    loaded = load_model(checkpoint=str(tmp_path / "ckpt"), dtype=torch.float32)
    assert loaded.weights == weights_id(tiny.state_dict(), CFG) == load_model("tiny", dtype=torch.float32).weights
    sd = loaded.model.state_dict()
    assert all(torch.equal(sd[n], t) for n, t in tiny.state_dict().items())
    ids = torch.tensor([PROMPTS[1]])
    assert torch.equal(loaded.model(ids), tiny(ids))


def test_hf_peer_wraps_the_packed_tensors(tiny):
    from model.hf import hf_from_state_dict

    hf = hf_from_state_dict(CFG, tiny.state_dict(), attn="eager")
    _, ours = kda_layers(tiny)[0]
    i = kda_layers(tiny)[0][0]
    theirs = hf.state_dict()[f"model.layers.{i}.self_attn.k_proj.weight"]
    assert theirs.data_ptr() == ours.k_proj.weight.data_ptr()               # shared, not copied
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert rel_err(tiny(ids), hf(ids).logits.float()) <= 1e-5


@pytest.mark.parametrize("kind,proj", [("kda", "b_proj"), ("mla", "q_proj")])
def test_pack_refuses_mixed_dtypes(state, kind, proj):
    m = from_state_dict(CFG, {n: t.clone() for n, t in state.items()})
    a = (kda_layers if kind == "kda" else mla_layers)(m)[0][1]
    a.get_submodule(proj).weight = torch.nn.Parameter(a.get_submodule(proj).weight.double(), requires_grad=False)
    with pytest.raises(TypeError, match="one dtype"):
        a.pack_()


# ---- MLA: q_proj | kv_a_proj_with_mqa ----------------------------------------------------------------

def mla_layers(model):
    return [(i, layer.self_attn) for i, layer in enumerate(model.model.layers) if layer.kind != "kda"]


def test_mla_parameters_are_views_of_the_packed_buffer(tiny, state):
    assert mla_layers(tiny)
    sd = tiny.state_dict()
    for i, a in mla_layers(tiny):
        assert a.in_proj_weight.shape == (a.q_proj.out_features + a.R + a.P, CFG.hidden_size)
        assert a.q_proj.weight.data_ptr() == a.in_proj_weight.data_ptr()
        assert a.kv_a_proj_with_mqa.weight.data_ptr() == a.in_proj_weight[a.q_proj.out_features].data_ptr()
        for name in ("q_proj", "kv_a_proj_with_mqa"):   # copied from the caller's tensors, equal to them
            key = f"model.layers.{i}.self_attn.{name}.weight"
            assert sd[key].data_ptr() != state[key].data_ptr() and torch.equal(sd[key], state[key])


def test_mla_forward_and_decode_read_the_packed_buffer(state):
    """Poisoning the packed buffer must reach the logits of the span forward and of a decode step."""
    m = from_state_dict(CFG, {n: t.clone() for n, t in state.items()})
    mla_layers(m)[0][1].in_proj_weight.fill_(float("nan"))
    assert torch.isnan(m(torch.tensor([PROMPTS[0]]))).all()
    out = generate_incremental(m, PROMPTS[0][:1], 2, keep_logits=True)
    assert all(torch.isnan(lg).all() for lg in out.logits)


def separate_mla_projections(self, x):
    """The unpacked reference of `MultiLatentAttention._project`: one launch per nn.Linear."""
    return self.q_proj(x), self.kv_a_proj_with_mqa(x)


def test_mla_packed_equals_unpacked(tiny):
    packed = MultiLatentAttention._project
    ids = torch.tensor([PROMPTS[1]])
    got_rec, got_inc = tiny(ids), generate_incremental(tiny, PROMPTS[1], 6, keep_logits=True)
    MultiLatentAttention._project = separate_mla_projections
    try:
        ref_rec, ref_inc = tiny(ids), generate_incremental(tiny, PROMPTS[1], 6, keep_logits=True)
    finally:
        MultiLatentAttention._project = packed
    assert rel_err(got_rec, ref_rec) < 1e-6 and got_inc.tokens == ref_inc.tokens
    assert max(rel_err(a, b) for a, b in zip(got_inc.logits, ref_inc.logits)) < 1e-6

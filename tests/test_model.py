"""The model's two generation paths against each other, against HF transformers, and on bad input."""
import dataclasses

import pytest
import torch

from model.build import from_state_dict, load_model
from model.cache import DecodeCache
from model.config import PRESETS
from model.generate import generate_incremental, generate_recompute
from model.weights import synthetic_weights
from tests.conftest import rel_err

CFG = PRESETS["tiny"]
PROMPTS = [[500, 7, 8, 9], [500, 300, 1, 44, 45, 46, 47, 200, 19, 91, 3], [500] + list(range(60, 130)), [500]]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float32).model


def test_logits_have_a_realistic_spread(tiny):
    logits = tiny(torch.tensor([PROMPTS[1]]))[0]
    std = logits.std(-1)
    p_max = torch.softmax(logits, -1).max(-1).values
    assert (std > 0.5).all() and (std < 10).all(), std      # not flat, not saturated
    assert (p_max < 0.99).all() and (p_max > 2.0 / CFG.vocab_size).all()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_incremental_equals_fresh_recompute_at_every_step(tiny, prompt):
    """The seed's state-carry case: each carried decode step's logits equal a fresh full recompute's."""
    n = 12
    inc = generate_incremental(tiny, prompt, n, keep_logits=True)
    rec = generate_recompute(tiny, prompt, n, keep_logits=True)
    assert inc.tokens == rec.tokens
    for step, (a, b) in enumerate(zip(inc.logits, rec.logits)):
        assert rel_err(a, b) <= 1e-5, f"step {step}"


def _cache_tensors(cache):
    return [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("last", ["kda", "mla"])
def test_last_layer_takes_only_the_last_token_on(last):
    """With only the last logits asked for, the last layer takes every token into the cache but only the last one
    through its attention output and MLP: the same logits as the whole last layer's last row, the same cache bits.
    Both kinds of last layer (tiny ends in KDA, 48b-a3b in MLA), from an empty cache and after a first chunk."""
    cfg = CFG if last == "kda" else dataclasses.replace(CFG, kda_layers=(1, 2, 3), full_attn_layers=(4,)).validate()
    assert cfg.layer_kinds[-1] == last
    m = from_state_dict(cfg, synthetic_weights(cfg, seed=3))
    ids = torch.tensor([PROMPTS[2]])
    rows = []
    m.model.layers[-1].mlp.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[1]))
    assert rel_err(m(ids, last_only=True), m(ids)[:, -1]) < 1e-6
    assert rows == [1, ids.shape[1]]   # the trim happened: the last MLP saw one token, then all of them
    for first in (0, 29):
        trimmed, whole = m.new_cache(1, 80), m.new_cache(1, 80)
        if first:
            m.prefill(ids[:, :first], trimmed), m.prefill(ids[:, :first], whole)
        a = m.prefill(ids[:, first:], trimmed)
        b = m.prefill(ids[:, first:], whole, last_only=False)
        assert a.shape == (1, cfg.vocab_size) and rel_err(a, b[:, -1]) < 1e-6, first
        assert all(torch.equal(x, y) for x, y in zip(_cache_tensors(trimmed), _cache_tensors(whole)))


def test_last_layer_trim_is_checked_by_its_test(monkeypatch):
    """Negative controls for the test above: a last query that attends from the first position's place (the
    causal mask aligned at the start, as SDPA's is_causal aligns it) moves the logits; a last layer whose
    attention input is trimmed too leaves its tokens out of the cache."""
    from torch.nn.attention.bias import causal_upper_left

    from model import ops
    cfg = dataclasses.replace(CFG, kda_layers=(1, 2, 3), full_attn_layers=(4,)).validate()
    m = from_state_dict(cfg, synthetic_weights(cfg, seed=3))
    ids = torch.tensor([PROMPTS[2]])
    whole = m(ids)[:, -1]
    with monkeypatch.context() as p:
        p.setattr(ops, "causal_lower_right", causal_upper_left)
        assert rel_err(m(ids, last_only=True), whole) > 1e-3
    layer, forward = m.model.layers[-1], type(m.model.layers[-1]).forward

    def trims_too_early(self, x, residual=None, cache_layer=None, start=0, last_only=False):
        if last_only:
            x, residual = x[:, -1:], None if residual is None else residual[:, -1:]
        return forward(self, x, residual, cache_layer, start + (x.shape[1] - 1 if last_only else 0), last_only)

    monkeypatch.setattr(type(layer), "forward", trims_too_early)
    trimmed, full = m.new_cache(1, 80), m.new_cache(1, 80)
    m.prefill(ids, trimmed), m.prefill(ids, full, last_only=False)
    assert not all(torch.equal(x, y) for x, y in zip(_cache_tensors(trimmed), _cache_tensors(full)))


def test_chunked_prefill_then_decode_equals_one_prefill(tiny):
    ids = torch.tensor([PROMPTS[2]])
    one, split = tiny.new_cache(1, 90), tiny.new_cache(1, 90)
    l1 = tiny.prefill(ids, one)
    for a, b in ((0, 13), (13, 64), (64, ids.shape[1])):
        l2 = tiny.prefill(ids[:, a:b], split)
    assert rel_err(l2, l1) < 1e-5
    tok = l1.argmax(-1)
    for _ in range(5):
        d1, d2 = tiny.decode_step(tok, one), tiny.decode_step(tok, split)
        assert rel_err(d2, d1) < 1e-5
        tok = d1.argmax(-1)


def test_output_does_not_depend_on_batch_size(tiny):
    ids = torch.randint(0, CFG.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    batched = tiny(ids)
    for b in range(3):
        assert rel_err(tiny(ids[b:b + 1]), batched[b:b + 1]) < 1e-6
    cache = tiny.new_cache(3, 30)
    tiny.prefill(ids, cache)
    step = tiny.decode_step(ids[:, 0], cache)
    for b in range(3):
        c1 = tiny.new_cache(1, 30)
        tiny.prefill(ids[b:b + 1], c1)
        assert rel_err(tiny.decode_step(ids[b:b + 1, 0], c1), step[b:b + 1]) < 1e-6


def test_dropped_state_carry_changes_the_logits(tiny):
    """The state really is carried: zeroing the KDA state before a step changes the result."""
    ids = torch.tensor([PROMPTS[1]])
    cache = tiny.new_cache(1, 20)
    tiny.prefill(ids, cache)
    good = tiny.decode_step(torch.tensor([5]), cache).clone()
    cache2 = tiny.new_cache(1, 20)
    tiny.prefill(ids, cache2)
    for layer in cache2.layers:
        if hasattr(layer, "state"):
            layer.state.zero_()
    assert rel_err(tiny.decode_step(torch.tensor([5]), cache2), good) > 1e-3


def test_fp64_and_bf16_run():
    state = synthetic_weights(CFG, seed=0, dtype=torch.float64)
    m64 = from_state_dict(CFG, state)
    l64 = m64(torch.tensor([PROMPTS[1]]))
    m32 = load_model("tiny", dtype=torch.float32).model
    assert rel_err(m32(torch.tensor([PROMPTS[1]])), l64) < 1e-5
    mbf = load_model("tiny", dtype=torch.bfloat16).model
    lbf = mbf(torch.tensor([PROMPTS[1]]))
    assert torch.isfinite(lbf).all() and rel_err(lbf, l64) < 5e-2


@pytest.mark.parametrize("bad,err,match", [
    ([], ValueError, "empty prompt"),
    ([1, 2, CFG.vocab_size], ValueError, "outside the vocabulary"),
    ([-1, 2], ValueError, "outside the vocabulary"),
    ([500, 1.7, 2.2], TypeError, r"token ids must be integers, got 1\.7 at position 1"),    # not cast to [500, 1, 2]
    ([True, False], TypeError, "token ids must be integers, got True at position 0"),
    ("hello", TypeError, "got text: tokenise it first"),
    ([[1, 2], [3, 4]], TypeError, r"got \[1, 2\] at position 0"),
    (torch.tensor([1.0, 2.0]), TypeError, "got a torch.float32 tensor"),
    (torch.tensor([[1, 2]]), ValueError, r"one sequence of token ids \(1-D\), got shape \(1, 2\)"),
])
def test_bad_prompts_get_clear_errors(tiny, bad, err, match):
    with pytest.raises(err, match=match):
        generate_incremental(tiny, bad, 2)
    with pytest.raises(err, match=match):
        generate_recompute(tiny, bad, 2)


def test_a_prompt_may_be_any_integer_sequence(tiny):
    import numpy as np
    want = generate_incremental(tiny, [5, 6, 7], 2).tokens
    for same in ((5, 6, 7), np.array([5, 6, 7]), torch.tensor([5, 6, 7], dtype=torch.int32)):
        assert generate_incremental(tiny, same, 2).tokens == want


def test_decode_step_refuses_an_id_outside_the_vocabulary(tiny):
    cache = tiny.new_cache(1, 4)
    tiny.prefill(torch.tensor([[1, 2]]), cache)
    with pytest.raises(ValueError, match=rf"token id {CFG.vocab_size} lies outside the vocabulary"):
        tiny.decode_step(torch.tensor([CFG.vocab_size]), cache)
    assert cache.length == 2    # refused before anything moved


def test_cache_overflow_is_refused(tiny):
    cache = tiny.new_cache(1, 3)
    tiny.prefill(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="full"):
        tiny.decode_step(torch.tensor([1]), cache)
    with pytest.raises(ValueError, match="max_len"):
        DecodeCache.empty(CFG, 1, 0, torch.float32, "cpu")

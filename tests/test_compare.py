"""gates/compare.py: margins, the near-tie / real classification, per-position scores, the explanation."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gates.compare import (NEAR_TIE_EPS, NOISE_FACTOR, Divergence, GateResult, Margin, Side, compare_prompt,
                           diagnose, margin, near_tie_eps, near_tie_eps_at, noise_check, spacing)
from model.generate import Generation

IDS = [1234, 877, 5, 6, 7, 8, 9, 10, 11, 12]


def side(name, ids, lps):
    return Side(name, ids[0], list(ids), list(lps))


def lps(top, second, rest_start=-3.0):
    return [top, second] + [rest_start - i for i in range(8)]


def test_near_tie_when_both_margins_small_and_each_in_the_others_top5():
    ref = side("recompute", IDS, lps(-0.51, -0.53))
    test = side("incremental", [877, 1234] + IDS[2:], lps(-0.52, -0.535))
    d = diagnose(3, 7, ref, test, eps=0.05)
    assert d.verdict == "near-tie" and d.in_each_others_top
    assert d.ref_margin == Margin(pytest.approx(0.02), False) and d.test_margin == Margin(pytest.approx(0.015), False)
    assert d.explain() == ("prompt 3 step 7: recompute chose 1234, incremental chose 877; margins 0.02 nats "
                           "(1234 over 877, recompute) and 0.015 nats (877 over 1234, incremental); near-tie needs "
                           "each token in the other's top-5 (yes) and both margins in [0, 0.05) (yes) -> near-tie; "
                           "top-5 log-probs recompute: 1234 -0.51, 877 -0.53, 5 -3, 6 -4, 7 -5; "
                           "incremental: 877 -0.52, 1234 -0.535, 5 -3, 6 -4, 7 -5")


@pytest.mark.parametrize("case", ["margin above eps", "margin equals eps", "outside top-5", "outside top-k",
                                  "negative margin"])
def test_real_divergences(case):
    ref = side("recompute", IDS, lps(-0.51, -0.53))
    test_ids, test_lps = [877, 1234] + IDS[2:], lps(-0.52, -0.535)
    eps = 0.05
    if case == "margin above eps":
        test_lps = lps(-0.4, -0.6)
    elif case == "margin equals eps":
        eps = 0.25  # the recompute margin is exactly 0.25 (binary-exact values): not below it
        ref = side("recompute", IDS, lps(-0.5, -0.75))
        test_lps = lps(-0.5, -0.625)
    elif case == "outside top-5":  # 1234 ranks 6th for the incremental side: kept, but not in its top-5
        test_ids = [877, 5, 6, 7, 8, 1234, 9, 10, 11, 12]
        test_lps = [-0.52, -0.5201, -0.5202, -0.5203, -0.5204, -0.5205, -3, -4, -5, -6]
    elif case == "outside top-k":
        test_ids = [877] + list(range(100, 109))
    elif case == "negative margin":  # incremental "chose" 877 but ranks 1234 higher: not a greedy choice
        test_ids, test_lps = [877, 1234] + IDS[2:], lps(-0.53, -0.52)
    d = diagnose(0, 4, ref, Side("incremental", 877, test_ids, test_lps), eps=eps)
    assert d.verdict == "real", d.explain()
    assert "-> real;" in d.explain()
    # the line says which of the two conditions failed
    top5 = case in ("outside top-5", "outside top-k")
    assert f"in the other's top-5 ({'no' if top5 else 'yes'})" in d.explain()
    assert f"both margins in [0, {eps:.3g}) ({'yes' if top5 and case != 'outside top-k' else 'no'})" in d.explain()
    if case == "outside top-k":
        assert d.test_margin.lower_bound and str(d.test_margin).startswith(">= ")
        assert d.test_margin.nats == pytest.approx(test_lps[0] - test_lps[-1])


def test_diagnose_rejects_bad_input():
    a = side("a", IDS, lps(-0.5, -0.6))
    with pytest.raises(ValueError, match="both sides chose 1234"):
        diagnose(0, 0, a, a, 0.1)
    b = side("b", [877, 1234] + IDS[2:], lps(-0.5, -0.6))
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        diagnose(0, 0, a, b, 0.0)
    with pytest.raises(ValueError, match="needs at least the top-5"):
        diagnose(0, 0, a, Side("b", 877, [877, 1234, 5], [-0.5, -0.6, -0.7]), 0.1)
    with pytest.raises(ValueError, match="not in its own top-k"):
        margin(Side("c", 99, IDS, lps(-0.5, -0.6)), 1234)


@given(st.lists(st.floats(-20, 20, allow_nan=False), min_size=12, max_size=40, unique=True), st.integers(0, 39))
def test_margin_is_the_logit_difference_or_a_lower_bound_of_it(logits, other):
    logits = torch.tensor(logits, dtype=torch.float64)
    other %= len(logits)
    lp = torch.log_softmax(logits, -1)
    top = torch.topk(lp, 10)
    s = Side("s", int(top.indices[0]), top.indices.tolist(), top.values.tolist())
    true = float(logits[s.token] - logits[other])
    m = margin(s, other)
    if m.lower_bound:
        assert other not in s.topk_ids and m.nats <= true + 1e-9
    else:
        assert m.nats == pytest.approx(true, abs=1e-9)


def test_near_tie_eps_by_dtype():
    assert near_tie_eps(torch.bfloat16) == 0.125 and near_tie_eps(torch.float32) == 1e-4
    assert near_tie_eps(torch.float64) == near_tie_eps(torch.float32) < near_tie_eps(torch.float16) < near_tie_eps(torch.bfloat16)
    assert set(NEAR_TIE_EPS) == {torch.bfloat16, torch.float16, torch.float32, torch.float64}
    with pytest.raises(ValueError, match="no near-tie epsilon for dtype torch.int8"):
        near_tie_eps(torch.int8)


def test_bf16_rounding_flip_is_a_near_tie_and_two_spacings_are_not():
    """bf16 top logits differ by whole spacings (0.0625 in [8, 16)): one side's exact tie against the other's
    one-spacing margin is what two roundings of one value give (tiny in bf16, record 9c7967c0), a near-tie;
    a two-spacing margin is real."""
    eps = near_tie_eps(torch.bfloat16)
    ref = side("ref", IDS, lps(-1.5, -1.5))                    # tie: the ref kept the lower id
    flip = side("test", [877, 1234] + IDS[2:], lps(-1.4375, -1.5))  # one spacing the other way
    assert diagnose(4, 8, ref, flip, eps).verdict == "near-tie"
    wide = side("test", [877, 1234] + IDS[2:], lps(-1.375, -1.5))   # two spacings
    assert diagnose(4, 8, ref, wide, eps).verdict == "real"


def test_bf16_epsilon_follows_the_top_logits_spacing():
    """Above 16 a bf16 logit moves in steps of 2^-3: a margin of one step is a near-tie there, two are not; below 16
    the floor of two spacings in [8, 16) holds, and fp32's epsilon stays 1e-4 at any logit a model gives."""
    assert spacing(torch.bfloat16, 20.0) == 2.0 ** -3 and spacing(torch.bfloat16, -12.0) == 2.0 ** -4
    assert near_tie_eps(torch.bfloat16, 20.0) == 2.0 ** -2 and near_tie_eps(torch.bfloat16, 40.0) == 2.0 ** -1
    assert near_tie_eps(torch.bfloat16, 3.0) == near_tie_eps(torch.bfloat16) == 2.0 ** -3
    assert near_tie_eps(torch.float32, 30.0) == near_tie_eps(torch.float32) == 1e-4
    assert near_tie_eps(torch.bfloat16, float("nan")) == 2.0 ** -3
    # a gate against a golden of another dtype takes the less precise one's
    both = near_tie_eps_at(torch.float32, torch.bfloat16)
    assert both(20.0) == 2.0 ** -2 and both(None) == 2.0 ** -3
    assert near_tie_eps_at(torch.float32, torch.float64)(20.0) == 1e-4


@pytest.mark.parametrize("top, test_margin, verdict", [(20.0, 0.125, "near-tie"), (20.0, 0.25, "real"),
                                                       (10.0, 0.125, "real"), (None, 0.125, "real")])
def test_compare_prompt_takes_the_epsilon_at_the_divergent_steps_top_logit(top, test_margin, verdict):
    def gen(first, second, margin):
        g = Generation(prompt=[1], tokens=[3, first], topk_ids=[[3] + list(range(20, 29)), [first, second] +
                                                                 list(range(20, 28))],
                       topk_logprobs=[[-0.1 * (i + 1) for i in range(10)], [-1.0, -1.0 - margin] +
                                      [-3.0 - i for i in range(8)]])
        if top is not None:   # the other side's top logit is smaller: the larger in magnitude sets eps
            g.top_logits = [top + 1.0, top if first == 9 else top / 2]
        return g
    eps = lambda t: near_tie_eps(torch.bfloat16, t)
    r = compare_prompt(0, gen(5, 9, 0.0), gen(9, 5, test_margin), eps, "rec", "inc")
    assert r.first_divergence == 1 and r.verdict == verdict
    assert r.divergence.eps == near_tie_eps(torch.bfloat16, top)
    assert r.divergence.test.top_logit == top and r.divergence.to_dict()["test"]["top_logit"] == top
    assert ("top logits" in r.divergence.explain()) == (top is not None)


def _gen(tokens, logits=None):
    top = lambda t: [t] + [x for x in range(20, 29)]
    return Generation(prompt=[1], tokens=list(tokens), topk_ids=[top(t) for t in tokens],
                      topk_logprobs=[[-0.1 * (i + 1) for i in range(10)] for _ in tokens],
                      logits=[] if logits is None else logits)


def test_compare_prompt_scores_positions_and_diagnoses_the_first_divergence():
    ref_logits = [torch.zeros(30) for _ in range(5)]
    test_logits = [torch.full((30,), 1e-3 * (i + 1)) for i in range(5)]
    r = compare_prompt(2, _gen([3, 4, 5, 6, 7], ref_logits), _gen([3, 4, 9, 6, 8], test_logits), 0.05, "rec", "inc")
    assert (r.k, r.n, r.first_divergence) == (3, 5, 2)  # positions 0, 1, 3 agree
    assert r.divergence.ref.token == 5 and r.divergence.test.token == 9 and r.verdict == "real"
    # logit differences only while both saw the same context: steps 0..2
    assert r.max_abs_logit_diff == pytest.approx([1e-3, 2e-3, 3e-3])
    same = compare_prompt(0, _gen([3, 4]), _gen([3, 4]), 0.05, "rec", "inc")
    assert same.verdict == "match" and same.first_divergence is None and same.max_abs_logit_diff == []
    with pytest.raises(ValueError, match="rec has 2 tokens, inc 3"):
        compare_prompt(0, _gen([3, 4]), _gen([3, 4, 5]), 0.05, "rec", "inc")


def test_gate_result_table_and_summary():
    prompts = [compare_prompt(0, _gen([3, 4]), _gen([3, 4]), 0.05, "rec", "inc"),
               compare_prompt(1, _gen([3, 4]), _gen([3, 5]), 0.05, "rec", "inc")]
    g = GateResult("Gate A", "rec", "inc", prompts)
    assert (g.score, g.total, g.passed) == (3, 4, False)
    assert g.summary() == "Gate A FAIL 3/4: inc vs rec (1 real)"
    assert "prompt 1 step 1: rec chose 4" in g.table()
    res = g.results()
    assert res["per_prompt"][1] == {"prompt": 1, "k": 1, "n": 2, "first_divergence": 1, "verdict": "real"}
    assert res["diagnoses"][0]["explanation"].startswith("prompt 1 step 1") and isinstance(g.diagnoses[0], Divergence)
    ok = GateResult("Gate A", "rec", "inc", prompts[:1])
    assert ok.passed and ok.summary() == "Gate A PASS 2/2: inc vs rec"


def _diverging(first, noise, n=6, prompt=0):
    """A comparison whose first divergence is at `first` (None: none), with max|dlogit| `noise` at every step
    both sides shared."""
    tokens = list(range(3, 3 + n))
    other = list(tokens) if first is None else tokens[:first] + [99] * (n - first)
    steps = n if first is None else first + 1
    return compare_prompt(prompt, _gen(tokens, [torch.zeros(30)] * n),
                          _gen(other, [torch.full((30,), noise)] * steps + [torch.zeros(30)] * (n - steps)),
                          0.05, "rec", "x")


def test_noise_check_calls_a_divergence_noise_only_when_a_control_strays_as_far():
    test = _diverging(3, 0.3)
    # the control itself parts from the reference by the same step: noise
    assert noise_check(test, _diverging(2, 0.01), "ctrl").within_noise
    # the control stays on the reference's tokens but its logits stray at least half as far: noise
    near = noise_check(test, _diverging(None, 0.3 / NOISE_FACTOR), "ctrl")
    assert near.within_noise and near.test_noise == pytest.approx(0.3) and near.control_first_divergence is None
    # a wrong computation strays far beyond a control that agrees to rounding: not noise
    far = noise_check(test, _diverging(None, 1e-3), "ctrl")
    assert not far.within_noise and "beyond the noise floor" in far.explain()
    # a control identical to the reference (no noise at all) never excuses anything
    assert not noise_check(test, _diverging(None, 0.0), "ctrl").within_noise
    # a control that diverges later than the test does not excuse it either
    assert not noise_check(test, _diverging(5, 1e-3), "ctrl").within_noise
    with pytest.raises(ValueError, match="did not diverge"):
        noise_check(_diverging(None, 0.1), _diverging(None, 0.1), "ctrl")


def test_gate_result_reports_the_noise_checks():
    p = _diverging(3, 0.3)
    p.noise = noise_check(p, _diverging(2, 0.01), "rec[torch kernels]")
    g = GateResult("Gate A", "rec", "x", [p])
    assert g.summary() == "Gate A FAIL 3/6: x vs rec (1 real; 1 of 1 within the noise floor of rec[torch kernels])"
    assert "prompt 0: control rec[torch kernels] diverges from the reference at step 2" in g.table()
    assert g.results()["per_prompt"][0]["noise"]["within_noise"] is True

"""Gate A's logit criterion on tiny (CPU): the bound comes from a noise floor measured in the same run, a clean run
passes both criteria, and errors planted in the decode path that leave the tokens alone fail on the logits."""
import pytest
import torch

from gates.compare import FP32_RESOLUTION, LOGIT_FACTOR, GateResult, LogitBound, PromptResult, logit_bound
from gates.gate_a import run_gate_a
from gates.plant import SITES, planted
from gates.run import EXIT_FAIL, EXIT_PASS, load_subject, resolve
from records.store import load


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def opts():
    return resolve(preset="tiny", device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def subject(opts):
    return load_subject(opts)


def gate(opts, subject, root, site=None, rel=None):
    said = []
    if site is None:
        code = run_gate_a(opts, subject=subject, records_root=root, log=said.append)
    else:
        with planted(site, rel):
            code = run_gate_a(opts, subject=subject, records_root=root, log=said.append)
    (rec,) = load("gate_a", root=root).records
    return code, rec["results"], "\n".join(said)


def test_a_clean_run_passes_both_criteria_with_its_bound_recorded(tmp_path, opts, subject):
    code, r, said = gate(opts, subject, tmp_path)
    assert code == EXIT_PASS and r["tokens_passed"] and r["logits_passed"] and r["score"] == r["total"] == 128
    b = r["logit_bound"]
    assert b["enforced"] and 0 < b["floor"] < 1e-4 and b["bound"] == LOGIT_FACTOR * max(b["floor"], b["resolution"])
    assert r["max_abs_logit_diff_overall"] <= b["bound"]
    assert "logit bound" in said and "noise floor" in said and b["derivation"] in said
    assert all(p["failed"] == "-" and p["logit_excess"] is None for p in r["per_prompt"])


def test_a_planted_error_that_leaves_every_token_fails_on_the_logits(tmp_path, opts, subject):
    """Negative control for the logit criterion: a 1e-3 relative error in MLA's decode attention moves no token of
    the battery on tiny (128/128), so the token criterion alone passed it; the logits fail the gate."""
    code, r, said = gate(opts, subject, tmp_path, "mla_attention", 1e-3)
    assert r["tokens_passed"] and r["score"] == 128, "the control needs an error that leaves the tokens alone"
    assert code == EXIT_FAIL and not r["logits_passed"] and not r["passed"]
    assert {p["failed"] for p in r["per_prompt"]} == {"logits"}
    assert "logits stray" in said and "Gate A FAIL 128/128; logits 0/8 prompts within" in said
    assert all(p["logit_excess"]["max_abs_logit_diff"] > r["logit_bound"]["bound"] for p in r["per_prompt"])


@pytest.mark.parametrize("site", list(SITES))
def test_the_bound_is_not_so_loose_that_a_1e3_error_passes(tmp_path, opts, subject, site):
    code, r, _ = gate(opts, subject, tmp_path, site, 1e-3)
    assert code == EXIT_FAIL and not r["logits_passed"], r["max_abs_logit_diff_overall"]


def test_a_wrong_token_without_wrong_logits_fails_on_tokens(tmp_path, opts, subject):
    """Negative control for the token criterion, kept beside the new one: a decode step that returns its logits with
    one token pushed to the top fails on tokens (the later steps' contexts differ, so no logits are compared)."""
    step = subject.model.decode_step

    def forced(tokens, cache):
        out = step(tokens, cache).clone()
        out[:, 7] = out.max() + 1.0
        return out
    said = []
    code = run_gate_a(opts, subject=subject, records_root=tmp_path, decode=forced, log=said.append)
    r = load("gate_a", root=tmp_path).records[0]["results"]
    assert code == EXIT_FAIL and not r["tokens_passed"]
    assert {p["failed"] for p in r["per_prompt"]} <= {"tokens", "both"}


def rows(*values):
    return [torch.tensor([v, 0.0], dtype=torch.float64) for v in values]


def test_the_bound_is_derived_from_the_largest_control_difference():
    b = logit_bound([rows(10.0, 11.0), rows(12.0)], [rows(10.0, 11.0 + 3e-6), rows(12.0 + 5e-6)], "ctl", True)
    assert b.floor == pytest.approx(5e-6, rel=1e-6) and b.floor_at == (1, 0)
    assert b.resolution == FP32_RESOLUTION * 12.0 and b.bound == pytest.approx(LOGIT_FACTOR * 5e-6, rel=1e-6)
    exact = logit_bound([rows(8.0)], [rows(8.0)], "ctl", True)      # no measurable floor: one fp32 unit stands in
    assert exact.floor == 0 and exact.bound == LOGIT_FACTOR * FP32_RESOLUTION * 8.0


def result(diffs, enforced):
    b = LogitBound("ctl", 1e-6, (0, 0), 0.0, LOGIT_FACTOR, enforced)
    p = PromptResult(0, 16, 16, None, diffs)
    return GateResult("Gate A", "recompute", "incremental", [p], b), p


def test_in_bf16_a_logit_excess_is_reported_not_failed():
    g, p = result([1e-3], enforced=False)
    assert g.passed and g.failed_criteria(p) == "logits (reported)" and "(reported)" in g.summary()
    g, p = result([1e-3], enforced=True)
    assert not g.passed and g.failed_criteria(p) == "logits" and g.results()["per_prompt"][0]["logit_excess"]


def test_a_nan_logit_difference_fails_the_bound():
    g, p = result([float("nan")], enforced=True)
    assert not g.passed and p.logit_excess(g.logit_bound)[0] == 0

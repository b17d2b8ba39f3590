"""gates/margins.py: the greedy margins of a golden, by hand on a tiny golden (an exact tie is a margin of 0), the
refusals of a bad golden with nothing appended, and the committed goldens' records."""
import json
from pathlib import Path

import pytest
import torch

from gates import margins
from gates.compare import NEAR_TIE_EPS
from gates.golden import GOLDEN_DIR, ids_md5
from records import store

# Two prompts, two steps; top-5 log-probs in binary fractions, so the margins are exact. Step (0, 1) is an exact
# tie: its top-2 equals its top-1, margin 0.
LOGPROBS = [[[-0.25, -2.75, -3.0, -3.5, -4.0], [-0.5, -0.5, -3.0, -3.5, -4.0]],
            [[-1.0, -1.0625, -3.0, -3.5, -4.0], [-0.25, -1.0, -3.0, -3.5, -4.0]]]
BY_HAND = [[2.5, 0.0], [0.0625, 0.75]]


def tiny_golden(logprobs=LOGPROBS) -> dict:
    prompts = []
    for i, steps in enumerate(logprobs):
        top = [[10 * i + j + k for k in range(5)] for j in range(len(steps))]
        prompts.append({"text": f"p{i}", "ids": [1, 2, 3], "expected": [t[0] for t in top], "topk_ids": top,
                        "topk_logprobs": steps})
    return {"format": 1, "label": "toy", "preset": None, "weights": "sha256:0123", "dtype": "bf16",
            "device": "cuda", "source": "hf", "new_tokens": len(logprobs[0]), "topk": 5, "prompts": prompts,
            "md5": ids_md5([p["expected"] for p in prompts]), "prompt_ids_source": "hand",
            "provenance": {"implementation": "hf-transformers-0", "time": "2026-01-01T00:00:00+00:00",
                           "device_name": "a GPU", "git_commit": None}}


def write(path: Path, g: dict) -> Path:
    path.write_text(json.dumps(g))
    return path


@pytest.fixture
def records(tmp_path, monkeypatch):
    root = tmp_path / "records"
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(root))
    return root


def test_margins_of_a_tiny_golden_are_the_ones_computed_by_hand(tmp_path, records):
    assert margins.main([str(write(tmp_path / "toy.json", tiny_golden()))]) == 0
    [rec] = store.load("margins", root=records).records
    assert store.validate_record(rec) == [] and rec["verdict"] == "VALID"
    r = rec["results"]
    assert r["margins"] == BY_HAND
    assert r["margins"][0][1] == 0.0 and r["zeros"] == 1     # the exact tie: top-2 equals top-1
    assert r["n"] == 4 and r["median"] == (0.0625 + 0.75) / 2 and r["min"] == 0.0 and r["max"] == 2.5
    assert r["bf16_eps"] == 0.125 and r["frac_below_bf16_eps"] == 0.5       # 0 and 0.0625
    assert r["fp32_eps"] == 1e-4 and r["frac_below_fp32_eps"] == 0.25       # the tie alone
    assert (rec["preset"], rec["dtype"], rec["device"], rec["weights"]) == ("toy", "bfloat16", "cuda", "sha256:0123")
    p = rec["params"]
    assert (p["label"], p["source"], p["implementation"], p["golden_dtype"], p["prompts"], p["new_tokens"],
            p["topk"]) == ("toy", "hf", "hf-transformers-0", "bf16", 2, 2, 5)


def test_the_epsilons_are_the_gates_own():
    assert margins.BF16_EPS == NEAR_TIE_EPS[torch.bfloat16] == 2.0 ** -3
    assert margins.FP32_EPS == NEAR_TIE_EPS[torch.float32] == NEAR_TIE_EPS[torch.float64]


def test_a_bad_golden_is_refused_and_no_record_of_any_golden_is_appended(tmp_path, records, capsys):
    good = write(tmp_path / "good.json", tiny_golden())
    unsorted = [[[-2.75, -0.25, -3.0, -3.5, -4.0], s[1]] for s in LOGPROBS]   # top-1 below top-2
    bad = write(tmp_path / "bad.json", tiny_golden(unsorted))
    assert margins.main([str(good), str(bad)]) == 2
    assert "bad.json" in capsys.readouterr().err and not (records / "margins.jsonl").exists()
    edited = tiny_golden()
    edited["prompts"][0]["expected"][0] = 99        # its md5 no longer matches its ids
    assert margins.main([str(write(tmp_path / "edited.json", edited))]) == 2
    assert margins.main([str(tmp_path / "none.json")]) == 2
    assert not (records / "margins.jsonl").exists()
    with pytest.raises(SystemExit) as e:
        margins.main([])
    assert e.value.code == 2


def test_an_unwritable_records_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "file"))
    assert margins.main([str(write(tmp_path / "toy.json", tiny_golden()))]) == 2


def test_the_48b_golden_has_exact_ties_and_more_near_ties_than_the_reference(tmp_path, records):
    names = ["kimi-linear-ref-bf16-cuda-hf.json", "48b-a3b-bf16-cuda-hf.json"]
    ref, big = margins.record_goldens([GOLDEN_DIR / n for n in names], log=lambda _: None)
    assert [r["params"]["golden"] for r in (ref, big)] == [f"gates/goldens/{n}" for n in names]
    assert ref["results"]["zeros"] == 0 < big["results"]["zeros"]
    assert big["results"]["frac_below_bf16_eps"] > 2 * ref["results"]["frac_below_bf16_eps"]
    assert big["results"]["median"] < ref["results"]["median"]
    assert len(store.load("margins", root=records).records) == 2

"""The nightly run: a failed gate or a planted slowdown fails it; a clean run on tiny passes."""
import json
import sys

import numpy as np
import pytest

from records import store
from reports import nightly
from reports.nightly import Step

GOLDEN = "gates/goldens/tiny-fp64-cpu-hf.json"


def bench_history(root, slow_last: float, runs: int = 6, seed: int = 0):
    """Decode records of THIS machine (make_record fills its provenance), the last one slowed by `slow_last`."""
    rng = np.random.default_rng(seed)
    for i in range(runs):
        factor = slow_last if i == runs - 1 else 1.0
        samples = (2.5 * factor * np.exp(rng.normal(0, 0.01)) * rng.lognormal(0, 0.02, 200)).round(5).tolist()
        rec = store.make_record("bench", preset="tiny", dtype="float32", device="cpu", weights="w",
                                params={"phase": "decode", "context": 1024, "batch": 1, "impl": "ours-graph",
                                        "peer": None},
                                results={"tok_s": 1000 / float(np.mean(samples)), "samples_ms": samples})
        rec["time"] = f"2026-11-0{1 + i}T00:00:00+00:00"
        store.append(rec, root=root)


def test_a_failed_gate_fails_the_nightly(tmp_path):
    golden = json.loads(open(GOLDEN).read())
    golden["prompts"][1]["expected"][4] = (golden["prompts"][1]["expected"][4] + 1) % 500
    bad = tmp_path / "perturbed.json"
    bad.write_text(json.dumps(golden))
    steps = [Step("gate-b", [sys.executable, "-m", "gates", "gate-b", "--golden", str(bad)], gate=True)]
    code = nightly.main(["--records", str(tmp_path / "rec"), "--out", str(tmp_path / "out")], steps=steps)
    assert code == 1
    rec = store.load(kinds=["nightly"], root=tmp_path / "rec").records[-1]
    assert rec["results"]["passed"] is False and rec["results"]["steps"]["gate-b"]["returncode"] != 0


@pytest.mark.parametrize("slow,expected", [(1.10, 1), (1.0, 0)])
def test_a_planted_slowdown_fails_the_nightly_and_noise_does_not(tmp_path, slow, expected):
    bench_history(tmp_path / "rec", slow)
    assert nightly.main(["--records", str(tmp_path / "rec"), "--out", str(tmp_path / "out")], steps=[]) == expected
    rec = store.load(kinds=["nightly"], root=tmp_path / "rec").records[-1]
    verdicts = [r["verdict"] for r in rec["results"]["regressions"]]
    assert verdicts == (["regression"] if expected else ["ok"])
    assert (tmp_path / "out" / "index.html").is_file()


def test_full_nightly_on_tiny_passes(tmp_path):
    code = nightly.main(["--records", str(tmp_path / "rec"), "--out", str(tmp_path / "out")])
    kinds = {r["kind"] for r in store.load(root=tmp_path / "rec").records}
    assert code == 0, kinds
    assert {"gate_a", "gate_b", "memory", "bench", "decomposition", "nightly"} <= kinds

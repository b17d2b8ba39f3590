"""The nightly run: a failed gate or a planted slowdown fails it; a clean run on tiny passes."""
import json
import re
import sys
import time

import numpy as np
import pytest

from records import store
from reports import nightly
from reports.nightly import Step

GOLDEN = "gates/goldens/tiny-fp64-cpu-hf.json"


def dirs(tmp_path) -> list[str]:
    """The nightly's records, report and step logs, all under tmp_path (never the repository's)."""
    return ["--records", str(tmp_path / "rec"), "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs")]


def bench_run(root, factor: float, day: int | None, seed: int):
    """One decode record of THIS machine (make_record fills its provenance), its samples slowed by `factor`; dated
    2026-11-0<day> (the history), or now (None: a run the nightly made)."""
    rng = np.random.default_rng(seed)
    samples = (2.5 * factor * np.exp(rng.normal(0, 0.01)) * rng.lognormal(0, 0.02, 200)).round(5).tolist()
    rec = store.make_record("bench", preset="tiny", dtype="float32", device="cpu", weights="w",
                            params={"phase": "decode", "context": 1024, "batch": 1, "impl": "ours-graph",
                                    "peer": None},
                            results={"tok_s": 1000 / float(np.mean(samples)), "samples_ms": samples})
    if day is not None:
        rec["time"] = f"2026-11-0{day}T00:00:00+00:00"
    store.append(rec, root=root)


def bench_history(root, runs: int = 5):
    for i in range(runs):
        bench_run(root, 1.0, 1 + i, seed=i)


def bench_step(root, factor: float) -> Step:
    """A step that writes tonight's bench record, as the bench step would."""
    code = f"from tests.test_nightly import bench_run; bench_run({str(root)!r}, {factor}, None, 99)"
    return Step("bench", [sys.executable, "-c", code])


def test_a_failed_gate_fails_the_nightly(tmp_path):
    golden = json.loads(open(GOLDEN).read())
    golden["prompts"][1]["expected"][4] = (golden["prompts"][1]["expected"][4] + 1) % 500
    bad = tmp_path / "perturbed.json"
    bad.write_text(json.dumps(golden))
    steps = [Step("gate-b", [sys.executable, "-m", "gates", "gate-b", "--golden", str(bad)], gate=True)]
    code = nightly.main(dirs(tmp_path), steps=steps)
    assert code == 1
    rec = store.load(kinds=["nightly"], root=tmp_path / "rec").records[-1]
    assert rec["results"]["passed"] is False and rec["results"]["steps"]["gate-b"]["returncode"] != 0


@pytest.mark.parametrize("slow,expected", [(1.10, 1), (1.0, 0)])
def test_a_planted_slowdown_fails_the_nightly_and_noise_does_not(tmp_path, slow, expected):
    bench_history(tmp_path / "rec")
    assert nightly.main(dirs(tmp_path), steps=[bench_step(tmp_path / "rec", slow)]) == expected
    rec = store.load(kinds=["nightly"], root=tmp_path / "rec").records[-1]
    verdicts = [r["verdict"] for r in rec["results"]["regressions"]]
    assert verdicts == (["regression"] if expected else ["ok"])
    assert (tmp_path / "out" / "index.html").is_file()
    summary = (tmp_path / "out" / "SUMMARY.md").read_text()
    assert ("| REGRESSION: tiny decode ctx 1024 batch 1 ours-graph, float32, no GPU \\@ " if expected
            else "| none of 1 flagged |") in summary


def test_an_old_slow_record_is_not_judged_again_when_bench_did_not_run(tmp_path):
    bench_history(tmp_path / "rec")
    bench_run(tmp_path / "rec", 1.10, 6, seed=5)      # a slow run of an earlier night, already reported then
    assert nightly.main(dirs(tmp_path), steps=[Step("gate", [sys.executable, "-c", "pass"], gate=True)]) == 0
    assert store.load(kinds=["nightly"], root=tmp_path / "rec").records[-1]["results"]["regressions"] == []
    assert "| nothing judged (no bench record) |" in (tmp_path / "out" / "SUMMARY.md").read_text()


# Slow tier: the whole nightly on tiny, each step its own process (about a minute). The steps' commands are tested
# on their own in test_gates.py and test_benchmarks.py; the nightly's verdicts and summary over stand-in steps above.
@pytest.mark.slow
def test_full_nightly_on_tiny_passes(tmp_path):
    code = nightly.main(dirs(tmp_path))
    kinds = {r["kind"] for r in store.load(root=tmp_path / "rec").records}
    assert code == 0, kinds
    assert {"gate_a", "gate_b", "memory", "bench", "decomposition", "nightly"} <= kinds
    summary = (tmp_path / "out" / "SUMMARY.md").read_text()
    assert "| PASS | gate-a ok " in summary and "gate-memory skipped" in summary, summary
    assert re.search(r"\| none of \d+ flagged \(\d+ with too little history to judge\) \| — \|", summary)


def test_each_step_streams_its_output_and_keeps_it_whole(tmp_path, capsys):
    say = "import sys\nfor i in range(40): print('line', i)\nsys.exit(3)"
    steps = [Step("chatty", [sys.executable, "-c", say])]
    code = nightly.main(dirs(tmp_path), steps=steps)
    assert code == 1
    shown = capsys.readouterr().out
    assert "[chatty] line 0\n" in shown and "[chatty] line 39\n" in shown and "CRASHED" in shown
    assert (tmp_path / "logs" / "chatty.log").read_text().splitlines() == [f"line {i}" for i in range(40)]
    step = store.load(kinds=["nightly"], root=tmp_path / "rec").records[-1]["results"]["steps"]["chatty"]
    assert step["returncode"] == 3 and not step["timed_out"]
    assert step["tail"].splitlines() == [f"line {i}" for i in range(40 - nightly.TAIL_LINES, 40)]
    summary = (tmp_path / "out" / "SUMMARY.md").read_text()   # the report's nightly table says what failed
    assert re.search(r"\| FAIL \| chatty CRASHED \d+ s \| nothing judged \(no bench record\) \| chatty: line 39 \|",
                     summary)


def test_a_hung_step_is_killed_with_its_children_and_fails_the_nightly(tmp_path, capsys):
    # the child leaves a grandchild holding the output pipe: killing the child alone would leave the nightly
    # waiting on the pipe for the grandchild's 120 s
    hang = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('started', flush=True)\ntime.sleep(120)")
    steps = [Step("hangs", [sys.executable, "-c", hang], gate=True),
             Step("after", [sys.executable, "-c", "print('still ran')"])]
    t0 = time.perf_counter()
    code = nightly.main(dirs(tmp_path) + ["--step-timeout", "3"], steps=steps)
    assert time.perf_counter() - t0 < 60
    assert code == 1
    assert "TIMEOUT" in capsys.readouterr().out
    steps = store.load(kinds=["nightly"], root=tmp_path / "rec").records[-1]["results"]["steps"]
    assert steps["hangs"]["timed_out"] and steps["hangs"]["returncode"] == -9 and "started" in steps["hangs"]["tail"]
    assert steps["after"]["returncode"] == 0 and not steps["after"]["timed_out"] and "tail" not in steps["after"]
    assert re.search(r"\| FAIL \| hangs TIMEOUT \d+ s; after ok \d+ s \| nothing judged \(no bench record\) \| "
                     r"hangs: started \(killed: --step-timeout\) \|", (tmp_path / "out" / "SUMMARY.md").read_text())


def test_steps_are_chosen_by_name_and_an_unknown_name_is_refused(tmp_path):
    planned = nightly.plan(None, gpu=False, out=tmp_path)
    assert [s.name for s in nightly.select(planned, "bench, gate-a")] == ["gate-a", "bench"]
    assert nightly.select(planned, None) == planned
    with pytest.raises(SystemExit, match="no step named bench-kernels.*gate-a, gate-b"):
        nightly.select(planned, "gate-a,bench-kernels")   # bench-kernels runs only on a GPU
    with pytest.raises(SystemExit, match="--steps names no step"):
        nightly.select(planned, " , ")
    with pytest.raises(SystemExit):
        nightly.main(["--step-timeout", "-1"])

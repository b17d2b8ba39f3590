"""`records.exits.run_main`: the exit-code contract of the commands outside the gates (benchmarks, the detection
curve, the nightly): 0 done, the command's own code where it returns one, 2 where it could not run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from records import store
from records.exits import EXIT_REFUSED, run_main

ROOT = Path(__file__).resolve().parents[1]


class Panic(BaseException):
    """What a Rust library's panic raises through pyo3: not an Exception."""


def raising(exc):
    def main():
        raise exc
    return main


@pytest.mark.parametrize("main,code", [
    (lambda: None, 0), (lambda: 1, 1), (lambda: [{"a": 1}], 0), (lambda: True, 0),
    (raising(SystemExit(0)), 0), (EXIT_2 := raising(SystemExit(2)), 2), (raising(SystemExit("no step named x")), 2),
    (raising(ValueError("bad")), 2), (raising(Panic("unwrap on None")), 2),
    (raising(store.RecordsUnwritable("records/bench.jsonl: No space left on device")), 2),
])
def test_run_main_maps_every_ending_to_the_contract(main, code, capsys):
    assert run_main(main) == code
    err = capsys.readouterr().err
    if code == 2 and main is not EXIT_2:     # an int exit code is the command's own (argparse has printed why)
        assert err.strip(), "a refusal says why"


def test_run_main_checks_the_records_before_the_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "file" / "records"))
    ran = []
    assert run_main(lambda: ran.append(1), kinds=("bench",)) == EXIT_REFUSED
    assert ran == [] and "the run cannot be recorded" in capsys.readouterr().err


def test_run_main_lets_an_interrupt_through():
    with pytest.raises(KeyboardInterrupt):
        run_main(raising(KeyboardInterrupt()))


@pytest.mark.parametrize("argv", [
    ["benchmarks.bench_e2e", "--quick"], ["benchmarks.decompose", "--quick"],
    ["benchmarks.detection", "--clean", "1"], ["benchmarks.kernels"], ["benchmarks.routing_noise", "--preset", "tiny"],
])
def test_a_benchmark_whose_records_cannot_be_written_exits_2_before_measuring(tmp_path, argv):
    """They measured for minutes, then died on the record with a traceback and exit 1 (a failed gate's code)."""
    (tmp_path / "file").write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
           "KIMI_RECORDS_DIR": str(tmp_path / "file" / "records")}
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "the run cannot be recorded" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_nightly_step_list_naming_no_step_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "KIMI_RECORDS_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "reports.nightly", "--steps", "nope", "--records", str(tmp_path),
                        "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no step named nope" in r.stderr and "Traceback" not in r.stderr, r.stderr

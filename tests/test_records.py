"""records/store.py on real files: round trip, concurrent writers, torn lines, validation."""
import json
import multiprocessing as mp
import re
import subprocess

import numpy as np
import pytest
import torch

from records import store
from records.store import SCHEMA, append, load, make_record, provenance


def _bench(**results):
    return make_record("bench", preset="tiny", dtype="bfloat16", device="cpu", weights="random:0",
                       params={"phase": "decode", "context": 128}, results=results)


def test_round_trip(tmp_path):
    rec = _bench(tok_s=np.float32(12.5), peer="hf", peer_tok_s=torch.tensor(6.7, dtype=torch.float64),
                 samples_ms=[1.0, 2.0], roofline_fraction=0.5)
    path = append(rec, root=tmp_path)
    assert path == tmp_path / "bench.jsonl"
    got = load(root=tmp_path)
    assert got.problems == []
    assert got.records == [json.loads(json.dumps(rec))]
    row = got.df.iloc[0]
    assert row["results.tok_s"] == 12.5 and row["results.peer_tok_s"] == 6.7
    assert row["params.phase"] == "decode" and row["machine.host"] == rec["machine"]["host"]
    assert rec["schema"] == SCHEMA and re.fullmatch(r"[0-9a-f]{32}", rec["id"])
    assert rec["time"].endswith("+00:00")


def test_load_filters_kinds_and_sorts_by_time(tmp_path):
    first = make_record("gate_a", preset="tiny", dtype="float32", device="cpu", weights="w", params={},
                        results={"score": 128, "total": 128, "passed": True})
    second = _bench(tok_s=1.0)
    append(second, root=tmp_path)
    append(first, root=tmp_path)
    assert [r["id"] for r in load(root=tmp_path).records] == [first["id"], second["id"]]
    assert [r["id"] for r in load(kinds=["gate_a"], root=tmp_path).records] == [first["id"]]
    assert load(kinds="nightly", root=tmp_path).records == []
    with pytest.raises(ValueError, match="unknown record kinds"):
        load(kinds=["gate_c"], root=tmp_path)


def test_records_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "elsewhere"))
    assert append(_bench(tok_s=1.0)) == tmp_path / "elsewhere" / "bench.jsonl"
    assert len(load().records) == 1


def _append_many(root: str, worker: int, n: int) -> None:
    for i in range(n):
        append(make_record("bench", preset="tiny", dtype="bfloat16", device="cpu", weights="w",
                           params={"phase": "decode", "context": 128, "run": f"worker{worker}", "batch": i},
                           results={"tok_s": 1.0, "roofline_note": "x" * 300}), root=root)


def test_two_processes_append_whole_lines(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), w, 1000)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    lines = (tmp_path / "bench.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 2001
    got = load(root=tmp_path)
    assert got.problems == []
    assert len({r["id"] for r in got.records}) == 2000
    for w in range(2):  # each writer's records all arrived, in its own order
        mine = [r["params"]["batch"] for r in got.records if r["params"]["run"] == f"worker{w}"]
        assert mine == list(range(1000))


def test_torn_line_is_reported_and_the_rest_survive(tmp_path):
    good = [_bench(tok_s=float(i)) for i in range(3)]
    for r in good[:2]:
        append(r, root=tmp_path)
    path = tmp_path / "bench.jsonl"
    whole = json.dumps(good[2]).encode()
    with open(path, "ab") as f:  # a writer killed half-way through its line
        f.write(whole[: len(whole) // 2])
    got = load(root=tmp_path)
    assert [r["id"] for r in got.records] == [r["id"] for r in good[:2]]
    assert len(got.problems) == 1 and got.problems[0].startswith(f"{path}:3: torn or invalid JSON line")

    after = _bench(tok_s=99.0)
    append(after, root=tmp_path)
    got = load(root=tmp_path)
    assert [r["id"] for r in got.records] == [good[0]["id"], good[1]["id"], after["id"]]
    assert len(got.problems) == 1 and f"{path}:3:" in got.problems[0]


def test_lines_without_required_fields_or_wrong_kind_are_reported(tmp_path):
    append(_bench(tok_s=1.0), root=tmp_path)
    with open(tmp_path / "bench.jsonl", "a") as f:
        f.write(json.dumps({"kind": "bench", "results": {}}) + "\n")
        f.write("[1, 2]\n")
        f.write(json.dumps(make_record("kernel", preset="tiny", dtype="float32", device="cpu", weights="w",
                                       params={}, results={"ours_ms": 1.0})) + "\n")
    got = load(root=tmp_path)
    assert len(got.records) == 1
    assert len(got.problems) == 3
    assert "lacks fields" in got.problems[0] and "schema" in got.problems[0]
    assert "not a record object" in got.problems[1]
    assert "of kind 'kernel' in the 'bench' file" in got.problems[2]


def test_invalid_needs_a_reason():
    with pytest.raises(ValueError, match="INVALID record needs at least one reason"):
        make_record("gate_b", preset="tiny", dtype="float32", device="cpu", weights="w", params={},
                    results={}, verdict="INVALID")
    rec = make_record("gate_b", preset="tiny", dtype="float32", device="cpu", weights="w", params={},
                      results={}, verdict="INVALID", reasons=["golden from another weights fingerprint"])
    assert rec["verdict"] == "INVALID"


@pytest.mark.parametrize("bad, match", [
    (dict(kind="gate_c"), "kind 'gate_c' is unknown"),
    (dict(verdict="PASS"), "verdict 'PASS'"),
    (dict(reasons="one reason"), "reasons must be a list"),
    (dict(results={"x": np.zeros(3)}), r"results\.x is a numpy\.ndarray"),
    (dict(params={"f": object()}), r"params\.f is a builtins\.object"),
    (dict(params={1: 2}), "non-string keys"),
    (dict(dtype=torch.bfloat16), "dtype must be a string"),
])
def test_bad_input_is_refused(bad, match):
    kw = dict(kind="bench", preset="tiny", dtype="bfloat16", device="cpu", weights="w", params={}, results={})
    kw.update(bad)
    kind = kw.pop("kind")
    with pytest.raises((TypeError, ValueError), match=match):
        make_record(kind, **kw)


def test_nonfinite_values_become_null_with_a_reason(tmp_path):
    rec = _bench(tok_s=float("nan"), samples_ms=[1.0, np.float64("inf")])
    assert rec["verdict"] == "INVALID"
    assert rec["results"]["tok_s"] is None and rec["results"]["samples_ms"] == [1.0, None]
    assert rec["reasons"] == ["results.tok_s was nan; stored as null", "results.samples_ms[1] was inf; stored as null"]
    append(rec, root=tmp_path)
    assert load(root=tmp_path).records[0]["reasons"] == rec["reasons"]

    hand_built = dict(_bench(tok_s=1.0), results={"tok_s": float("nan")})
    with pytest.raises(ValueError, match="NaN or inf"):
        append(hand_built, root=tmp_path)
    with pytest.raises(ValueError, match="lacks fields id"):
        append({k: v for k, v in rec.items() if k != "id"}, root=tmp_path)


def test_provenance_on_this_cpu_box():
    prov = provenance()
    assert prov is provenance()  # cached per process
    m = prov["machine"]
    assert m["gpu"] is None and m["driver"] is None
    assert m["torch"] == torch.__version__ and m["cuda"] == torch.version.cuda
    assert m["host"] and m["python"] and m["cpu"]
    commit = prov["git"]["commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit)
    assert prov["git"]["dirty"] in (True, False, None)



# ---- records/import_run.py: records of a run on another box ----------------------------------------

def _head() -> str:
    import subprocess
    from records.store import REPO_ROOT
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_run_appends_what_is_new_attributed_to_the_sent_commit(tmp_path, capsys):
    """Records the box appended (one already here, one torn line) come in once each, with the commit that was sent
    and the box's own git view kept; importing again adds nothing."""
    from records import import_run
    box, here = tmp_path / "box", tmp_path / "here"
    shared, new_a, new_b = _bench(tok_s=1.0), _bench(tok_s=2.0), make_record(
        "kernel", preset=None, dtype="bfloat16", device="H200", weights=None, params={"op": "x"},
        results={"ours_ms": 1.0})
    for r in (shared, new_a, new_b):
        append(r, root=box)
    append(shared, root=here)
    with open(box / "bench.jsonl", "ab") as f:
        f.write(b'{"schema": 1, "id": "torn')
    sha = _head()
    assert import_run.main([str(box), "--commit", sha, "--note", "run 7", "--root", str(here)]) == 0
    out = capsys.readouterr()
    assert "imported 2 record(s), bench 1, kernel 1" in out.out and "torn or invalid JSON line" in out.err
    got = {r["id"]: r for r in load(root=here).records}
    assert set(got) == {shared["id"], new_a["id"], new_b["id"]}
    assert got[shared["id"]]["git"] == shared["git"]  # what was here is untouched
    g = got[new_a["id"]]["git"]
    assert g["commit"] == sha and g["note"] == "run 7" and g["dirty"] is False
    assert g["device_reported"] == {"commit": new_a["git"]["commit"], "dirty": new_a["git"]["dirty"]}
    assert got[new_a["id"]]["results"] == new_a["results"] and got[new_a["id"]]["time"] == new_a["time"]
    assert import_run.main([str(box), "--commit", sha, "--note", "run 7", "--root", str(here)]) == 0
    assert "imported 0 record(s)" in capsys.readouterr().out
    assert len(load(root=here).records) == 3


def test_import_run_writes_nothing_when_one_record_cannot_be_written(tmp_path, capsys):
    """A line of SRC that is no record (a NaN: Python's JSON reads it, the store's validator does not) is skipped
    and reported; a kind whose records file in DEST cannot be written stops the import before the first append,
    all or none, not the records of the other kinds before it."""
    from records import import_run
    box, here = tmp_path / "box", tmp_path / "here"
    good = [_bench(tok_s=1.0), _bench(tok_s=2.0)]
    append(good[0], root=box)
    with open(box / "bench.jsonl", "a") as f:
        f.write(json.dumps(_bench(tok_s=3.0) | {"results": {"tok_s": float("nan")}}) + "\n")
    append(good[1], root=box)
    append(make_record("kernel", preset=None, dtype="bfloat16", device="cuda", weights=None, params={"op": "x"},
                       results={"ours_ms": 1.0}), root=box)
    got = load(root=box)
    assert len(got.records) == 3 and len(got.problems) == 1 and "holds a NaN or inf" in got.problems[0]
    (here / "kernel.jsonl").mkdir(parents=True)            # the kernel records cannot be appended
    assert import_run.main([str(box), "--commit", _head(), "--note", "run 9", "--root", str(here)]) == 2
    err = capsys.readouterr().err
    assert "kernel.jsonl: is not a regular file" in err and len(err.strip().splitlines()) == 1
    assert not (here / "bench.jsonl").exists()
    (here / "kernel.jsonl").rmdir()
    assert import_run.main([str(box), "--commit", _head(), "--note", "run 9", "--root", str(here)]) == 0
    out = capsys.readouterr()
    assert "imported 3 record(s), bench 2, kernel 1; 1 problem(s)" in out.out and "holds a NaN or inf" in out.err


@pytest.mark.parametrize("commit, note, match", [("abc123", "run", "full 40-digit"),
                                                 ("0" * 40, "run", "not in this repository"),
                                                 (None, " ", "--note must say")])
def test_import_run_refuses_a_commit_it_cannot_vouch_for(tmp_path, capsys, commit, note, match):
    from records import import_run
    append(_bench(tok_s=1.0), root=tmp_path / "box")
    code = import_run.main([str(tmp_path / "box"), "--commit", commit or _head(), "--note", note,
                            "--root", str(tmp_path / "here")])
    assert code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "here").exists()


def test_import_run_brings_the_trace_a_record_names(tmp_path, capsys):
    """A decomposition record's trace comes along into the tree above DEST, as a file of ordinary permissions; a
    record naming a trace that did not come back is reported and copies nothing."""
    from records import import_run
    box, here = tmp_path / "box" / "records", tmp_path / "here" / "records"
    (tmp_path / "box" / "reports" / "traces").mkdir(parents=True)
    (tmp_path / "box" / "reports" / "traces" / "t1.json.gz").write_bytes(b"trace one")
    (tmp_path / "box" / "reports" / "traces" / "t1.json.gz").chmod(0o4777)   # an odd mode is not carried over
    for trace in ("reports/traces/t1.json.gz", "reports/traces/missing.json.gz"):
        append(make_record("decomposition", preset=None, dtype=None, device="cuda", weights=None,
                           params={"phase": "prefill", "context": 8192},
                           results={"shares": {"gemm": 1.0}, "trace": trace}), root=box)
    assert import_run.main([str(box), "--commit", _head(), "--note", "run 8", "--root", str(here)]) == 0
    err = capsys.readouterr().err
    copied = tmp_path / "here" / "reports" / "traces" / "t1.json.gz"
    assert copied.read_bytes() == b"trace one" and copied.stat().st_mode & 0o7777 == 0o644 & ~_umask()
    assert "missing.json.gz is not in" in err
    assert len(load(root=here).records) == 2  # the records come in either way


def _umask() -> int:
    import os
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_what_the_suite_writes_into_its_tree_does_not_make_a_record_dirty(tmp_path, monkeypatch):
    """Records, the rendered report and traces are outputs (a nightly writes all three before its last records);
    code, tracked or new, is not."""
    def sh(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    for f in ("records/bench.jsonl", "reports/SUMMARY.md", "reports/figures/a.png", "reports/traces/t.json.gz",
              "reports/render.py", "model/model.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x\n")
    sh("init", "-q")
    sh("add", "-A")
    sh("commit", "-q", "-m", "c")
    monkeypatch.setattr(store, "REPO_ROOT", tmp_path)
    assert store._git_state()["dirty"] is False
    for f in ("records/bench.jsonl", "reports/SUMMARY.md", "reports/figures/a.png"):
        (tmp_path / f).write_text("y\n")
    (tmp_path / "reports/traces/new.json.gz").write_text("t\n")
    (tmp_path / "reports/index.html").write_text("<html>\n")
    assert store._git_state()["dirty"] is False
    (tmp_path / "model/new.py").write_text("z\n")               # a new module: code the commit does not hold
    assert store._git_state()["dirty"] is True
    (tmp_path / "model/new.py").unlink()
    (tmp_path / "reports/render.py").write_text("changed\n")    # code among the outputs' folders
    assert store._git_state()["dirty"] is True

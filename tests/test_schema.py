"""records/schema.py: every record on disk loads under it, the writers' records validate against it, a wrong type or
an undeclared field is refused by name, version 2 is written and version 1 still loads, and the report reads its
fields through the schema's objects."""
import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from records import schema, store
from records.schema import BENCH, GATE_A, KERNEL, RECORD, Field

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "records"


def lines(folder: Path) -> list[bytes]:
    return [raw for p in sorted(folder.glob("*.jsonl")) for raw in p.read_bytes().split(b"\n") if raw.strip()]


# ---- the records on disk ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def on_disk():
    return store.load(root=RECORDS)


def test_every_record_on_disk_loads(on_disk):
    assert on_disk.problems == []
    assert len(on_disk.records) == len(lines(RECORDS)) > 2000
    assert {r["schema"] for r in on_disk.records} <= set(schema.VERSIONS)


def as_version_2(r: dict) -> list[str]:
    """What the version-2 rules say of a record on disk, as if it had been written now."""
    return store.validate_record(dict(r, schema=2))


def test_the_schema_declares_every_field_the_records_on_disk_carry(on_disk):
    """The writers that made them write the same fields today: each one is declared, with the type it has there.
    Only the requirement of a VALID record may fail (decompositions before params.phase was written)."""
    problems = [(r["id"][:8], p) for r in on_disk.records for p in as_version_2(r)]
    assert [p for p in problems if "is VALID without params.phase" not in p[1]] == []


def test_the_declaration_check_catches_a_field_left_out(on_disk, monkeypatch):
    """Negative control: drop one declared field and the records that carry it fail."""
    monkeypatch.delitem(schema.BENCH_RESULTS.fields, "host_launch_us")   # the Obj the bench kind checks with
    bench = [r for r in on_disk.records if r["kind"] == "bench" and "host_launch_us" in r["results"]]
    assert bench and all(any("results.host_launch_us is not a declared field" in p for p in as_version_2(r))
                         for r in bench)


# ---- what the writers write ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One run of each writer into a fresh records folder (their own builders; measurements faked only where a
    kernel benchmark would need a GPU; the detection curve has a test of its own): the records it holds, by kind."""
    from benchmarks import bench_ab, bench_e2e, bench_energy, decompose
    from benchmarks.kernels import common
    from gates.gate_a import run_gate_a
    from gates.gate_b import run_gate_b
    from gates.gate_memory import run_memory_gate
    from gates.memory import MemReading
    from gates.run import limit_cpu_threads, load_subject, resolve
    from model.build import load_model
    from reports import nightly

    root = tmp_path_factory.mktemp("records")
    quiet = lambda *a, **k: None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMI_RECORDS_DIR", str(root))
        mp.setenv("FLA_FLASH_KDA", "0")
        opts = resolve(preset="tiny", device="cpu", dtype="fp32")
        limit_cpu_threads(opts)
        subject = load_subject(opts)
        assert run_gate_a(opts, subject=subject, records_root=root, log=quiet) == 0
        assert run_gate_b(opts, subject=subject, records_root=root, log=quiet) == 0
        short = resolve(preset="tiny", device="cpu", dtype="fp32", new_tokens=2)
        assert run_memory_gate(short, records_root=root, log=quiet) == 0      # no device: skipped
        free = MemReading(total=64 << 30, free=60 << 30, source="simulated")
        run_memory_gate(short, reader=lambda: free, records_root=root, log=quiet)   # ran, audited

        s = bench_e2e.Settings(**dict(bench_e2e.QUICK, contexts=(16,), prefill=(16,), recompute_steps=0))
        bench_e2e.Bench(s, load_model("tiny"), bench_e2e.Plan(s)).run()
        decompose.main(["--quick", "--trace-dir", str(tmp_path_factory.mktemp("traces"))])

        ours = bench_energy.summarize_side({"calls": 30, "seconds": 4.0, "joules": 2800.0}, 8192)
        peer = bench_energy.summarize_side({"calls": 13, "seconds": 4.1, "joules": 2255.0}, 8192)
        desc = {"preset": "tiny", "model_dtype": "float32", "weights": "w"}
        bench_energy.energy_record(desc, 8192, 0, ours, peer, {"ours": 90.0, "peer": 91.0}, "cpu")
        logits = torch.linspace(-1, 1, 32)
        bench_ab.ab_records(desc, 16, [("a", "kda_chunk", {"scan_warps": 2})],
                            {"defaults": {"samples": [2.0, 2.1], "logits": logits, "host_ms": [1.0, 1.1]},
                             "a": {"samples": [1.9, 2.0], "logits": logits, "host_ms": [1.0, 1.0]}}, "cpu")
        x = torch.ones(4)
        common.sweep("chunk_kda", [{"BV": 32}], {"BV": 64}, lambda cfg: [x], lambda cfg: {"ours_ms": 1.0,
                     "timing": "do_bench"}, 1e-3, {"op": "chunk_kda", "B": 1, "T": 64, "H": 32, "d": 128,
                                                   "dtype": "bfloat16"}, "cpu")

        gate_a = store.load("gate_a", root=root).records[0]
        step = nightly.Step("noop", [sys.executable, "-c", "pass"])
        nightly.main(["--records", str(root), "--out", str(tmp_path_factory.mktemp("out")), "--logs",
                      str(tmp_path_factory.mktemp("logs"))], steps=[step])
        store.append(store.make_record("erratum", preset=None, dtype=None, device=None, weights=None,
                                       params={"record": gate_a["id"], "fields": ["results.timings.load_s"]},
                                       results={"reason": "timed with the cache cold"}), root=root)
        from gates import margins
        from gates.golden import GOLDEN_DIR
        from model import train
        margins.record_goldens([GOLDEN_DIR / "tiny-fp64-cpu-hf.json"], root=root, log=quiet)
        prov = {"weights": "w", "corpus": {"sha256": "sha256:0", "python": "3.12", "train": {"files": 1, "bytes": 9}},
                "training": {"steps": 1, "device": "cpu", "precision": "fp32", "batch": 1, "seq_len": 8},
                "results": {"heldout_loss": 1.0, "heldout_bits_per_byte": 0.5,
                            "expert_load": [{"max": 1.1, "unused": 0}]}}
        curve = [{"step": 0, "heldout_loss": 1.1, "heldout_bpb": 0.6}, {"step": 1, "loss": 2.0},
                 {"step": 1, "heldout_loss": 1.0, "heldout_bpb": 0.5}]
        store.append(train.train_record(prov, curve, root / "ckpt", source="the training run"), root=root)
    loaded = store.load(root=root)
    assert loaded.problems == []
    by_kind: dict[str, list[dict]] = {}
    for r in loaded.records:
        by_kind.setdefault(r["kind"], []).append(r)
    return by_kind


def test_each_writer_writes_records_of_version_2_that_validate(written):
    assert set(written) == set(schema.KINDS) - {"detection", "routing_noise"}  # each has a test of its own
    for kind, recs in written.items():
        for r in recs:
            assert r["schema"] == schema.VERSION == 2 and store.validate_record(r) == [], (kind, r["id"])
    assert {r["results"]["decision"] for r in written["memory"]} == {"skipped", "ran"}
    assert any(r["results"].get("peer_samples_ms") for r in written["bench"])   # a peer was measured beside ours
    assert {r["params"]["op"] for r in written["kernel"]} == {"prefill_energy", "prefill_ab", "chunk_kda"}


def test_the_detection_curve_writes_records_that_validate(written, tmp_path, monkeypatch):
    """benchmarks/detection.py builds its record in main(): run it, each of its Gate A runs replayed from the gate
    writer's own record (a run of the real gate is what `written` made)."""
    from benchmarks import detection
    gate_a = written["gate_a"][0]

    def replay_gate_a(opts, subject, records_root, log):
        store.append(dict(copy.deepcopy(gate_a), id="d" * 32), root=records_root)
        log(f"Gate A PASS {gate_a['results']['score']}/{gate_a['results']['total']} [1.0 s]")
        return 0
    monkeypatch.setattr(detection, "run_gate_a", replay_gate_a)
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    assert detection.main(["--clean", "1", "--sites", next(iter(detection.SITES)), "--rels", "0.1"]) == 0
    got = store.load("detection", root=tmp_path)
    assert got.problems == [] and len(got.records) == 2
    assert all(r["schema"] == 2 and r["results"]["bound"] > 0 for r in got.records)


def test_the_line_on_disk_says_version_2(tmp_path):
    rec = store.make_record("bench", preset="tiny", dtype="float32", device="cpu", weights="w",
                            params={"phase": "decode", "context": 16}, results={"tok_s": 1.0})
    store.append(rec, root=tmp_path)
    assert (tmp_path / "bench.jsonl").read_bytes().startswith(b'{"schema":2,')


# ---- refused, by name ---------------------------------------------------------------------------------

def bench(**changes) -> dict:
    rec = store.make_record("bench", preset="tiny", dtype="float32", device="cpu", weights="w",
                            params={"phase": "decode", "context": 16, "batch": 1, "impl": "ours-eager", "peer": None,
                                    "run": "r"},
                            results={"tok_s": 100.0, "samples_ms": [10.0, 10.5], "spot_check": {"agree": 4}})
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = rec
        for p in parents:
            node = node[p]
        node[leaf] = value
    return rec


@pytest.mark.parametrize("changes, message", [
    (dict(results__tok_s="fast"), "bench results.tok_s must be a finite number, got string 'fast'"),
    (dict(params__context=16.0), "bench params.context must be an integer, got number 16.0"),
    (dict(params__batch=True), "bench params.batch must be an integer, got boolean True"),
    (dict(results__spot_check__agree="4"), "bench results.spot_check.agree must be an integer, got string '4'"),
    (dict(results__samples_ms=[1.0, "x"]), "bench results.samples_ms[1] must be a finite number or null, got string"),
    (dict(machine__gpu=5), "bench machine.gpu must be a string, got number 5"),
    (dict(results__tok_ss=100.0),
     "bench results.tok_ss is not a declared field (expected a field that records/schema.py declares in results "
     "(did you mean results.tok_s?)), got number 100.0"),
    (dict(params__worker=1), "bench params.worker is not a declared field"),
    (dict(results__spot_check__agreed=4), "bench results.spot_check.agreed is not a declared field"),
    (dict(git__branch="main"), "bench git.branch is not a declared field"),
    (dict(results__tok_s=None), "bench record is VALID without results.tok_s"),
])
def test_a_wrong_type_or_an_undeclared_field_is_refused_naming_kind_field_expected_and_got(tmp_path, changes,
                                                                                         message):
    good = bench()
    store.append(good, root=tmp_path)                       # the control: the same record, unchanged, is written
    with pytest.raises(store.RecordError, match=re.escape(message)):
        store.append(bench(**changes), root=tmp_path)
    assert [r["id"] for r in store.load(root=tmp_path).records] == [good["id"]]


def test_null_stands_for_missing_where_a_field_is_declared_not_in_an_array_of_objects(tmp_path):
    ok = bench(results__roofline_fraction=None, results__samples_ms=[1.0, None])   # make_record's null for a NaN
    store.append(dict(ok, verdict="INVALID", reasons=["results.samples_ms[1] was nan; stored as null"]),
                 root=tmp_path)
    gate = store.make_record("gate_a", preset="tiny", dtype="float32", device="cpu", weights="w", params={},
                             results={"score": 1, "total": 1, "passed": True, "diagnoses": [None]})
    with pytest.raises(store.RecordError, match=r"gate_a results\.diagnoses\[0\] must be an object, got null"):
        store.append(gate, root=tmp_path)


def test_an_invalid_record_may_lack_what_a_valid_one_carries(tmp_path):
    rec = store.make_record("decomposition", preset="tiny", dtype="float32", device="cpu", weights="w",
                            params={"phase": "decode", "mode": "graph"}, results={}, verdict="INVALID",
                            reasons=["graph mode could not be traced"])
    store.append(rec, root=tmp_path)
    with pytest.raises(store.RecordError, match="decomposition record is VALID without params.context, "
                                                "results.shares"):
        store.append(dict(rec, verdict="VALID", reasons=[]), root=tmp_path)


def test_load_lists_a_version_2_line_with_an_undeclared_field_and_keeps_the_rest(tmp_path):
    good = bench()
    store.append(good, root=tmp_path)
    with open(tmp_path / "bench.jsonl", "a") as f:
        f.write(json.dumps(bench(results__tok_ss=1.0)) + "\n")
    got = store.load(root=tmp_path)
    assert [r["id"] for r in got.records] == [good["id"]]
    assert len(got.problems) == 1 and "bench.jsonl:2: bench results.tok_ss is not a declared field" in got.problems[0]


# ---- version 1 ------------------------------------------------------------------------------------------

def test_a_version_1_record_loads_under_the_rules_it_was_written_under(tmp_path):
    """A line of records/bench.jsonl, and a version-1 record with fields version 2 does not declare: both load, as
    version-1 records always did; the second, claiming version 2, is refused (the control)."""
    first = json.loads(lines(RECORDS)[0])
    assert first["schema"] == 1
    v1 = dict(bench(params__worker=1, results__tok_ss="fast"), schema=1)
    for rec in (first, v1):
        store.append(rec, root=tmp_path / first["kind"] if rec is first else tmp_path / "v1")
    assert store.load(root=tmp_path / first["kind"]).records == [first]
    assert store.load(root=tmp_path / "v1").records == [v1]
    assert store.validate_record(dict(v1, schema=2)) != []
    assert store.validate_record(dict(v1, schema=1, results={"tok_s": "fast"})) == [
        "results.tok_s must be a finite number, got string 'fast'"]      # what version 1 checked, it still checks
    assert "schema must be one of 1, 2, got number 3" in store.validate_record(dict(v1, schema=3))


# ---- reading fields through the schema --------------------------------------------------------------------

def test_fields_read_as_store_get_does(on_disk):
    """Every field the report read under version 1, read through the schema's objects, equals the store's dotted
    read, on every record on disk."""
    paths = sorted({p for p, _ in schema.V1_SHAPES if "[]" not in p and ".*" not in p})
    for path in paths:
        section, *rest = path.split(".")
        for r in on_disk.records:
            k = RECORD if section in ("git", "machine") else schema.KINDS[r["kind"]]
            f = getattr(k, section)
            try:
                for part in rest:
                    f = getattr(f, part)
            except AttributeError:
                assert store.get(r, path) is None, (path, r["kind"])   # a field this kind does not carry
                continue
            assert f.path == path and f.get(r) == store.get(r, path), (path, r["id"])


def test_field_objects_name_their_path_and_refuse_a_typo():
    assert BENCH.results.tok_s.path == "results.tok_s" and str(BENCH.results.clocks.sm_mhz_mean) == \
        "results.clocks.sm_mhz_mean"
    assert GATE_A.results.diagnoses.each.ref_margin.nats.path == "ref_margin.nats"
    assert KERNEL.params.field("T").get({"params": {"T": 8192}}) == 8192
    assert BENCH.results.peer.get({"results": {"peer": None}}, "peer") == "peer"
    with pytest.raises(KeyError):
        BENCH.params.batch.lookup({"params": {}})
    assert BENCH.params.peer.lookup({"params": {"peer": None}}) is None
    with pytest.raises(AttributeError, match=r"bench results declares no field 'tok_ss'"):
        BENCH.results.tok_ss
    with pytest.raises(AttributeError, match=r"results.diagnoses is an array: read its elements through .each"):
        GATE_A.results.diagnoses.eps
    with pytest.raises(TypeError, match=r"results.get"):   # a field no Field could reach as an attribute
        schema.kind("x", schema.obj(), schema.obj(get=schema.TEXT))


def test_the_report_reads_no_field_through_a_string_path():
    """reports/*.py name record fields through records.schema, never as "results.tok_s" strings passed to a getter;
    the control: the check finds the old form."""
    old = re.compile(r"""\bget\(\w+, *f?["'](?:git|machine|params|results)\.|\.get\(["'](?:results|params)["']\)""")
    assert old.search('x = get(r, "results.tok_s")') and old.search("(r.get('results') or {}).get('clocks')")
    for path in sorted((ROOT / "reports").glob("*.py")):
        src = path.read_text()
        assert not old.search(src), (path.name, old.search(src).group())
        assert "from records.store import get" not in src, path.name
    assert isinstance(schema.DIAGNOSIS, Field)

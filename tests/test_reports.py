"""reports/render.py on the fixture history (tests/fixtures/records, written by tests/fixtures/make_history.py)."""
import copy
import json
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest

from records.store import RecordError as StoreRecordError
from records.store import append, load, make_record
from reports import render

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = FIXTURES / "records"
PLOTS = {"speed_decode", "speed_prefill", "history_decode", "history_prefill", "gates", "decomposition", "kernels",
         "memory"}
CHROMIUM = shutil.which("chromium")  # Debian/Ubuntu package `chromium`


def is_blank(png: Path, threshold: float = 1e-3) -> bool:
    """A PNG whose pixel values barely vary (one flat colour) shows nothing."""
    return float(np.var(matplotlib.image.imread(png)[..., :3])) < threshold


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    sections = render.render(RECORDS, out)
    return out, sections, (out / "index.html").read_text(), (out / "SUMMARY.md").read_text()


@pytest.fixture(scope="module")
def fixture_records():
    return {r["id"]: r for r in load(root=RECORDS).records}


def short(r):
    return r["id"][:8]


def the(records, pred):
    found = [r for r in records.values() if pred(r)]
    assert len(found) == 1, f"expected one fixture record, found {len(found)}"
    return found[0]


def test_fixture_files_are_what_make_history_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_history", FIXTURES / "make_history.py")
    make_history = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_history)
    make_history.main(tmp_path)
    committed = sorted(p.name for p in RECORDS.glob("*.jsonl"))
    assert committed == sorted(p.name for p in tmp_path.glob("*.jsonl"))
    for name in committed:
        assert (tmp_path / name).read_bytes() == (RECORDS / name).read_bytes(), f"{name}: rerun make_history.py"


def test_html_names_every_plot_and_every_plot_shows_something(report):
    out, _, page, _ = report
    files = {p.stem for p in (out / "figures").glob("*.png")}
    assert files == PLOTS
    for name in PLOTS:
        assert f"src='figures/{name}.png'" in page
        assert not is_blank(out / "figures" / f"{name}.png"), name


def test_blank_check_catches_a_blank_png(tmp_path):
    matplotlib.image.imsave(tmp_path / "blank.png", np.ones((50, 80, 3)))
    assert is_blank(tmp_path / "blank.png")


def test_every_figure_and_table_cites_records_with_machine_and_commit(report):
    _, sections, _, _ = report
    cited = [b.source for s in sections for b in s.blocks if isinstance(b, (render.Figure, render.Table)) and b.source]
    assert len(cited) >= 10
    for source in cited:
        assert re.search(r"records [0-9a-f]{8}.*\(NVIDIA H200 @ h200-a, commit [0-9a-f]{7}\)", source), source


def test_summary_cites_the_planted_findings(report, fixture_records):
    _, _, _, summary = report
    slow = max((r for r in fixture_records.values() if r["kind"] == "bench" and r["params"]["context"] == 8192
                and r["params"]["phase"] == "decode"), key=lambda r: r["time"])
    assert re.search(rf"\| {short(slow)} \|[^\n]*\| REGRESSION \|", summary)
    failed = the(fixture_records, lambda r: r["kind"] == "gate_b" and not r["results"]["passed"])
    assert re.search(rf"\| {short(failed)} \| gate\\_b \|[^\n]*\| 7 \| 11 \|[^\n]*near-tie", summary)  # `_` escaped
    assert f"| {short(failed)} | " in summary and "127/128 | FAIL" in summary
    for kind in ("decomposition", "kernel", "memory"):
        for r in (r for r in fixture_records.values() if r["kind"] == kind):
            assert short(r) in summary, (kind, short(r))
    for r in (r for r in fixture_records.values() if r["kind"] == "memory"):
        assert re.search(rf"\| {short(r)} \|[^\n]*\| {r['results']['decision']} \|", summary)


def test_invalid_records_are_listed_and_kept_out_of_speed_plots(report, fixture_records):
    _, sections, page, _ = report
    bad = the(fixture_records, lambda r: r["verdict"] == "INVALID")
    invalid = next(s for s in sections if s.title == "INVALID records")
    table = next(b for b in invalid.blocks if isinstance(b, render.Table))
    assert [short(bad), "bench"] == table.rows[0][:2] and "throttled" in table.rows[0][-1]
    for s in sections:
        if s.title != "INVALID records":
            for b in s.blocks:
                if isinstance(b, (render.Figure, render.Table)):
                    assert short(bad) not in b.source, s.title
    assert "throttled" in page


def test_speed_table_shows_the_host_probe_where_a_record_has_it(tmp_path):
    """A launch-bound peer moves with the host; the speed table shows each run's host probes (`host_launch_us`, and
    `host_kernel_launch_us` where the record has it), and a dash for records made before they were measured."""
    records = tmp_path / "records"
    records.mkdir()
    shutil.copy(RECORDS / "bench.jsonl", records)
    ours = [r for r in load(root=records).records if r["kind"] == "bench" and r["verdict"] == "VALID"]
    probed = copy.deepcopy(max(ours, key=lambda r: r["time"]))
    probed["results"]["host_launch_us"] = 12.345
    probed["results"]["host_kernel_launch_us"] = 80.0
    probed = make_record("bench", preset=probed["preset"], dtype=probed["dtype"], device=probed["device"],
                         weights=probed["weights"], params=probed["params"], results=probed["results"],
                         verdict="VALID", reasons=[])
    append(probed, root=records)
    speed = next(s for s in render.render(records, tmp_path / "out") if s.title == "Speed against context length")
    rows = [row for b in speed.blocks if isinstance(b, render.Table) for row in b.rows]
    col = next(b for b in speed.blocks if isinstance(b, render.Table)).header.index(
        "host us / eager launch (/ one of our kernels)")
    mine = [row for row in rows if short(probed) in row]
    assert len(mine) == 1 and mine[0][col] == "12.35 / 80.00"
    assert all(row[col] == "—" for row in rows if row not in mine)


def test_host_probe_cell_adds_our_kernels_probe_only_where_recorded():
    assert render.host_probe_text({"results": {"host_launch_us": 7.531, "host_kernel_launch_us": 36.68}}) == \
        "7.53 / 36.68"
    assert render.host_probe_text({"results": {"host_launch_us": 9.37}}) == "9.37"   # records before the probe
    assert render.host_probe_text({"results": {}}) == "—"


def test_speed_table_shows_the_peers_spot_check(tmp_path):
    """Each peer's cell carries its spot check: the first greedy tokens agreeing with ours, and where they part the
    verdict at the first divergence (a near-tie reads differently from a real disagreement)."""
    records = tmp_path / "records"
    records.mkdir()
    shutil.copy(RECORDS / "bench.jsonl", records)
    peers = [r for r in load(root=records).records if r["kind"] == "bench" and r["verdict"] == "VALID"
             and (r["results"] or {}).get("peer_tok_s")]
    rec = copy.deepcopy(max(peers, key=lambda r: r["time"]))
    rec["results"]["spot_check"] = {"agree": 3, "total": 8, "prompt_len": 32, "verdict": "near-tie",
                                    "first_divergence": 3, "explanation": "..."}
    rec = make_record("bench", preset=rec["preset"], dtype=rec["dtype"], device=rec["device"],
                      weights=rec["weights"], params=rec["params"], results=rec["results"], verdict="VALID",
                      reasons=[])
    append(rec, root=records)
    speed = next(s for s in render.render(records, tmp_path / "out") if s.title == "Speed against context length")
    cells = [c for b in speed.blocks if isinstance(b, render.Table) for row in b.rows for c in row
             if f"({short(rec)}" in c]
    assert len(cells) == 1 and f"({short(rec)}; 3/8, near-tie at step 3)" in cells[0]
    assert render.spot_text({"results": {"spot_check": {"agree": 8, "total": 8, "verdict": "match"}}}) == "; 8/8"
    assert render.spot_text({"results": {"spot_check": {"error": "ours: OOM"}}}) == ""


def test_torn_line_is_shown_at_the_top(report):
    _, sections, page, summary = report
    assert sections[0].title == "Unreadable record lines"
    problems = next(b for b in sections[0].blocks if isinstance(b, render.Table)).rows
    assert len(problems) == 1 and "bench.jsonl" in problems[0][0] and "torn" in problems[0][0]
    assert page.index("torn or invalid JSON line") < page.index("Speed against context length")
    assert summary.index("torn or invalid JSON line") < summary.index("Speed against context length")


def test_torn_line_is_said_on_stderr_too(tmp_path, capsys):
    render.main(["--records", str(RECORDS), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "warning: 1 record line(s) could not be read" in err and "bench.jsonl" in err and "torn" in err


def test_seed_bar_is_labelled_and_cites_the_seed_document(report):
    _, sections, page, _ = report
    decomp = next(s for s in sections if s.title == "Decode time decomposition")
    fig = next(b for b in decomp.blocks if isinstance(b, render.Figure))
    assert render.SEED_CITATION in fig.source and "seed/000_49c5fcef6bd17615" in fig.source
    assert render.SEED_LABEL == "seed (GB10, published)" and render.SEED_LABEL in page
    assert sum(render.SEED_SHARES.values()) == pytest.approx(1.0)


def test_empty_records_say_so(tmp_path):
    out = tmp_path / "out"
    render.render(tmp_path / "no-records", out)
    summary = (out / "SUMMARY.md").read_text()
    assert summary.count(render.NO_RECORDS) >= 7
    assert not list((out / "figures").glob("*.png"))
    assert "<h2>Gates</h2>" in (out / "index.html").read_text()


def test_a_section_that_loses_its_records_drops_its_stale_figure(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    shutil.copy(RECORDS / "kernel.jsonl", records)
    render.render(records, tmp_path / "out")
    assert {p.stem for p in (tmp_path / "out" / "figures").glob("*.png")} == {"kernels"}
    (records / "kernel.jsonl").unlink()
    shutil.copy(RECORDS / "memory.jsonl", records)
    render.render(records, tmp_path / "out")
    assert {p.stem for p in (tmp_path / "out" / "figures").glob("*.png")} == {"memory"}


def test_records_missing_fields_are_named_not_drawn(tmp_path):
    """A VALID record of schema 1 could lack what the report draws (schema 2 refuses one): it is named, not drawn."""
    good = make_record("bench", preset="tiny", dtype="float32", device="cpu", weights="w",
                       params={"phase": "decode", "context": 128}, results={"tok_s": 50.0})
    lacking = make_record("bench", preset="tiny", dtype="float32", device="cpu", weights="w",
                          params={"phase": "decode"}, results={"tok_s": 50.0})
    no_total = make_record("gate_a", preset="tiny", dtype="float32", device="cpu", weights="w", params={},
                           results={"score": 3, "passed": False})
    for r in (lacking, no_total):
        with pytest.raises(StoreRecordError, match="is VALID without"):
            append(r, root=tmp_path / "records")
    lacking, no_total = dict(lacking, schema=1), dict(no_total, schema=1)
    for r in (good, lacking, no_total):
        append(r, root=tmp_path / "records")
    sections = {s.title: s for s in render.render(tmp_path / "records", tmp_path / "out")}
    speed_notes = [b for b in sections["Speed against context length"].blocks if isinstance(b, str)]
    assert any(short(lacking) in n and "params.context" in n for n in speed_notes), speed_notes
    gate_blocks = sections["Gates"].blocks
    assert short(no_total) in gate_blocks[0] and render.NO_RECORDS in gate_blocks
    assert (tmp_path / "out" / "figures" / "speed_decode.png").exists()


def test_cli(tmp_path):
    render.main(["--records", str(RECORDS), "--out", str(tmp_path)])
    assert (tmp_path / "index.html").exists() and (tmp_path / "SUMMARY.md").exists()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_page_shows_in_headless_chromium(report, tmp_path):
    out, _, _, _ = report
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,2000",
                    (out / "index.html").as_uri()], check=True, capture_output=True, timeout=120)
    assert not is_blank(shot)
    # The first figure is inside the first 2000 px: the images loaded, not just the text.
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1280)
    ours = np.array(matplotlib.colors.to_rgb(render.OURS_COLOR))
    assert np.any(np.all(np.abs(pixels - ours) < 0.02, axis=-1)), "no 'ours' plot line in the screenshot"


def bench_with_erratum(root, phase, context, results, fields, reason):
    """An ours-vs-hf bench record and a later erratum naming `fields` of it, appended under root."""
    from records import store
    rec = store.make_record("bench", preset="p", dtype="bfloat16", device="cuda", weights="w",
                            params={"phase": phase, "context": context, "batch": 1, "impl": "ours", "peer": "hf"},
                            results={"peer": "hf", **results})
    store.append(rec, root=root)
    store.append(store.make_record("erratum", preset="p", dtype="bfloat16", device="cuda", weights="w",
                                   params={"record": rec["id"], "fields": fields}, results={"reason": reason}),
                 root=root)


def test_an_erratum_removes_the_named_fields_from_the_report(tmp_path):
    """Records are append-only: a later erratum voids fields of an earlier record, and the report honours it."""
    root = tmp_path / "rec"
    bench_with_erratum(root, "prefill", 8192, {"tok_s": 27000.0, "peer_tok_s": 1513.0}, ["results.peer_tok_s"],
                       "peer timing included autotuning")
    render.render(records_root=root, out=tmp_path / "out")
    summary = (tmp_path / "out" / "SUMMARY.md").read_text()
    assert "1,513" not in summary and "peer timing included autotuning" in summary
    assert "27,000" in summary


def test_an_erratum_can_void_a_verdict_and_a_failed_render_keeps_the_last_report(tmp_path):
    """An erratum naming `verdict` (a harness bug voided a good run, or passed a bad one) leaves the record out
    of every summary as VOIDED with the erratum's reason; the render does not crash on it. A render that fails
    on its records leaves the previous report's figures in place."""
    root = tmp_path / "rec"
    bench_with_erratum(root, "decode", 1024, {"tok_s": 4321.5, "peer_tok_s": 4.0}, ["verdict", "reasons"],
                       "compared against a state the timing had changed")
    out = tmp_path / "out"
    render.render(records_root=root, out=out)
    summary = (out / "SUMMARY.md").read_text()
    assert "compared against a state the timing had changed" in summary
    assert "4,321" not in summary and "4321" not in summary      # in no speed table or plot
    (out / "figures").mkdir(exist_ok=True)
    figure = out / "figures" / "kept.png"
    figure.write_bytes(b"png")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(render, "build", lambda loaded, out: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            render.render(records_root=root, out=out)
    assert figure.exists()
    render.render(records_root=root, out=out)
    assert not figure.exists()  # a figure no section draws is removed once a render succeeds


def test_kernel_sweep_records_are_counted_not_drawn(tmp_path):
    """A launch-config sweep writes a record per config; the kernel section draws the default-config records
    only (a sweep of hundreds made a 14,600-pixel-tall figure) and says how many sweep records it left out."""
    from records import store
    root = tmp_path / "rec"
    base = dict(op="moe_decode", kernel="moe_gate_up", N=1)
    store.append(store.make_record("kernel", preset=None, dtype="bfloat16", device="cuda", weights=None,
                                   params=base, results={"ours_ms": 0.0245, "peer_ms": 0.1167, "peer": "torch"}),
                 root=root)
    for bi in (4, 8, 16):
        store.append(store.make_record("kernel", preset=None, dtype="bfloat16", device="cuda", weights=None,
                                       params={**base, "sweep": True, "cfg": {"BLOCK_I": bi}},
                                       results={"ours_ms": 0.03 + bi / 1000, "peer_ms": 0.1167, "peer": "torch"}),
                     root=root)
    sections = render.render(records_root=root, out=tmp_path / "out")
    kern = next(s for s in sections if s.title.startswith("Kernel timings"))
    table = next(b for b in kern.blocks if isinstance(b, render.Table))
    assert len(table.rows) == 1 and "sweep" not in table.rows[0][0]
    assert table.rows[0][0].startswith("moe_decode moe_gate_up")  # the MoE part stays in the label
    assert any(isinstance(b, str) and b.startswith("3 launch-config sweep record(s)") for b in kern.blocks)


def test_kernel_table_shows_graph_timings_and_the_config(tmp_path):
    """Where a record holds both sides timed in CUDA graphs, or by the profiler's kernel time, the table shows them
    and their ratio (here the opposite verdict from do_bench's), with the launch config the record ran; an older
    record shows dashes."""
    from records import store
    root = tmp_path / "rec"
    store.append(store.make_record("kernel", preset=None, dtype="bfloat16", device="cuda", weights=None,
                                   params=dict(op="kda_decode_step", B=1, cfg={"BV": 32, "grid": "strided"}),
                                   results={"ours_ms": 0.032, "peer_ms": 0.078, "peer": "fla-0.6.0",
                                            "ours_graph_ms": 0.0077, "peer_graph_ms": 0.0053,
                                            "ours_kernel_ms": 0.005, "peer_kernel_ms": 0.004}), root=root)
    store.append(store.make_record("kernel", preset=None, dtype="bfloat16", device="cuda", weights=None,
                                   params=dict(op="chunk_kda", T=8192),
                                   results={"ours_ms": 1.445, "peer_ms": 1.347, "peer": "fla-0.6.0"}), root=root)
    sections = render.render(records_root=root, out=tmp_path / "out")
    kern = next(s for s in sections if s.title.startswith("Kernel timings"))
    table = next(b for b in kern.blocks if isinstance(b, render.Table))
    rows = {row[0].split()[0]: row for row in table.rows}
    graph = table.header.index("CUDA graph: ours / peer ms (speedup)")
    assert rows["kda_decode_step"][graph] == "0.0077 / 0.0053 (0.69)"
    kernels = table.header.index("kernels (profiler): ours / peer ms (speedup)")
    assert rows["kda_decode_step"][kernels] == "0.005 / 0.004 (0.80)" and rows["chunk_kda"][kernels] == "—"
    assert rows["kda_decode_step"][table.header.index("config")] == "BV=32 grid=strided"
    assert rows["kda_decode_step"][table.header.index("speedup")] == "2.44"
    assert rows["chunk_kda"][graph] == "—" and rows["chunk_kda"][table.header.index("config")] == "—"


def test_superseded_kernel_variants_are_named_not_drawn(tmp_path):
    """An experiment variant (a parameter key later runs of the op no longer carry) leaves the figure and table
    with a note naming it; another shape of the same op, and an op measured once, stay."""
    import time
    from records import store
    root = tmp_path / "rec"

    def add(params, ms, commit):
        r = store.make_record("kernel", preset=None, dtype="bfloat16", device="cuda", weights=None, params=params,
                              results={"ours_ms": ms, "peer_ms": 1.3, "peer": "fla-0.6.0"})
        r["git"] = {"commit": commit, "dirty": False}
        store.append(r, root=root)
        time.sleep(0.01)  # records order by time

    add(dict(op="chunk_kda", T=8192, prep="level"), 2.0, "a" * 40)  # one experiment run: both variants go
    add(dict(op="chunk_kda", T=8192, prep="blocked"), 2.8, "a" * 40)
    add(dict(op="moe_prefill", T=8192), 3.3, "a" * 40)
    add(dict(op="chunk_kda", T=1024), 0.2, "b" * 40)  # the newest run of chunk_kda: keys B, T only
    add(dict(op="chunk_kda", T=8192), 1.19, "b" * 40)
    sections = render.render(records_root=root, out=tmp_path / "out")
    kern = next(s for s in sections if s.title.startswith("Kernel timings"))
    table = next(b for b in kern.blocks if isinstance(b, render.Table))
    labels = [row[0] for row in table.rows]
    assert labels == ["chunk_kda T=1024 bfloat16", "chunk_kda T=8192 bfloat16", "moe_prefill T=8192 bfloat16"]
    note = next(b for b in kern.blocks if isinstance(b, str) and "superseded" in b)
    assert note.startswith("2 kernel variant(s)") and "prep=blocked" in note and "prep=level" in note


def test_noise_floor_cell_reads_gate_a_control():
    from reports.render import noise_cell
    r = {"results": {"per_prompt": [
        {"prompt": 0, "verdict": "real", "noise": {"control": "recompute[torch kernels]", "control_first_divergence": 2,
                                                   "test_noise": 1.5, "control_noise": 2.0, "within_noise": True}},
        {"prompt": 1, "verdict": "real", "noise": {"control": "recompute[torch kernels]", "control_first_divergence": None,
                                                   "test_noise": 3.0, "control_noise": 0.01, "within_noise": False}},
        {"prompt": 2, "verdict": "real"}]}}
    assert noise_cell(r, 0).startswith("within (recompute[torch kernels] diverged at step 2")
    assert noise_cell(r, 1).startswith("BEYOND (recompute[torch kernels] never diverged")
    assert noise_cell(r, 2) == noise_cell(r, 7) == "—"


def test_gate_rows_say_the_precision_including_held_apart_experts():
    mixed = make_record("gate_a", preset="48b-a3b", dtype="float32", device="cuda", weights="w",
                        params={"expert_dtype": "bf16"}, results={"score": 128, "total": 128, "passed": True})
    plain = make_record("gate_b", preset="tiny", dtype="float32", device="cpu", weights="w",
                        params={"expert_dtype": None}, results={"score": 1, "total": 128, "passed": False})
    assert render.gate_conditions(mixed) == "48b-a3b float32, experts bf16"
    assert render.gate_conditions(plain) == "tiny float32"


def test_gate_rows_say_what_each_gate_was_judged_against():
    """Gate B's row names its golden (a self-made one is a regression check, HF's the independent oracle)."""
    common = dict(preset="48b-a3b", dtype="float32", device="cuda", weights="w")
    a = make_record("gate_a", params={}, results={"score": 128, "total": 128, "passed": True}, **common)
    self_b = make_record("gate_b", params={"golden_implementation": "self-recompute", "golden_dtype": "fp32",
                                           "golden_device": "cuda"},
                         results={"score": 128, "total": 128, "passed": True}, **common)
    old_b = make_record("gate_b", params={}, results={"score": 17, "total": 128, "passed": False}, **common)
    assert render.gate_reference(a) == "recompute path"
    assert render.gate_reference(self_b) == "golden: self-recompute fp32 cuda"
    assert render.gate_reference(old_b) == "golden (not recorded)"


def test_decomposition_table_shows_exclusive_shares_where_the_record_has_them(fixture_records, tmp_path):
    decomp = the(fixture_records, lambda r: r["kind"] == "decomposition")
    plain = render.decomposition_section([decomp], tmp_path)
    table = next(b for b in plain.blocks if isinstance(b, render.Table))
    assert table.header == ["category", "ours", render.SEED_LABEL]
    excl = dict.fromkeys(decomp["results"]["shares"], 0.0) | {"gemm": 0.625, "kda": 0.375}
    with_excl = copy.deepcopy(decomp)
    with_excl["results"]["exclusive_shares"] = excl
    table = next(b for b in render.decomposition_section([with_excl], tmp_path).blocks if isinstance(b, render.Table))
    assert table.header[-1] == "ours, exclusive time"
    rows = {r[0]: r for r in table.rows}
    assert rows["gemm"][-1] == "62.5%" and rows["kda"][-1] == "37.5%" and rows["ms per step"][-1] == "—"


def test_clock_text_says_how_far_under_its_maximum_the_gpu_ran():
    from reports.render import clock_text
    c = {"sm_mhz_mean": 1703.4, "sm_mhz_max": 1980.0, "power_cap_share": 1.0}
    assert clock_text(c) == "1,703 of 1,980 MHz; cap 100%"
    assert clock_text({"sm_mhz_mean": 1500.0, "power_cap_share": 0.25}) == "1,500 MHz; cap 25%"
    assert clock_text(None) == clock_text({}) == "—"  # records from before the clocks were sampled


def test_paced_text_says_how_many_timed_calls_the_host_paced():
    from reports.render import peer_clock
    from reports.regress import pacing_note as paced_text
    r = {"results": {"host_ms": [40.0, 72.6, 76.5], "host_paced": 2, "peer_host_ms": [30.0], "peer_host_paced": 0}}
    assert paced_text(r) == "; host-paced 2/3"
    assert peer_clock(r) == "; host-paced 0/1"          # no peer clocks in this record, only its pacing
    assert paced_text({"results": {"tok_s": 1.0}}) == ""  # decode steps, CPU runs, older records


def test_a_peer_without_a_name_is_drawn_as_peer(tmp_path):
    """A bench record with a peer's rate but no results.peer (hand-made, or from an older harness) must not take the
    report down: its series is named "peer"."""
    from records import store
    root = tmp_path / "rec"
    store.append(store.make_record("bench", preset="tiny", dtype="float32", device="cpu", weights=None,
                                   params=dict(phase="decode", context=64, impl="ours-graph"),
                                   results=dict(tok_s=100.0, peer_tok_s=10.0)), root=root)
    sections = render.render(records_root=root, out=tmp_path / "out")
    speed = next(s for s in sections if s.title.startswith("Speed against"))
    assert any(isinstance(b, render.Figure) for b in speed.blocks)


def test_the_peers_cell_reads_the_rate_its_speedup_was_taken_from(tmp_path):
    """The speed table gives a peer's tok/s as the record's `peer_tok_s`, the figure `speedup_vs_peer` divides by,
    not a rate from its median step (which HF's noisy eager decode moves apart from the mean: 6.46 against 6.91 tok/s
    in afce7d24)."""
    from records import store
    root = tmp_path / "rec"
    store.append(store.make_record("bench", preset="tiny", dtype="float32", device="cpu", weights=None,
                                   params=dict(phase="decode", context=64, impl="ours-graph", peer="hf"),
                                   results=dict(tok_s=100.0, peer="hf", peer_tok_s=10.0, speedup_vs_peer=10.0,
                                                peer_median_ms=50.0, peer_samples_ms=[50.0, 50.0, 200.0])),
                 root=root)
    speed = next(s for s in render.render(records_root=root, out=tmp_path / "out") if s.title.startswith("Speed"))
    cells = [row[-1] for b in speed.blocks if isinstance(b, render.Table) for row in b.rows if row[0] == "64"]
    assert len(cells) == 1 and cells[0].startswith("hf 10 ("), cells   # 1000 / 50 ms would read 20


# ---- the reference checkpoint and the greedy margins -------------------------------------------------------------

def train_record(label="kimi-linear-ref"):
    curve = [{"step": s, "loss": 9.0 - s / 20} for s in range(1, 101)]
    evals = [{"step": 0, "heldout_loss": 9.1, "heldout_bpb": 4.1}, {"step": 100, "heldout_loss": 4.5,
                                                                      "heldout_bpb": 2.25}]
    rec = make_record("train", preset=label, dtype="bfloat16", device="cuda", weights="sha256:5d72d620e602d30a",
                      params={"label": label, "steps": 100, "batch": 16, "seq_len": 512, "seed": 0, "lr": 2e-3,
                              "device_name": "NVIDIA H100 80GB HBM3", "precision": "bf16 weights, fp32 AdamW masters",
                              "corpus": {"sha256": "sha256:4f0b", "python": "3.12.3", "train": {"files": 3,
                                                                                                  "bytes": 900}},
                              "tokenizer": {"vocab": 4352}, "model": {"parameters": 1000, "layers": "KKKM"}},
                      results={"curve": curve, "evals": evals, "heldout_loss": 4.4375, "heldout_bpb": 2.1875,
                               "expert_load_max": [1.25, 1.5], "train_s": 30.0})
    rec["machine"] = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "python": "3.12.3"}
    rec["git"] = {"commit": "1" * 40, "commit_source": "--commit", "note": "recorded after the run"}
    return rec


def margins_record(label, margins, weights):
    flat = [m for row in margins for m in row]
    return make_record("margins", preset=label, dtype="bfloat16", device="cuda", weights=weights,
                       params={"label": label, "golden": f"gates/goldens/{label}-bf16-cuda-hf.json",
                               "golden_dtype": "bf16", "golden_device": "cuda", "source": "hf",
                               "implementation": "hf-transformers-5.17.0", "device_name": "NVIDIA H100"},
                       results={"margins": margins, "n": len(flat), "median": sorted(flat)[len(flat) // 2],
                                "min": min(flat), "zeros": flat.count(0.0), "bf16_eps": 0.125,
                                "frac_below_bf16_eps": sum(m < 0.125 for m in flat) / len(flat), "fp32_eps": 1e-4,
                                "frac_below_fp32_eps": sum(m < 1e-4 for m in flat) / len(flat)})


def test_reference_checkpoint_and_margins_sections_draw_and_cite_their_records(tmp_path):
    root = tmp_path / "records"
    trained = train_record()
    ref = margins_record("kimi-linear-ref", [[1.5, 2.0], [0.75, 3.0]], "sha256:5d72d620e602d30a")
    big = margins_record("48b-a3b", [[0.0, 0.0625], [0.5, 1.0]], "sha256:052e87d2c1b8bc79")
    hostile = margins_record("x$^$<script>", [[0.25]], "w")       # record text in a title, a legend, a cell
    for r in (trained, ref, big, hostile):
        append(r, root=root)
    out = tmp_path / "out"
    sections = {s.title: s for s in render.render(root, out)}
    page, summary = (out / "index.html").read_text(), (out / "SUMMARY.md").read_text()
    for title, name, cited in (("Reference checkpoint", "train", [trained]),
                               ("Greedy margins on the battery", "margins", [ref, big, hostile])):
        s = sections[title]
        assert s.failed is None, s.failed
        [fig] = [b for b in s.blocks if isinstance(b, render.Figure)]
        assert fig.file == f"figures/{name}.png" and not is_blank(out / fig.file)
        assert all(short(r) in fig.source for r in cited), fig.source
        assert f"src='figures/{name}.png'" in page and f"](figures/{name}.png)" in summary
    train_fig = next(b for b in sections["Reference checkpoint"].blocks if isinstance(b, render.Figure))
    assert "NVIDIA H100 80GB HBM3" in train_fig.source and "commit 1111111" in train_fig.source
    assert re.search(rf"\| {short(trained)} \|[^\n]*\| 100 \| 16 x 512 \|[^\n]*\| 4\.438 \| 2\.188 \| 1\.5 \| 30 \|",
                     summary)
    assert re.search(rf"\| {short(big)} \|[^\n]*\| 4 \| 0\.5 \| 0 \| 1 \| 50\.0% \(&lt; 0\.125\) \| 25\.0% ", summary)
    assert re.search(rf"\| {short(ref)} \|[^\n]*\| 0\.0% \(&lt; 0\.125\) \| 0\.0% ", summary)
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_the_reference_checkpoint_drawn_is_the_reference_one(tmp_path):
    """Another checkpoint's later training run is listed, not drawn in place of the reference's."""
    root = tmp_path / "records"
    ref, toy = train_record(), train_record("reference")
    append(ref, root=root)
    append(toy, root=root)
    s = next(s for s in render.render(root, tmp_path / "out") if s.title == "Reference checkpoint")
    fig = next(b for b in s.blocks if isinstance(b, render.Figure))
    assert short(ref) in fig.source and short(toy) not in fig.source and fig.title.endswith("kimi-linear-ref")
    table = next(b for b in s.blocks if isinstance(b, render.Table))
    assert [row[0] for row in table.rows] == [short(ref), short(toy)]


def test_a_report_without_train_or_margins_records_says_so(tmp_path):
    root = tmp_path / "records"
    shutil.copy(RECORDS / "memory.jsonl", root.mkdir() or root)
    sections = {s.title: s for s in render.render(root, tmp_path / "out")}
    for title in ("Reference checkpoint", "Greedy margins on the battery"):
        assert sections[title].blocks == [render.NO_RECORDS] and sections[title].failed is None
    assert {p.stem for p in (tmp_path / "out" / "figures").glob("*.png")} == {"memory"}


def test_the_renderers_own_code_spans_render_as_code_and_record_text_never_does():
    from reports.render import Prose, Section, to_html, to_markdown
    s = Section("t", [Prose("see `python -m x --y` and `a|b`, 2 < 3"), "record `text` <b>"])
    md, page = to_markdown([s], "h"), to_html([s], "h")
    assert "see `python -m x --y` and `a|b`, 2 &lt; 3" in md
    assert "record \\`text\\` &lt;b&gt;" in md                      # a plain string: escaped as before
    assert "see <code>python -m x --y</code> and <code>a|b</code>, 2 &lt; 3" in page
    assert "record `text` &lt;b&gt;" in page and "<code>text</code>" not in page


def test_the_report_shows_no_machine_path_of_a_record():
    from reports.render import no_machine_path
    assert no_machine_path("--golden /root/out/x-bf16.json: no such file") == "--golden …/x-bf16.json: no such file"
    url = "see https://docs.nvidia.com/cuda/cuda-runtime-api/group.html and reports/traces/a.json"
    assert no_machine_path(url) == url          # a URL's path and a relative path stay


def test_a_later_trial_retrain_is_not_drawn_over_the_committed_checkpoint(tmp_path):
    """Of two training runs of the reference label, the one whose weights the checkout's checkpoint has is drawn,
    though the other is later; with no committed weights known, the latest."""
    committed, trial = train_record(), train_record()
    trial["weights"], trial["time"] = "sha256:57d73ccd9d189bf0", "2999-01-01T00:00:00+00:00"
    trial["id"] = "f" * 32
    drawn = lambda w: next(b for b in render.train_section([committed, trial], tmp_path / w[-4:], w).blocks
                           if isinstance(b, render.Figure)).source
    assert short(committed) in drawn(committed["weights"]) and short(trial) not in drawn(committed["weights"])
    assert short(trial) in drawn("sha256:none")
    assert render.committed_reference_weights() == json.loads(render.REFERENCE_PROVENANCE.read_text())["weights"]


def test_gate_runs_of_other_reference_weights_are_marked():
    base = {"kind": "gate_a", "preset": "kimi-linear-ref", "dtype": "bfloat16", "params": {}}
    committed = render.committed_reference_weights()
    assert render.gate_conditions({**base, "weights": committed}) == "kimi-linear-ref bfloat16"
    assert "not the committed checkpoint's" in render.gate_conditions({**base, "weights": "sha256:0000"})
    assert render.gate_conditions({**base, "preset": "tiny", "weights": "sha256:0000"}) == "tiny bfloat16"

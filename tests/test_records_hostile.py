"""Hostile records: any records folder loads and renders, every line it cannot use is listed with the reason, text
from records is escaped in every output, the import takes no link, and a folder that cannot be written says so.

The properties run on arbitrary JSON (whole lines, and values planted at every field the report reads in a valid
record of each kind) and arbitrary bytes; each has a negative control that plants the fault it guards against (a
validator that accepts everything, an escaper that escapes nothing) and shows the check catches it."""
import contextlib
import copy
import errno
import html
import io
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from records import import_run, schema, store
from reports import regress, render

MACHINE = {"host": "h200-a", "gpu": "NVIDIA H200", "driver": "570", "cuda": "12.8", "torch": "2.9", "triton": "3.5",
           "transformers": "5", "python": "3.11", "cpu": "x86"}
KEY = ["NVIDIA H200", "h200-a", "tiny", "decode", 1024, 1, "ours-graph", "hf", "bfloat16"]
PARAMS_RESULTS = {
    "bench": ({"phase": "decode", "context": 1024, "batch": 1, "impl": "ours-graph", "peer": "hf", "run": "r1"},
              {"tok_s": 400.0, "peer": "hf", "peer_tok_s": 8.0, "roofline_fraction": 0.6, "hbm_gbps": 3900.0,
               "samples_ms": [2.5, 2.6, 2.4], "host_launch_us": 7.5,
               "clocks": {"sm_mhz_mean": 1900.0, "sm_mhz_max": 1980.0, "power_cap_share": 0.1},
               "spot_check": {"agree": 4, "total": 4, "verdict": "match"}}),
    "gate_a": ({"expert_dtype": "bf16"},
               {"score": 127, "total": 128, "passed": False,
                "diagnoses": [{"prompt": 3, "step": 7, "ref": {"name": "ref", "token": 11},
                               "test": {"name": "test", "token": 12}, "ref_margin": {"nats": 0.01},
                               "test_margin": {"nats": 0.02}, "eps": 0.05, "verdict": "near-tie"}],
                "per_prompt": [{"prompt": 3, "noise": {"control": "c", "control_first_divergence": None,
                                                       "test_noise": 1.0, "control_noise": 2.0,
                                                       "within_noise": True}}]}),
    "gate_b": ({"golden_implementation": "hf", "golden_dtype": "bf16", "golden_device": "cuda",
                "golden_source": "hf"}, {"score": 128, "total": 128, "passed": True, "diagnoses": []}),
    "memory": ({"context": 1024},
               {"decision": "ran", "passed": True, "projected_bytes": 2 << 30, "measured_peak_bytes": 1 << 30,
                "free_before_bytes": 4 << 30, "floor_bytes": 1 << 30, "min_free_bytes": 2 << 30,
                "audit": {"ok": True, "ratio": 0.5}}),
    "kernel": ({"op": "chunk_kda", "T": 8192, "H": 32, "d": 128, "cfg": {"BV": 32}},
               {"ours_ms": 1.2, "peer_ms": 1.3, "peer": "fla", "ours_graph_ms": 1.1, "peer_graph_ms": 1.2}),
    "decomposition": ({"phase": "decode", "context": 1024, "mode": "graph", "batch": 1, "run": "r1"},
                      {"shares": {"gemm": 0.8, "kda": 0.1, "other": 0.1}, "exclusive_shares": {"gemm": 0.8},
                       "idle_fraction": 0.1, "step_ms": 3.0, "trace": "reports/traces/t.json.gz"}),
    "nightly": ({}, {"passed": False, "regressions": [{"key": KEY, "verdict": "regression", "message": "m"}],
                     "steps": {"gate-a": {"returncode": 1, "seconds": 3.0, "gate": True, "timed_out": False,
                                          "tail": "the last line"}}}),
    "erratum": ({"record": "0" * 32, "fields": ["results.peer_tok_s"]}, {"reason": "why"}),
}
KINDS = sorted(PARAMS_RESULTS)


def base(kind: str) -> dict:
    """A valid record of `kind` holding every field the report reads from that kind."""
    params, results = copy.deepcopy(PARAMS_RESULTS[kind])
    r = store.make_record(kind, preset="tiny", dtype="bfloat16", device="cuda", weights="w", params=params,
                          results=results)
    r["machine"] = dict(MACHINE)
    r["git"] = {"commit": "a" * 40, "dirty": False}
    return r


def plant(record: dict, path: str, value) -> dict:
    """A copy of `record` with `value` at `path` (a V1_SHAPES path: `a[]` makes a one-element array, `a.*` an
    object with one key), the objects on the way made where missing."""
    record = copy.deepcopy(record)
    node, parts = record, path.split(".")
    for i, part in enumerate(parts):
        last, name = i == len(parts) - 1, part.removesuffix("[]")
        key = "k" if name == "*" else name
        if part.endswith("[]"):
            node[key] = [value] if last else [{}]
            node = node[key][0]
        elif last:
            node[key] = value
        else:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
    return record


def folder(root: Path, kind: str, hostile: list[bytes]) -> Path:
    """A records folder: a valid record of `kind`, then the hostile lines, in `<kind>.jsonl`."""
    root.mkdir(parents=True, exist_ok=True)
    store.append(base(kind), root=root)
    with open(root / f"{kind}.jsonl", "ab") as f:
        for line in hostile:
            f.write(line + b"\n")
    return root


# ---- the checks each property makes, and that each negative control must see fail -----------------

def check_load(root: Path) -> store.Loaded:
    """`load` never raises; every non-blank line is a record the validator accepts or a problem "file:line: why;
    skipped" naming that line."""
    try:
        loaded = store.load(root=root)
    except Exception as e:
        raise AssertionError(f"load raised {e!r}") from e
    lines = {(p.name, n) for p in root.glob("*.jsonl")
             for n, raw in enumerate(p.read_bytes().split(b"\n"), start=1) if raw.strip()}
    named = set()
    for p in loaded.problems:
        m = re.fullmatch(r"(.+):(\d+): (.+); skipped", p, re.S)
        assert m, f"a problem without file:line: why: {p!r}"
        named.add((Path(m.group(1)).name, int(m.group(2))))
    assert named <= lines and len(named) == len(loaded.problems), loaded.problems
    assert len(loaded.records) + len(loaded.problems) == len(lines), (len(loaded.records), loaded.problems)
    for r in loaded.records:
        assert store.validate_record(r) == [], r
    return loaded


ALLOWED_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "section", "p", "table", "tr", "th",
                "td", "figure", "img", "figcaption", "b", "code"}
ALLOWED_ATTRIBUTES = {"charset", "class", "src", "alt"}
TAG = re.compile(r"<\s*/?\s*([A-Za-z][^\s/>]*)([^>]*)>")
ATTRIBUTE = re.compile(r"""([^\s=/'"]+)\s*(?:=\s*('[^']*'|"[^"]*"|[^\s'">]+))?""")
MD_LINK = re.compile(r"(?<!\\)(?:\\\\)*\]\(([^)]*)\)")  # `](target)` whose `]` no backslash escapes
SAFE_TARGET = re.compile(r"figures/[a-z_]+\.png")


def check_outputs(out: Path, sections: list, problems: list[str], err: str) -> None:
    """The report's files: no tag, attribute or link but the writers' own (so no `<script`, no `javascript:`
    href), no raw `<` in the markdown, every problem line in the page, the summary and on stderr, and no section
    that failed."""
    page, md = (out / "index.html").read_text(encoding="utf-8"), (out / "SUMMARY.md").read_text(encoding="utf-8")
    for doc in (page, md):
        assert not re.search(r"<\s*script", doc, re.I), "a <script> tag in the output"
    for name, attrs in TAG.findall(page):   # text may say "javascript:"; no tag or attribute may hold it
        assert name.lower() in ALLOWED_TAGS, f"tag <{name}> in the page"
        for attr, value in ATTRIBUTE.findall(attrs):
            assert attr.lower() in ALLOWED_ATTRIBUTES, f"attribute {attr} in <{name}>"
            assert "javascript:" not in value.lower(), f"a javascript: attribute in <{name}>"
            if attr.lower() == "src":
                assert SAFE_TARGET.fullmatch(value.strip("'\"")), value
    assert "<" not in md, "raw HTML in the summary"
    for target in MD_LINK.findall(md):
        assert SAFE_TARGET.fullmatch(target), f"a link to {target!r} in the summary"
    assert not re.search(r"^\s{0,3}\[[^\]]*\]:", md, re.M), "a link reference definition in the summary"
    for p in problems:
        assert html.escape(p) in page and render.md_text(p) in md and p in err, p
    assert not [s.title for s in sections if s.failed], [(s.title, s.failed) for s in sections if s.failed]


def check_render(root: Path, out: Path) -> None:
    """`render` never raises on what `load` gives it, and its outputs pass `check_outputs`."""
    loaded = check_load(root)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            sections = render.render(root, out)
    except Exception as e:
        raise AssertionError(f"render raised {e!r}") from e
    check_outputs(out, sections, loaded.problems, err.getvalue())


# ---- arbitrary JSON, planted where the report reads and written whole ----------------------------

HOSTILE_TEXT = st.sampled_from([
    "$x^$", "$$", "$", r"$\frac$", "<script>alert(1)</script>", "javascript:alert(1)", "[a](javascript:alert(1))",
    "<img src=x onerror=alert(1)>", "&lt;script&gt;", "&#106;avascript:", "| a | b |", "\n# heading", "`code`",
    "*_~", "\\", "\ud800", "\x00", "\u202e", "x" * 300,
    "2026-01-01", "2026-01-01T00:00:00", "2026-12-07T04:02:07+00:00", "9999-12-31T23:59:59+00:00",
    "0001-01-01T00:00:00+00:00", "2261-12-31T23:59:59-23:59", "2026-W01-1T00:00+00:00", "20260101T000000Z"])
TEXT = st.one_of(st.text(max_size=12), HOSTILE_TEXT, st.text(alphabet="$<>&[]()`*_|\\:/ javascript#\n", max_size=16))
NUMBERS = st.one_of(st.integers(), st.floats(), st.sampled_from([0, -1, 1e308, -1e308, 5e-324, 2 ** 63, 10 ** 400]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
# the top-level fields, every field the report read under version 1 (and reads still), an undeclared one, a few more
PATHS = sorted(set(store.REQUIRED_FIELDS) | {p for p, _ in schema.V1_SHAPES}
               | {"results", "params.x", "results.clocks.sm_mhz_max", "git.dirty", "results.spot_check.agree",
                  "results.diagnoses[].ref.token", "results.per_prompt[].prompt", "results.steps.*.returncode"})


def planted_line(kind: str, path: str, value) -> bytes:
    rec = plant(dict(base(kind), id="f" * 32), path, value)
    return json.dumps(rec).encode()


HOSTILE = st.one_of(
    st.tuples(st.sampled_from(KINDS), st.sampled_from(PATHS), JSON).map(lambda t: (t[0], planted_line(*t))),
    st.tuples(st.sampled_from(KINDS), JSON.map(lambda v: json.dumps(v).encode())),
    st.tuples(st.sampled_from(KINDS), st.binary(max_size=40)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(HOSTILE)
def test_property_any_line_loads_or_is_listed_with_its_reason(kind_line):
    kind, line = kind_line
    with tempfile.TemporaryDirectory() as tmp:
        loaded = check_load(folder(Path(tmp), kind, [line]))
        assert any(r["kind"] == kind for r in loaded.records)   # a hostile line takes no other record down


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(HOSTILE)
def test_property_any_line_renders_escaped(kind_line):
    kind, line = kind_line
    with tempfile.TemporaryDirectory() as tmp:
        check_render(folder(Path(tmp) / "records", kind, [line]), Path(tmp) / "out")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), HOSTILE_TEXT), min_size=1, max_size=6))
def test_property_hostile_text_in_a_record_of_every_kind_renders_escaped(planted):
    """Hostile strings planted in one record of every kind at once, beside a valid one of each: all sections and
    their figures drawn together."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "records"
        for kind in KINDS:
            rec = dict(base(kind), id=f"{kind:f<32}"[:32])
            for path, text in planted:
                rec = plant(rec, path, text)
            folder(root, kind, [json.dumps(rec).encode()])
        check_render(root, Path(tmp) / "out")


# ---- negative controls: each check catches the fault it guards against -----------------------------

LATER = "2030-01-01T00:00:00+00:00"  # after the valid record beside it: the planted record is the one drawn


def bad_folder(tmp_path, kind="bench", **planted) -> Path:
    rec = dict(base(kind), id="b" * 32, time=LATER)
    for path, value in planted.items():
        rec = plant(rec, path.replace("__", "."), value)
    return folder(tmp_path / "records", kind, [json.dumps(rec).encode()])


def test_the_load_check_catches_a_validator_that_accepts_everything(tmp_path, monkeypatch):
    root = bad_folder(tmp_path, time=5)
    check_load(root)
    monkeypatch.setattr(store, "validate_record", lambda rec: [])
    with pytest.raises(AssertionError, match="load raised"):
        check_load(root)


def test_the_render_check_catches_a_validator_that_accepts_every_object(tmp_path, monkeypatch):
    root = bad_folder(tmp_path, results__tok_s="fast")
    check_render(root, tmp_path / "out")
    monkeypatch.setattr(store, "validate_record", lambda rec: [] if isinstance(rec, dict) else ["not an object"])
    with pytest.raises(AssertionError, match="Speed against context length"):
        check_render(root, tmp_path / "out")


def test_the_render_check_catches_html_that_is_not_escaped(tmp_path, monkeypatch):
    root = bad_folder(tmp_path, preset="<script>alert(1)</script>")
    check_render(root, tmp_path / "out")
    monkeypatch.setattr(render.html, "escape", lambda s, quote=True: s)
    with pytest.raises(AssertionError, match="a <script> tag in the output"):
        check_render(root, tmp_path / "out")


def test_the_render_check_catches_markdown_that_is_not_escaped(tmp_path, monkeypatch):
    root = bad_folder(tmp_path, preset="[x](javascript:alert(1))")
    check_render(root, tmp_path / "out")
    monkeypatch.setattr(render, "md_text", lambda x, block=False: str(x))
    with pytest.raises(AssertionError, match="raw HTML in the summary|a link to 'javascript:alert"):
        check_render(root, tmp_path / "out")


def test_the_render_check_catches_plot_text_that_is_not_escaped(tmp_path, monkeypatch):
    root = bad_folder(tmp_path, machine__gpu="$$")
    check_render(root, tmp_path / "out")
    monkeypatch.setattr(render, "plot_text", str)
    with pytest.raises(AssertionError, match="ParseException"):
        check_render(root, tmp_path / "out")


def test_the_render_check_catches_a_problem_the_report_leaves_out(tmp_path, monkeypatch):
    root = folder(tmp_path / "records", "bench", [b'{"torn'])
    check_render(root, tmp_path / "out")
    monkeypatch.setattr(render, "problems_section", lambda problems: render.Section("Unreadable record lines"))
    with pytest.raises(AssertionError, match="torn"):
        check_render(root, tmp_path / "out")


# ---- one bad line no longer kills the report ---------------------------------------------------------

def line(**planted) -> bytes:
    rec = dict(base("bench"), id="c" * 32)
    for path, value in planted.items():
        rec = plant(rec, path.replace("__", "."), value)
    return json.dumps(rec).encode()


@pytest.mark.parametrize("bad, why", [
    (line(time="yesterday"), "time must be an ISO-8601 string"),
    (line(time=5), "time must be an ISO-8601 string"),
    (line(time=None), "time must be an ISO-8601 string"),
    (line(time="2026-12-07T04:02:07"), "has no UTC offset"),
    (b'{"results": ' * 100000 + b"1" + b"}" * 100000, "nested deeper than JSON can be read"),
    (line(results__x=json.loads("[" * 40 + "]" * 40)), "nests deeper than 32"),
    (line(id=5), "id must be a non-empty string"),
    (line(id=[1]), "id must be a non-empty string"),
    (line(results__tok_s="fast"), "results.tok_s must be a finite number"),
    (line(results__samples_ms="abc"), "results.samples_ms must be an array"),
    (line(results__tok_ss=400.0), "bench results.tok_ss is not a declared field"),
    (line(params__context="1024"), "bench params.context must be an integer, got string '1024'"),
    (line(preset="\ud800"), "lone surrogate"),
    (b"\xff\xfe not UTF-8", "torn or invalid JSON line"),
])
def test_a_bad_line_is_listed_with_its_reason_and_the_report_renders(tmp_path, bad, why):
    root = folder(tmp_path / "records", "bench", [bad])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sections = render.render(root, tmp_path / "out")
    listed = [b for b in sections[0].blocks if isinstance(b, render.Table)]
    assert listed, "no line listed as unreadable"
    problems = listed[0].rows
    assert len(problems) == 1 and re.match(r".*bench\.jsonl:2: ", problems[0][0]) and why in problems[0][0]
    assert why in err.getvalue() and "bench.jsonl:2: " in err.getvalue()
    page = (tmp_path / "out" / "index.html").read_text()
    assert html.escape(why) in page and "could not be drawn" not in page


@pytest.mark.parametrize("where, text", [("machine.gpu", "$$"), ("preset", r"$\frac$"), ("dtype", "$x^$"),
                                         ("git.commit", "$$"), ("results.peer", "$x^$"), ("machine.host", "$x^$")])
def test_mathtext_in_any_record_text_leaves_every_figure_drawn(tmp_path, where, text):
    """matplotlib reads text between two `$` as mathtext and fails a figure on a malformed one: record text is
    drawn as written."""
    root = tmp_path / "records"
    for kind in KINDS:
        rec = dict(base(kind), id=f"{kind:f<32}"[:32])
        section, _, name = where.partition(".")
        if section != "results" or name in schema.KINDS[kind].results.type.fields:   # where the kind declares it
            rec = plant(rec, where, text)
        store.append(rec, root=root)
    render.render(root, tmp_path / "out")
    assert {p.stem for p in (tmp_path / "out" / "figures").glob("*.png")} == {
        "speed_decode", "history_decode", "gates", "decomposition", "kernels", "memory"}


# ---- escaping ----------------------------------------------------------------------------------------

def test_record_text_is_escaped_in_the_page_and_the_summary(tmp_path):
    nasty = "<script>alert(1)</script> [click](javascript:alert(2)) <javascript:alert(3)> &lt;b&gt; *x* | y"
    root = tmp_path / "records"
    for kind in KINDS:
        rec = dict(base(kind), id=f"{kind:f<32}"[:32], preset=nasty)
        rec["machine"]["host"] = nasty
        rec["reasons"] = [nasty]
        store.append(rec, root=root)
    sections = render.render(root, tmp_path / "out")
    check_outputs(tmp_path / "out", sections, [], "")
    md = (tmp_path / "out" / "SUMMARY.md").read_text()
    assert r"&lt;script&gt;alert(1)&lt;/script&gt; \[click\](javascript:alert(2))" in md
    assert r"&amp;lt;b&amp;gt; \*x\* \| y" in md   # an entity spelled out in a record stays text


def test_md_text_and_link_target():
    assert render.md_text("a_b `c` ~d~ $e$ \\") == r"a\_b \`c\` \~d\~ \$e\$ \\"
    assert render.md_text("# 1. - x", block=True) == r"\# 1. - x" and render.md_text("1. x", block=True) == r"1\. x"
    assert render.md_text("1.5 +3") == "1.5 +3"    # only at the start of a paragraph
    assert render.link_target("figures/speed_decode.png") == "figures/speed_decode.png"
    assert render.link_target("https://example.org/a") == "https://example.org/a"
    for bad in ("javascript:alert(1)", "JAVASCRIPT:x", "/etc/passwd", "../x.png", "data:text/html,x", " figures/x"):
        assert render.link_target(bad) is None, bad
    assert render.plot_text("$x^$") == r"\$x^\$" and len(render.plot_text("x" * 500)) == render.PLOT_CHARS


# ---- import_run takes no link and no path out of the traces folder ----------------------------------

def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=store.REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def run_box(tmp_path, trace="reports/traces/t.json.gz"):
    """A run's tree: records with a decomposition naming `trace`, its traces folder, and a secret elsewhere."""
    box = tmp_path / "box" / "records"
    store.append(plant(base("decomposition"), "results.trace", trace), root=box)
    store.append(base("bench"), root=box)
    (tmp_path / "box" / "reports" / "traces").mkdir(parents=True)
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("the importing box's secret")
    secret.chmod(0o600)
    return box, secret


def imported(tmp_path, box, capsys) -> tuple[int, str]:
    code = import_run.main([str(box), "--commit", _head(), "--note", "run 1", "--root",
                            str(tmp_path / "here" / "records")])
    return code, capsys.readouterr().err


def nothing_written(tmp_path) -> bool:
    return not (tmp_path / "here").exists() or not any(p.is_file() for p in (tmp_path / "here").rglob("*"))


@pytest.mark.parametrize("plant_link", ["outside", "dangling", "inside", "folder"])
def test_import_refuses_a_trace_that_is_a_link(tmp_path, capsys, plant_link):
    box, secret = run_box(tmp_path)
    traces = tmp_path / "box" / "reports" / "traces"
    if plant_link == "outside":
        (traces / "t.json.gz").symlink_to(secret)
    elif plant_link == "dangling":
        (traces / "t.json.gz").symlink_to(tmp_path / "nowhere")
    elif plant_link == "inside":
        (traces / "real.json.gz").write_bytes(b"trace")
        (traces / "t.json.gz").symlink_to("real.json.gz")
    else:   # the traces folder itself links elsewhere
        traces.rmdir()
        traces.symlink_to(secret.parent)
        (secret.parent / "t.json.gz").write_bytes(b"not the run's")
    code, err = imported(tmp_path, box, capsys)
    assert code == 2 and "a symbolic link" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert nothing_written(tmp_path)


def test_import_refuses_a_records_file_that_is_a_link(tmp_path, capsys):
    box, secret = run_box(tmp_path)
    (box / "kernel.jsonl").symlink_to(secret)
    code, err = imported(tmp_path, box, capsys)
    assert code == 2 and "kernel.jsonl is a symbolic link" in err and nothing_written(tmp_path)


@pytest.mark.parametrize("trace", ["../../elsewhere/secret.txt", "reports/traces/../../../elsewhere/secret.txt",
                                   "/etc/passwd", "elsewhere/secret.txt", "reports/traces"])
def test_import_refuses_a_trace_path_out_of_the_traces_folder(tmp_path, capsys, trace):
    box, _ = run_box(tmp_path, trace)
    code, err = imported(tmp_path, box, capsys)
    assert code == 2 and "must be a relative path under reports/traces/" in err and nothing_written(tmp_path)


def test_import_copies_a_regular_trace_with_ordinary_permissions(tmp_path, capsys):
    box, _ = run_box(tmp_path)
    trace = tmp_path / "box" / "reports" / "traces" / "t.json.gz"
    trace.write_bytes(b"trace")
    trace.chmod(0o6777)
    code, err = imported(tmp_path, box, capsys)
    copied = tmp_path / "here" / "reports" / "traces" / "t.json.gz"
    assert code == 0 and copied.read_bytes() == b"trace" and not copied.stat().st_mode & 0o7133


def test_import_skips_a_hostile_line_with_its_reason(tmp_path, capsys):
    box, _ = run_box(tmp_path)
    (tmp_path / "box" / "reports" / "traces" / "t.json.gz").write_bytes(b"trace")
    with open(box / "bench.jsonl", "ab") as f:
        f.write(line(time="yesterday") + b"\n" + b'{"a": ' * 100000 + b"\n")
    code, err = imported(tmp_path, box, capsys)
    assert code == 0 and "time must be an ISO-8601 string" in err and "nested deeper" in err
    assert len(store.load(root=tmp_path / "here" / "records").records) == 2


# ---- a records folder that cannot be written ---------------------------------------------------------

def test_ensure_writable_returns_the_path_and_creates_nothing(tmp_path):
    assert store.ensure_writable("bench", tmp_path / "new" / "records") == tmp_path / "new" / "records" / "bench.jsonl"
    assert not (tmp_path / "new").exists()
    store.append(base("bench"), root=tmp_path)
    assert store.ensure_writable("bench", tmp_path) == tmp_path / "bench.jsonl"


def test_ensure_writable_refuses_what_cannot_be_appended_to(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(store.RecordsUnwritable, match=r"file/records: .*is not a folder"):
        store.ensure_writable("gate_a", tmp_path / "file" / "records")
    (tmp_path / "records" / "bench.jsonl").mkdir(parents=True)
    with pytest.raises(store.RecordsUnwritable, match=r"bench\.jsonl: is not a regular file"):
        store.ensure_writable("bench", tmp_path / "records")
    monkeypatch.setattr(os, "access", lambda path, mode: False)     # a read-only folder (root passes any mode bits)
    with pytest.raises(store.RecordsUnwritable, match=r"kernel\.jsonl: cannot be written: the records folder is "):
        store.ensure_writable("kernel", tmp_path / "records")
    monkeypatch.undo()
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 10, 10, 10, 10, 10, 10, 0, 255)))
    with pytest.raises(store.RecordsUnwritable, match=r"kernel\.jsonl: only 40960 bytes free"):
        store.ensure_writable("kernel", tmp_path / "records")


@pytest.mark.parametrize("failure", ["enospc", "short"])
def test_append_that_cannot_write_raises_unwritable_and_leaves_no_torn_line(tmp_path, monkeypatch, failure):
    first = base("bench")
    store.append(first, root=tmp_path)
    before = (tmp_path / "bench.jsonl").read_bytes()
    real_write, calls = os.write, []

    def write(fd, data):   # the first write (the record's line) fails; any other passes through
        calls.append(fd)
        if len(calls) > 1:
            return real_write(fd, data)
        if failure == "enospc":
            real_write(fd, data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data[:len(data) // 2])
    monkeypatch.setattr(os, "write", write)
    with pytest.raises(store.RecordsUnwritable, match=r"bench\.jsonl: the record could not be appended: "):
        store.append(base("bench"), root=tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "bench.jsonl").read_bytes() == before
    assert [r["id"] for r in store.load(root=tmp_path).records] == [first["id"]]


def test_append_to_a_folder_that_cannot_be_made_raises_unwritable(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(store.RecordsUnwritable, match=r"file/records/bench\.jsonl: cannot be opened"):
        store.append(base("bench"), root=tmp_path / "file" / "records")


def test_append_refuses_a_record_the_report_could_not_read(tmp_path):
    for path, value, why in (("time", "yesterday", "time must be"), ("machine.gpu", 5, "machine.gpu must be a string"),
                             ("results.tok_s", "fast", "results.tok_s must be a finite number"),
                             ("results.x", json.loads("[" * 40 + "]" * 40), "nests deeper")):
        with pytest.raises(store.RecordError, match=why):
            store.append(plant(base("bench"), path, value), root=tmp_path)
    assert not (tmp_path / "bench.jsonl").exists()


# ---- the commands: 0 done, 1 a regression (regress), 2 could not run, one line and no traceback ------

def test_render_command_exits_2_on_a_missing_records_folder_or_an_unwritable_output(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        render.main(["--records", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "--records" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    folder(tmp_path / "records", "bench", [])
    assert render.main(["--records", str(tmp_path / "records"), "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("render: --out ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert render.main(["--records", str(tmp_path / "records"), "--out", str(tmp_path / "out")]) == 0


def test_regress_command_skips_a_hostile_bench_line_and_judges_the_rest(tmp_path, capsys):
    root = folder(tmp_path / "records", "bench", [line(results__samples_ms="abc"), line(results__samples_ms=[0.0])])
    assert regress.main(["--records", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "results.samples_ms must be an array" in err and "1 configuration(s) judged" in out
    assert not regress.comparable(json.loads(line(results__samples_ms=[0.0, 1.0])))   # a median of 0: not checked


def test_import_refuses_a_hard_linked_trace_a_linked_run_folder_and_a_linked_destination(tmp_path, capsys):
    """A hard link is another name of a file elsewhere on the box; a run folder given through a link, or a
    destination traces folder that is one, would read or write outside the trees the import names."""
    box, secret = run_box(tmp_path)
    os.link(secret, tmp_path / "box" / "reports" / "traces" / "t.json.gz")
    code, err = imported(tmp_path, box, capsys)
    assert code == 2 and "hard links" in err and nothing_written(tmp_path)

    box2, _ = run_box(tmp_path / "b")
    (tmp_path / "b" / "box" / "reports" / "traces" / "t.json.gz").write_bytes(b"trace")
    (tmp_path / "b" / "alias").symlink_to(box2)
    code, err = imported(tmp_path / "b", tmp_path / "b" / "alias", capsys)
    assert code == 2 and "is a symbolic link" in err

    (tmp_path / "b" / "here" / "reports").mkdir(parents=True)
    (tmp_path / "b" / "here" / "reports" / "traces").symlink_to(secret.parent)
    code, err = imported(tmp_path / "b", box2, capsys)
    assert code == 2 and "never written through one" in err
    assert sorted(p.name for p in secret.parent.iterdir()) == ["secret.txt"]

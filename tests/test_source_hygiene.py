"""Sources keep invariants, not history: no comment or docstring under the package folders cites a commit hash,
a record id or a run id (those live in docs/kernels.md and docs/RESULTS.md, where every cited record is checked
to exist), and no source names a path of one machine. docs/kernels.md is held to the same citation check as
docs/RESULTS.md (tests/test_readme_citations.py)."""
import ast
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

from records import store
from tests.test_readme_citations import cited, missing

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("model", "gates", "benchmarks", "records", "reports")
# a hex token of 7 to 40 digits with at least one digit and one letter (a commit hash, a record id or a run id),
# or a 12-digit run id of decimal digits alone; bounded by non-word characters either side
HEX = re.compile(r"(?<![\w])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w])")
RUN_ID = re.compile(r"(?<![\w])[0-9]{12}(?![\w])")
# a token of 8 to 40 hex digits of any mix (a record id of digits alone, `83152036`), checked against the records
ANY_HEX = re.compile(r"(?<![\w])[0-9a-f]{8,40}(?![\w])")
# a path rooted in one machine's file system
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|home|root|tmp|Users|mnt|scratch)/")


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def prose(src: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source: COMMENT tokens, and the string expression
    statements of the module, class and function bodies (docstrings, and bare strings used as comments)."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return sorted(out)


def strings(src: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal and comment of a Python source."""
    return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type in (tokenize.STRING, tokenize.COMMENT) or t.type == getattr(tokenize, "FSTRING_MIDDLE", -1)]


@functools.cache
def record_ids() -> frozenset[str]:
    """The first 8 hex digits of every record id and every run id in records/."""
    loaded = store.load(root=ROOT / "records")
    runs = {r["params"].get("run") for r in loaded.records if isinstance(r.get("params"), dict)}
    return frozenset({r["id"][:8] for r in loaded.records} | {x for x in runs if isinstance(x, str)})


def history_ids(src: str, known: frozenset[str] | None = None) -> list[tuple[int, str]]:
    """(line, token) of every commit hash, record id or run id that a comment or docstring of `src` cites: a hex
    token of letters and digits, a 12-digit run id, or any hex token that begins with a known record or run id
    (`known`, by default those in records/)."""
    known = record_ids() if known is None else known
    found = set()
    for line, text in prose(src):
        found |= {(line, m.start(), m.group()) for rx in (HEX, RUN_ID) for m in rx.finditer(text)}
        found |= {(line, m.start(), m.group()) for m in ANY_HEX.finditer(text)
                  if m.group()[:8] in known or m.group()[:12] in known}
    return [(line, tok) for line, _, tok in sorted(found)]


def machine_paths(src: str) -> list[tuple[int, str]]:
    """(line, text) of every comment or string literal of `src` that holds a path rooted in one machine."""
    return [(line, MACHINE_PATH.search(text).group()) for line, text in strings(src) if MACHINE_PATH.search(text)]


def offenses(check) -> dict[str, list]:
    found = {}
    for p in sources():
        hits = check(p.read_text())
        if hits:
            found[str(p.relative_to(ROOT))] = hits
    return found


def test_sources_are_scanned():
    names = {str(p.relative_to(ROOT)) for p in sources()}
    assert len(names) > 40 and {"model/triton/kda_chunk.py", "gates/run.py", "reports/render.py"} <= names


def test_no_commit_hash_or_record_id_in_comments_or_docstrings():
    found = offenses(history_ids)
    assert found == {}, f"history in sources (move it to docs/kernels.md or docs/RESULTS.md): {found}"


def test_no_path_of_one_machine_in_sources():
    found = offenses(machine_paths)
    assert found == {}, f"paths of one machine in sources: {found}"


def test_the_checks_catch_a_planted_id_and_path():
    """Negative controls: an id in a comment and in a docstring is reported, the same id in code is not."""
    planted = ('"""Module doc, tuned in run of 5ac699e."""\n'
               "X = 1  # 0.69 ms `cd6de7ec`\n"
               "def f():\n"
               '    """Fastest (run `89ecb44d6ba2`, run 123456789012)."""\n'
               '    return "d888cefc" + hex(0xDEADBEEF)\n'
               "class C:\n"
               "    '''Was 2e4f923.'''\n"
               "    SHA = '0123abcd0123abcd'\n")
    assert history_ids(planted, known=frozenset()) == [(1, "5ac699e"), (2, "cd6de7ec"), (4, "89ecb44d6ba2"),
                                                       (4, "123456789012"), (7, "2e4f923")]
    no_ids = "# decade of effaced 1234567 numbers, 1e-5, sm_90, fp32 0x7FFFFFFF, abc1234x, 16777216\n"
    assert history_ids(no_ids, known=frozenset()) == []
    # a record id of digits alone is caught by the records it names, in a comment as in a docstring
    digits = '"""Two kernels (decomposition 83152036)."""\nX = 83152036  # also 83152036\n'
    assert history_ids(digits, known=frozenset({"83152036"})) == [(1, "83152036"), (2, "83152036")]
    assert history_ids(digits, known=frozenset()) == []
    assert machine_paths('P = "/work/shared/seed/x.txt"\n# see /home/me/x\nQ = "shared/seed/x.txt"\n') == \
        [(1, "/work/"), (2, "/home/")]


def test_every_record_the_kernel_notes_cite_exists():
    """docs/kernels.md holds the sweep histories that the kernel modules left: each record id it cites exists."""
    loaded = store.load(root=ROOT / "records")
    assert not loaded.problems, loaded.problems
    text = (ROOT / "docs" / "kernels.md").read_text()
    assert len(cited(text, 8)) >= 100
    assert missing(text, loaded.records) == [], "docs/kernels.md cites records or runs that records/ does not hold"


# The packages in dependency order: each may import only those before it. `records` (provenance) stands alone; the
# model knows nothing of the gates, benchmarks or reports built on it.
LAYERS = {"records": set(), "model": {"records"}, "gates": {"model", "records"},
          "benchmarks": {"model", "records", "gates"}, "reports": {"model", "records", "gates", "benchmarks"}}


def suite_imports(src: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of one of the suite's packages in `src` (a relative import stays in
    its own package, as the sources use them; `importlib` strings are not followed)."""
    out = []
    for node in ast.walk(ast.parse(src)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        out += [(node.lineno, n) for n in names if n.split(".")[0] in LAYERS]
    return out


def layering_offenses(files=None) -> dict[str, list]:
    found = {}
    for p in files or sources():
        pkg = p.relative_to(ROOT).parts[0]
        bad = [(line, m) for line, m in suite_imports(p.read_text())
               if (m.split(".")[0] != pkg and m.split(".")[0] not in LAYERS[pkg]) or m.endswith("__main__")]
        if bad:
            found[str(p.relative_to(ROOT))] = bad
    return found


def test_packages_import_only_the_layers_below_them():
    assert layering_offenses() == {}


def test_the_layering_check_catches_an_upward_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "model").mkdir()
    bad = tmp_path / "model" / "x.py"
    bad.write_text("import torch\nfrom gates.prompts import battery\n")
    main = tmp_path / "model" / "y.py"
    main.write_text("from model.__main__ import main\n")
    assert layering_offenses([bad, main]) == {"model/x.py": [(2, "gates.prompts")],
                                              "model/y.py": [(1, "model.__main__")]}

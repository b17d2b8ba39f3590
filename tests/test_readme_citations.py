"""The README and docs/RESULTS.md, the long form of the suite's results: every record id (`1a2b3c4d`, a record id's
first 8 hex digits) and run id (12 digits) either cites must name a record in records/, so a figure cannot outlive
its source. The README carries no figures of its own (they live in docs/RESULTS.md and the generated report), so
only docs/RESULTS.md must keep citing; the README is held to its shape instead: short lines, a bounded length, and
the two commands users and CI rely on first."""
import re
from pathlib import Path

from records import store

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINE_CHARS = 120
MAX_README_LINES = 160
FIRST_COMMANDS = ("make gate-a gate-b", "make test")


def cited(text: str, digits: int) -> set[str]:
    return set(re.findall(rf"`([0-9a-f]{{{digits}}})`", text))


def missing(text: str, records: list[dict]) -> list[str]:
    """The record ids and run ids `text` cites that no record holds."""
    ids = {r["id"][:8] for r in records}
    runs = {r["params"].get("run") for r in records if isinstance(r.get("params"), dict)}
    return sorted((cited(text, 8) - ids) | (cited(text, 12) - runs))


# the files whose citations are checked, and the fewest record ids each must cite (so that a change of citation
# style cannot make the check pass vacuously); the README may cite none
CITING = {"README.md": 0, "docs/RESULTS.md": 200}


def test_every_record_the_readme_cites_exists():
    loaded = store.load(root=ROOT / "records")
    assert not loaded.problems, loaded.problems
    for name, least in CITING.items():
        text = (ROOT / name).read_text()
        assert len(cited(text, 8)) >= least, name
        assert missing(text, loaded.records) == [], f"{name} cites records or runs that records/ does not hold"


def test_a_citation_without_its_record_is_caught():
    records = [{"id": "fd5df938" + "0" * 24, "params": {"run": "bd42cef5ceeb"}}]
    text = "379.8 tok/s (`fd5df938`, eed6cc5; run `bd42cef5ceeb`), 2.31x (`ca4425d4`), run `0123456789ab`; `make test`"
    assert missing(text, records) == ["0123456789ab", "ca4425d4"]


def long_lines(text: str, limit: int = MAX_README_LINE_CHARS) -> list[int]:
    """1-based numbers of the lines longer than `limit` characters."""
    return [i for i, line in enumerate(text.splitlines(), 1) if len(line) > limit]


def first_code_block(text: str) -> list[str]:
    """The lines inside the first fenced code block (``` ... ```), or [] when there is none."""
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    return m.group(1).splitlines() if m else []


def command(line: str) -> str:
    """A code line without its trailing `# comment` and surrounding blanks."""
    return line.split("#", 1)[0].strip()


def test_readme_lines_are_short_and_the_file_is_bounded():
    text = README.read_text()
    assert long_lines(text) == [], f"README.md lines over {MAX_README_LINE_CHARS} characters: {long_lines(text)}"
    assert len(text.splitlines()) <= MAX_README_LINES, f"README.md has {len(text.splitlines())} lines"


def test_readme_starts_with_the_two_commands():
    block = first_code_block(README.read_text())
    assert [command(x) for x in block[:2]] == list(FIRST_COMMANDS), block[:2]


def test_the_shape_checks_can_fail():
    """Negative controls for the helpers above."""
    assert long_lines("short\n" + "x" * 121 + "\n" + "y" * 120) == [2]
    assert first_code_block("# t\n\ntext\n```\nmake test\nmake gate-a gate-b\n```\n```\nother\n```\n") == \
        ["make test", "make gate-a gate-b"]
    assert first_code_block("no code here\n") == []
    swapped = first_code_block("```\nmake test  # tests\nmake gate-a gate-b\n```\n")
    assert [command(x) for x in swapped] != list(FIRST_COMMANDS)

"""The README's figures cite records by id (`1a2b3c4d`, a record id's first 8 hex digits) and runs by their
12-digit run id: every one of them must name a record in records/, so a figure cannot outlive its source."""
import re
from pathlib import Path

from records import store

ROOT = Path(__file__).resolve().parents[1]


def cited(text: str, digits: int) -> set[str]:
    return set(re.findall(rf"`([0-9a-f]{{{digits}}})`", text))


def test_every_record_the_readme_cites_exists():
    text = (ROOT / "README.md").read_text()
    loaded = store.load(root=ROOT / "records")
    assert not loaded.problems, loaded.problems
    ids = {r["id"][:8] for r in loaded.records}
    runs = {r["params"].get("run") for r in loaded.records if isinstance(r.get("params"), dict)}
    records, run_ids = cited(text, 8), cited(text, 12)
    assert len(records) > 50  # the results section cites records: the pattern must keep finding them
    assert sorted(records - ids) == [], "README cites records that records/ does not hold"
    assert sorted(run_ids - runs) == [], "README cites runs that no record names"


def test_the_citation_pattern_finds_ids_and_not_commits():
    text = "read 379.8 tok/s (`fd5df938`, eed6cc5; run `bd42cef5ceeb`) and `make test`"
    assert cited(text, 8) == {"fd5df938"} and cited(text, 12) == {"bd42cef5ceeb"}

"""The README's figures, and those of its long form docs/RESULTS.md, cite records by id (`1a2b3c4d`, a record id's
first 8 hex digits) and runs by their 12-digit run id: every one of them must name a record in records/, so a
figure cannot outlive its source."""
import re
from pathlib import Path

from records import store

ROOT = Path(__file__).resolve().parents[1]


def cited(text: str, digits: int) -> set[str]:
    return set(re.findall(rf"`([0-9a-f]{{{digits}}})`", text))


def missing(text: str, records: list[dict]) -> list[str]:
    """The record ids and run ids `text` cites that no record holds."""
    ids = {r["id"][:8] for r in records}
    runs = {r["params"].get("run") for r in records if isinstance(r.get("params"), dict)}
    return sorted((cited(text, 8) - ids) | (cited(text, 12) - runs))


# the README and the long form of its results; each cites records, so the pattern must keep finding some there
CITING = {"README.md": 12, "docs/RESULTS.md": 200}


def test_every_record_the_readme_cites_exists():
    loaded = store.load(root=ROOT / "records")
    assert not loaded.problems, loaded.problems
    for name, least in CITING.items():
        text = (ROOT / name).read_text()
        assert len(cited(text, 8)) > least, name
        assert missing(text, loaded.records) == [], f"{name} cites records or runs that records/ does not hold"


def test_a_citation_without_its_record_is_caught():
    records = [{"id": "fd5df938" + "0" * 24, "params": {"run": "bd42cef5ceeb"}}]
    text = "379.8 tok/s (`fd5df938`, eed6cc5; run `bd42cef5ceeb`), 2.31x (`ca4425d4`), run `0123456789ab`; `make test`"
    assert missing(text, records) == ["0123456789ab", "ca4425d4"]

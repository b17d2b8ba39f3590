"""Bring the records of a run made on another box into this checkout's records.

    python -m records.import_run SRC --commit SHA --note TEXT [--root DEST]

A GPU box runs a copy of the working tree whose own git may be stale or absent, so the commit its records name
cannot be trusted. Whoever sent the tree knows which commit it was: each record of SRC (a records directory from
that copy) that DEST (default: this checkout's records) does not already hold, by id, is appended with `git.commit`
set to that commit and `git.dirty` false (the sender vouches that the tree sent was that commit: commit before
sending) and the box's own view kept under `git.device_reported`, with `git.note` saying which run it was. Every
record is checked before any is appended (`store.line_of`), so a bad one stops the import with nothing written;
records are appended whole through `store.append`; nothing already in DEST changes. Torn or malformed lines of SRC
are reported and skipped, never imported, and counted in the summary line. A record's trace file (`results.trace`,
a path under `reports/traces/` of the tree, as `benchmarks.decompose` writes it) comes along from SRC's tree (the
directory above SRC) into DEST's (the directory above DEST), so the record's path holds here too; a trace that
SRC's tree lacks, or a path outside `reports/traces/`, is reported and not copied.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from records import store


def _check_commit(sha: str) -> None:
    if not re.fullmatch(r"[0-9a-f]{40}", sha):
        raise ValueError(f"--commit must be a full 40-digit hex commit id, got {sha!r}")
    known = subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=store.REPO_ROOT,
                           capture_output=True).returncode == 0
    if not known:
        raise ValueError(f"commit {sha} is not in this repository: import records with the commit whose tree was sent")


def import_run(src: str | Path, commit: str, note: str, root: str | Path | None = None) -> tuple[Counter, list[str]]:
    """Append SRC's records that DEST lacks, attributed to `commit`. Returns (count per kind, problems in SRC)."""
    _check_commit(commit)
    if not note.strip():
        raise ValueError("--note must say which run the records come from")
    src = Path(src)
    if not src.is_dir():
        raise ValueError(f"{src} is not a records directory")
    incoming = store.load(root=src)
    have = {r["id"] for r in store.load(root=root).records}
    counts: Counter = Counter()
    problems = list(incoming.problems)
    new = []
    for r in incoming.records:
        if r["id"] in have:
            continue
        seen = r["git"] or {}
        new.append({**r, "git": {"commit": commit, "dirty": False,
                                 "device_reported": {"commit": seen.get("commit"), "dirty": seen.get("dirty")},
                                 "note": note}})
        have.add(r["id"])
    for r in new:   # all or none: a record append would refuse stops the import before anything is written
        store.line_of(r)
    for r in new:
        store.append(r, root=root)
        counts[r["kind"]] += 1
        trace = (r.get("results") or {}).get("trace")
        if isinstance(trace, str):
            problem = _copy_trace(trace, src.parent, store.records_dir(root).parent)
            if problem:
                problems.append(f"record {r['id'][:8]}: {problem}")
    return counts, problems


def _copy_trace(trace: str, src_tree: Path, dest_tree: Path) -> str | None:
    """Copy the trace file a record names from SRC's tree to DEST's; a problem to report, or None."""
    rel = Path(trace)
    if rel.is_absolute() or ".." in rel.parts or rel.parts[:2] != ("reports", "traces"):
        return f"trace path {trace!r} is not under reports/traces/: not copied"
    if not (src_tree / rel).is_file():
        return f"trace {trace} is not in {src_tree}: the record names a file that did not come back"
    if not (dest_tree / rel).exists():
        (dest_tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_tree / rel, dest_tree / rel)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m records.import_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a records directory from the other box's copy of the tree")
    ap.add_argument("--commit", required=True, help="the full id of the commit whose tree ran there")
    ap.add_argument("--note", required=True, help="which run this was (kept in each record's git.note)")
    ap.add_argument("--root", help="the records directory to append to (default: this checkout's)")
    a = ap.parse_args(argv)
    try:
        counts, problems = import_run(a.src, a.commit, a.note, a.root)
    except ValueError as e:
        print(f"import_run: {e}", file=sys.stderr)
        return 2
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    print(f"imported {sum(counts.values())} record(s)" + "".join(f", {k} {n}" for k, n in sorted(counts.items()))
          + (f"; {len(problems)} problem(s) above, those lines or traces not imported" if problems else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

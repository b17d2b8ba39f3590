"""Bring the records of a run made on another box into this checkout's records.

    python -m records.import_run SRC --commit SHA --note TEXT [--root DEST]

A GPU box runs a copy of the working tree whose own git may be stale or absent, so the commit its records name
cannot be trusted. Whoever sent the tree knows which commit it was: each record of SRC (a records directory from
that copy) that DEST (default: this checkout's records) does not already hold, by id, is appended with `git.commit`
set to that commit and `git.dirty` false (the sender vouches that the tree sent was that commit: commit before
sending) and the box's own view kept under `git.device_reported`, with `git.note` saying which run it was. Every
record is checked before any is appended (`store.line_of`, the store's one validator), so a bad one stops the import
with nothing written; records are appended whole through `store.append`; nothing already in DEST changes. Torn or
malformed lines of SRC are reported and skipped, never imported, and counted in the summary line. A record's trace
file (`results.trace`, a path under `reports/traces/` of the tree, as `benchmarks.decompose` writes it) comes along
from SRC's tree (the directory above SRC) into DEST's (the directory above DEST), so the record's path holds here
too; a trace that SRC's tree lacks is reported and not copied.

Only regular files inside the run's tree are read: a records file or a trace that is a symbolic link (dangling or
not, pointing inside the tree or out of it), or that sits under a linked folder, and a trace path that is absolute,
climbs out with `..` or lies outside `reports/traces/`, make the import refuse, with nothing written: a link could
copy a file from elsewhere on this box into the report. Copied traces get ordinary permissions (0644 less the umask),
whatever mode they had there. Exit status: 0 imported (problems, if any, listed on stderr), 2 refused or could not
write, with one line saying why.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path, PurePosixPath

from records import store


def _check_commit(sha: str) -> None:
    if not re.fullmatch(r"[0-9a-f]{40}", sha):
        raise ValueError(f"--commit must be a full 40-digit hex commit id, got {sha!r}")
    known = subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=store.REPO_ROOT,
                           capture_output=True).returncode == 0
    if not known:
        raise ValueError(f"commit {sha} is not in this repository: import records with the commit whose tree was sent")


class ImportRefused(ValueError):
    """SRC holds something the import does not take (a link, a trace path outside the traces folder); the message
    names the path and what was expected."""


TRACES = ("reports", "traces")  # where a record's trace lies in a tree


def import_run(src: str | Path, commit: str, note: str, root: str | Path | None = None) -> tuple[Counter, list[str]]:
    """Append SRC's records that DEST lacks, attributed to `commit`. Returns (count per kind, problems in SRC).
    Raises ValueError (ImportRefused, store.RecordError) or store.RecordsUnwritable with nothing appended."""
    _check_commit(commit)
    if not note.strip():
        raise ValueError("--note must say which run the records come from")
    src = Path(src).absolute()
    if not src.is_dir():
        raise ValueError(f"{src} is not a records directory")
    for folder in (src, src.parent):    # the run folder and the tree whose traces come along
        if folder.is_symlink():
            raise ImportRefused(f"{folder} is a symbolic link; the import reads only a run folder given as it is")
    for path in sorted(src.glob("*.jsonl")):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ImportRefused(f"{path} is {_what(mode)}; the import reads only regular files inside the run folder")
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
    # all or none: whatever would stop an append, or a trace the import refuses, stops it before anything is written
    for r in new:
        store.line_of(r)
    traces = []
    for r in new:
        trace = _trace_of(r)
        if trace is None:
            continue
        rel = _trace_path(trace, r)
        fd = _regular_inside(src.parent, rel)
        if fd is None:
            problems.append(f"record {r['id'][:8]}: trace {trace} is not in {src.parent}: the record names a file "
                            f"that did not come back")
        else:
            os.close(fd)
            traces.append(rel)
    for kind in sorted({r["kind"] for r in new}):
        store.ensure_writable(kind, root)
    dest_tree = store.records_dir(root).parent
    for rel in traces:  # before the records: a copy that fails leaves no record naming a trace that is not here
        _copy(src.parent, rel, dest_tree)
    for r in new:
        store.append(r, root=root)
        counts[r["kind"]] += 1
    return counts, problems


def _trace_of(r: dict) -> str | None:
    """The trace file a record names (`results.trace`), or None."""
    trace = (r.get("results") or {}).get("trace")
    return trace if isinstance(trace, str) else None


def _trace_path(trace: str, r: dict) -> PurePosixPath:
    """The trace's path inside a tree, or ImportRefused: an absolute path, a `..`, or a path outside
    reports/traces/ would copy a file to, or from, somewhere other than the traces folder."""
    rel = PurePosixPath(trace)
    if rel.is_absolute() or ".." in rel.parts or rel.parts[:2] != TRACES or len(rel.parts) < 3 or "\0" in trace:
        raise ImportRefused(f"record {r['id'][:8]}: results.trace {trace!r} must be a relative path under "
                            f"{'/'.join(TRACES)}/ without '..'")
    return rel


def _what(mode: int) -> str:
    return "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def _regular_inside(tree: Path, rel: PurePosixPath) -> int | None:
    """An open descriptor of regular file `tree/rel`, reached without following any link, or None where a part of
    the path does not exist; ImportRefused where a part of it is a link or the file is not a regular file."""
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(rel.parts):
            here = tree.joinpath(*rel.parts[:i + 1])
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                mode = st.st_mode
            except FileNotFoundError:
                return None
            last = i == len(rel.parts) - 1
            if last and stat.S_ISREG(mode) and st.st_nlink > 1:
                raise ImportRefused(f"{here} has {st.st_nlink} hard links; the import copies only files that are "
                                    f"the run folder's own (a hard link can be a file elsewhere on this box)")
            if stat.S_ISLNK(mode) or (last and not stat.S_ISREG(mode)) or (not last and not stat.S_ISDIR(mode)):
                raise ImportRefused(f"{here} is {_what(mode)}; the import copies only regular files inside the run "
                                    f"folder, never through a link (it could name a file elsewhere on this box)")
            try:  # O_NOFOLLOW: a part swapped for a link since the check above fails here instead of being followed
                nxt = os.open(part, (os.O_RDONLY if last else os.O_RDONLY | os.O_DIRECTORY) | os.O_NOFOLLOW,
                              dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ImportRefused(f"{here} became a link while the import read it; refused") from e
                raise
            os.close(fd)
            fd = nxt
        return os.dup(fd)
    finally:
        os.close(fd)


def _copy(src_tree: Path, rel: PurePosixPath, dest_tree: Path) -> None:
    """Copy trace `rel` from SRC's tree to DEST's, unless DEST's has it: a new file of ordinary permissions, never
    written through a link (O_EXCL | O_NOFOLLOW); a copy cut short is removed."""
    dest = dest_tree.joinpath(*rel.parts)
    if os.path.lexists(dest):
        return
    fd = _regular_inside(src_tree, rel)
    if fd is None:
        return
    with open(fd, "rb") as fin:
        dest.parent.mkdir(parents=True, exist_ok=True)
        for part in (dest.parent, *dest.parent.parents):
            if part == dest_tree:
                break
            if part.is_symlink():
                raise ImportRefused(f"{part} is a symbolic link; traces are never written through one")
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with open(out, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m records.import_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a records directory from the other box's copy of the tree")
    ap.add_argument("--commit", required=True, help="the full id of the commit whose tree ran there")
    ap.add_argument("--note", required=True, help="which run this was (kept in each record's git.note)")
    ap.add_argument("--root", help="the records directory to append to (default: this checkout's)")
    a = ap.parse_args(argv)
    try:
        counts, problems = import_run(a.src, a.commit, a.note, a.root)
    except (ValueError, store.RecordsUnwritable) as e:
        print(f"import_run: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # SRC or DEST's tree cannot be read or written
        print(f"import_run: {e.filename or a.src}: {e.strerror or e}; no record was imported", file=sys.stderr)
        return 2
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    print(f"imported {sum(counts.values())} record(s)" + "".join(f", {k} {n}" for k, n in sorted(counts.items()))
          + (f"; {len(problems)} problem(s) above, those lines or traces not imported" if problems else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

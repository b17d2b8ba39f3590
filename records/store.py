"""Append-only records: one JSON object per line in `<records dir>/<kind>.jsonl`.

Every measurement the suite makes (gate scores, benchmarks, memory events) becomes one record that
carries its own provenance (git commit, machine, library versions), so a number can always be traced
back to the code and the box that produced it.

Writers from many processes append concurrently: each record goes out as one `os.write` under an
exclusive `flock`, so lines never interleave. A writer killed mid-line leaves a torn last line; the
next append starts on a fresh line and `load` reports the torn one instead of failing.

Every record read or written is checked by `validate_record`: the shape of each required field, a bounded nesting
depth, and its git, machine, params and results by the schema of its kind and version (`records.schema`: version 2,
what `make_record` writes, declares every field with its type; version 1, the records written before it, is
checked by the rules it was written under). `load` skips a line that fails, saying where and why, so no line can
take the report down; `append` refuses to write one (`RecordError`, naming the kind, the field, what was expected
and what was found), and a records folder or file that cannot be written raises `RecordsUnwritable`, naming the
path.

Non-finite floats (NaN, inf) are not valid JSON. `make_record` stores them as null, adds a reason
naming the field, and marks the record INVALID: the record is kept (a long run is not lost at its
last step) and can never be mistaken for a valid measurement. `append` refuses a record that still
holds one (`ValueError`), so a hand-built record cannot slip non-JSON into the files.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import json
import math
import os
import platform
import socket
import stat
import subprocess
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from records import schema

SCHEMA = schema.VERSION  # the schema version make_record writes; records of every version in schema.VERSIONS load
# `erratum`: records are never edited; a later erratum names an earlier record (params.record) and the fields
# of it that must not be used (params.fields), with the reason (results.reason). The report honours it.
KINDS = frozenset(schema.KINDS)
VERDICTS = frozenset({"VALID", "INVALID"})
REQUIRED_FIELDS = ("schema", "id", "time", "kind", "git", "machine", "preset", "dtype", "device", "weights",
                   "params", "results", "verdict", "reasons")

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_DEPTH = 32  # objects and arrays a record may nest (the suite's records nest 6 deep): bounded, so reading one
# back can never exhaust Python's recursion limit
TIME_YEARS = (1970, 2261)  # a record's time lies in these years: the loaded table holds times as pandas timestamps,
# which end in 2262
MIN_FREE_BYTES = 1 << 20  # free space `ensure_writable` asks of the records folder's file system: a few records


class RecordError(ValueError):
    """A record that is not of the record shape; the message names the record, the field and what was expected."""


class RecordsUnwritable(RuntimeError):
    """The records folder or a records file cannot be written; the message names the path and the reason."""


def records_dir(root: str | Path | None = None) -> Path:
    """The directory holding the `<kind>.jsonl` files: `root`, else $KIMI_RECORDS_DIR, else <repo>/records."""
    if root is not None:
        return Path(root)
    return Path(os.environ.get("KIMI_RECORDS_DIR") or REPO_ROOT / "records")


# ---- provenance ------------------------------------------------------------------------------

def git(*args: str) -> str | None:
    """`git ARGS` in the checkout: its stdout, or None where git fails or is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


# What the suite writes into its own tree: the records, the rendered report and its figures, the profiler traces.
OUTPUTS = ("records/*.jsonl", "reports/index.html", "reports/SUMMARY.md", "reports/figures/*", "reports/traces/*")


def _git_state() -> dict:
    commit = git("rev-parse", "--verify", "-q", "HEAD")
    # The records files live in the tree, and so do the report and the traces rendered from them: writing them (a
    # nightly appends records, writes a trace, renders the report) must not make the next record "dirty".
    status = git("status", "--porcelain", "--", ".", *(f":(exclude){p}" for p in OUTPUTS))
    state = {"commit": commit.strip() if commit else None, "dirty": None if status is None else bool(status.strip())}
    # A copy of the tree run elsewhere (the GPU box) may have no usable git: whoever sent it names the commit.
    if state["commit"] is None and os.environ.get("KIMI_GIT_COMMIT"):
        state.update(commit=os.environ["KIMI_GIT_COMMIT"], commit_source="KIMI_GIT_COMMIT")
    return state


def _nvml_gpu() -> tuple[str | None, str | None]:
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None, None
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # no library, no driver, no device: a CPU box
        return None, None
    # older pynvml releases return bytes
    return tuple(s.decode() if isinstance(s, bytes) else s for s in (name, driver))


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _torch_cuda() -> str | None:
    try:
        import torch

        return torch.version.cuda
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def provenance() -> dict:
    """Where a record comes from: git state and machine. Never raises; unknown facts are None. Cached per process."""
    gpu, driver = _nvml_gpu()
    return {
        "git": _git_state(),
        "machine": {
            "host": socket.gethostname(),
            "gpu": gpu,
            "driver": driver,
            "cuda": _torch_cuda(),
            "torch": _version("torch"),
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "python": platform.python_version(),
            "cpu": _cpu_name(),
        },
    }


# ---- building a record -----------------------------------------------------------------------

def _plain(x, where: str, nonfinite: list[str]):
    """`x` as plain JSON values; numpy/torch scalars become Python numbers, non-finite floats None."""
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        nonfinite.append(f"{where} was {x}; stored as null")
        return None
    if isinstance(x, dict):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has non-string keys {bad!r}; JSON object keys must be strings")
        return {k: _plain(v, f"{where}.{k}", nonfinite) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", nonfinite) for i, v in enumerate(x)]
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):  # numpy scalar, 0-d array or 0-d torch tensor
        return _plain(x.item(), where, nonfinite)
    # Arrays are refused rather than dumped: a stray activation tensor must not bloat the records.
    raise TypeError(f"{where} is a {type(x).__module__}.{type(x).__qualname__}, which is not JSON-serialisable; "
                    f"pass plain numbers/strings/lists (convert arrays with .tolist())")


def _check_kind_verdict(kind, verdict, reasons) -> None:
    if kind not in KINDS:
        raise ValueError(f"record kind {kind!r} is unknown; known kinds: {', '.join(sorted(KINDS))}")
    if verdict not in VERDICTS:
        raise ValueError(f"record verdict {verdict!r} must be 'VALID' or 'INVALID'")
    if not isinstance(reasons, (list, tuple)) or not all(isinstance(r, str) and r for r in reasons):
        raise TypeError(f"record reasons must be a list of non-empty strings, got {reasons!r}")
    if verdict == "INVALID" and not reasons:
        raise ValueError("an INVALID record needs at least one reason")


def make_record(kind: str, *, preset: str | None, dtype: str | None, device: str | None, weights: str | None,
                params: dict, results: dict, verdict: str = "VALID", reasons=()) -> dict:
    """A complete record with schema, id, time and provenance filled in; validated, not yet written."""
    _check_kind_verdict(kind, verdict, reasons)
    reasons = list(reasons)
    for name, value in (("params", params), ("results", results)):
        if not isinstance(value, dict):
            raise TypeError(f"record {name} must be a dict, got {type(value).__name__}")
    for name, value in (("preset", preset), ("dtype", dtype), ("device", device), ("weights", weights)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"record {name} must be a string or None, got {type(value).__name__} {value!r}")
    nonfinite: list[str] = []
    params = _plain(params, "params", nonfinite)
    results = _plain(results, "results", nonfinite)
    if nonfinite:
        verdict, reasons = "INVALID", reasons + nonfinite
    prov = provenance()
    return {
        "schema": SCHEMA, "id": uuid.uuid4().hex, "time": datetime.now(timezone.utc).isoformat(),
        "kind": kind, "git": dict(prov["git"]), "machine": dict(prov["machine"]),
        "preset": preset, "dtype": dtype, "device": device, "weights": weights,
        "params": params, "results": results, "verdict": verdict, "reasons": reasons,
    }


# ---- checking a record ------------------------------------------------------------------------

_brief, _cut = schema.brief, schema.cut


def _walk(record: dict) -> list[str]:
    """Problems anywhere in the record: nesting past MAX_DEPTH, a NaN or inf (JSON has none), a value JSON cannot
    carry (a set, a non-string key), a string that UTF-8 cannot carry (a lone surrogate). Iterative, so that it
    cannot itself exhaust the recursion limit on a deep record."""
    problems: dict[str, str] = {}
    stack = [("", record, 0)]
    while stack:
        where, x, depth = stack.pop()
        name = _cut(where.lstrip(".")) or "the record"
        if isinstance(x, (dict, list, tuple)):
            if depth >= MAX_DEPTH:
                problems.setdefault("depth", f"{name} nests deeper than {MAX_DEPTH} objects and arrays; expected "
                                             f"at most {MAX_DEPTH}")
                continue
            for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
                if isinstance(x, dict) and not isinstance(k, str):
                    problems.setdefault("key", f"{name} has a key {_brief(k)}; JSON object keys are strings")
                elif isinstance(x, dict) and not _utf8(k):
                    problems.setdefault("utf8", f"{name} has a key holding a lone surrogate, which UTF-8 cannot "
                                                f"carry")
                stack.append((f"{where}.{k}" if isinstance(x, dict) else f"{where}[{k}]", v, depth + 1))
        elif isinstance(x, float) and not math.isfinite(x):
            problems.setdefault("nonfinite", f"{name} holds a NaN or inf ({x}), which JSON cannot carry; "
                                             f"make_record stores such values as null")
        elif isinstance(x, str) and not _utf8(x):
            problems.setdefault("utf8", f"{name} holds a lone surrogate, which UTF-8 cannot carry")
        elif not (x is None or isinstance(x, (bool, int, float, str))):
            problems.setdefault("type", f"{name} is a {type(x).__module__}.{type(x).__qualname__}, not a JSON value")
    return list(problems.values())


def _utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _time_problem(t) -> str | None:
    if not isinstance(t, str):
        return f"time must be an ISO-8601 string with a UTC offset, got {_brief(t)}"
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        return f"time must be an ISO-8601 string with a UTC offset, got {_brief(t)}"
    if when.utcoffset() is None:
        return f"time {_brief(t)} has no UTC offset; expected one (the store writes UTC times)"
    if not TIME_YEARS[0] <= when.year <= TIME_YEARS[1]:
        return f"time {_brief(t)} is outside the years {TIME_YEARS[0]} to {TIME_YEARS[1]}"
    return None


def validate_record(rec) -> list[str]:
    """What is wrong with `rec` as a record, one line per problem naming the field and what was expected; empty for
    a record the report can read. `load` skips a line with problems, `line_of` (and so `append`) refuses one."""
    if not isinstance(rec, dict):
        return [f"a JSON {_brief(rec).split()[0]}, not a record object"]
    missing = [f for f in REQUIRED_FIELDS if f not in rec]
    if missing:
        return [f"record lacks fields {', '.join(missing)}; build records with make_record"]
    problems = _walk(rec)
    if any("nests deeper" in p for p in problems):
        return problems  # the field checks below would walk the same depth
    version = rec["schema"] if type(rec["schema"]) is int and rec["schema"] in schema.VERSIONS else None
    if version is None:
        problems.append(f"schema must be one of {', '.join(map(str, schema.VERSIONS))}, got {_brief(rec['schema'])}")
    if not isinstance(rec["id"], str) or not rec["id"]:
        problems.append(f"id must be a non-empty string, got {_brief(rec['id'])}")
    if (why := _time_problem(rec["time"])) is not None:
        problems.append(why)
    if not isinstance(rec["kind"], str) or rec["kind"] not in KINDS:
        problems.append(f"record kind {_brief(rec['kind'])} is unknown; known kinds: {', '.join(sorted(KINDS))}")
    for name in ("git", "machine", "params", "results"):
        if not isinstance(rec[name], dict):
            problems.append(f"{name} must be an object, got {_brief(rec[name])}")
    for name in ("preset", "dtype", "device", "weights"):
        if rec[name] is not None and not isinstance(rec[name], str):
            problems.append(f"{name} must be a string or null, got {_brief(rec[name])}")
    if not isinstance(rec["verdict"], str) or rec["verdict"] not in VERDICTS:
        problems.append(f"record verdict {_brief(rec['verdict'])} must be 'VALID' or 'INVALID'")
    reasons = rec["reasons"]
    if not isinstance(reasons, list) or not all(isinstance(r, str) and r for r in reasons):
        problems.append(f"record reasons must be a list of non-empty strings, got {_brief(reasons)}")
    elif rec["verdict"] == "INVALID" and not reasons:
        problems.append("an INVALID record needs at least one reason")
    if version == 1:
        problems += schema.v1_problems(rec)
    elif version is not None:
        problems += schema.problems(rec)
    return problems


# ---- writing ---------------------------------------------------------------------------------

def line_of(record: dict) -> bytes:
    """The line `append` writes for `record`, or a RecordError (a ValueError) saying why it cannot be one: whatever
    `validate_record` finds (a missing field, an unknown kind, a NaN, a field of the wrong shape). A batch checks
    every record with it before writing any."""
    problems = validate_record(record)
    rid = record.get("id") if isinstance(record, dict) else None
    rid = rid if isinstance(rid, str) else "?"
    if problems:
        raise RecordError(f"record {rid}: {'; '.join(problems)}")
    try:
        return json.dumps(record, allow_nan=False, separators=(",", ":")).encode() + b"\n"
    except (TypeError, ValueError) as e:  # what the checks above cannot foresee (an integer past the digit limit)
        raise RecordError(f"record {rid}: cannot be written as JSON: {e}") from e


def _file_for(kind: str, root) -> Path:
    if kind not in KINDS:
        raise ValueError(f"record kind {kind!r} is unknown; known kinds: {', '.join(sorted(KINDS))}")
    return records_dir(root) / f"{kind}.jsonl"


def ensure_writable(kind: str, root: str | Path | None = None) -> Path:
    """Check, before a run starts, that `<records dir>/<kind>.jsonl` can be appended to (the folder exists or can be
    made, is writable, the file if present is a regular writable file, some free space); return its path, else raise
    RecordsUnwritable. Creates nothing: a check that fails must leave no folder or empty file behind."""
    path = _file_for(kind, root)
    d = path.parent
    existing = d
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent  # the nearest folder that exists: the one the records folder would be made in
    if not existing.is_dir():
        raise RecordsUnwritable(f"{d}: cannot be made or used as the records folder: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the records folder" if existing == d else f"the folder {existing}, where it would be made,"
        raise RecordsUnwritable(f"{path}: cannot be written: {what} is not writable")
    if os.path.lexists(path):
        try:
            st = os.stat(path)
        except OSError as e:
            raise RecordsUnwritable(f"{path}: cannot be read for appending: {e.strerror or e}") from e
        if not stat.S_ISREG(st.st_mode):
            raise RecordsUnwritable(f"{path}: is not a regular file; expected the records file or nothing")
        if not os.access(path, os.W_OK):
            raise RecordsUnwritable(f"{path}: is not writable")
    try:
        fs = os.statvfs(existing)
    except OSError as e:
        raise RecordsUnwritable(f"{path}: cannot tell the free space of {existing}: {e.strerror or e}") from e
    free = fs.f_bavail * fs.f_frsize
    if free < MIN_FREE_BYTES:
        raise RecordsUnwritable(f"{path}: only {free} bytes free on its file system; expected at least "
                                f"{MIN_FREE_BYTES}")
    return path


def append(record: dict, root: str | Path | None = None) -> Path:
    """Append `record` as one line to `<kind>.jsonl`, whole, under an exclusive lock, fsynced. Returns the path.

    A record `validate_record` finds fault with raises RecordError before anything is written; a folder or file
    that cannot be written (read-only, no space, no permission) raises RecordsUnwritable naming the path, and what
    this call wrote of its line is cut off again, so no torn line is left where that can be helped."""
    line = line_of(record)
    path = _file_for(record["kind"], root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise RecordsUnwritable(f"{path}: cannot be opened for appending: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # a torn previous line stays torn; it must not swallow this record
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"short write, {written} of {len(line)} bytes (disk full?)")
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, size)  # under the lock: only this call's bytes are cut
            except OSError:
                pass
            raise
    except OSError as e:
        raise RecordsUnwritable(f"{path}: the record could not be appended: {e.strerror or e}") from e
    finally:
        os.close(fd)  # closing releases the lock
    return path


# ---- reading ---------------------------------------------------------------------------------

@dataclass
class Loaded:
    df: pd.DataFrame  # one row per record, nested fields flattened (`results.tok_s`), sorted by time
    records: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "path:line: what is wrong; skipped"


def _read_locked(path: Path) -> bytes:
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # a reader never sees a half-written line of a live writer
        return f.read()


def shown_path(path: str | Path) -> str:
    """`path` relative to the checkout where it lies inside it (what records and messages show: no machine's
    folders), else as given."""
    path = Path(path)
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except (ValueError, OSError, RuntimeError):  # outside the checkout; a link loop
        return str(path)


def get(record: dict, dotted: str, default=None):
    """A record's field by dotted path ('results.tok_s'), or `default` where any part is missing or None."""
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return default
        value = value[part]
    return value


def _lines(path: Path) -> tuple[list[bytes], str | None]:
    """The lines of one records file, or a problem saying why it cannot be read (a folder, a pipe, no permission)."""
    if not path.is_file():
        return [], f"{shown_path(path)}: not a regular file; skipped"
    try:
        return _read_locked(path).split(b"\n"), None
    except OSError as e:
        return [], f"{shown_path(path)}: cannot be read ({e.strerror or e}); skipped"


def load(kinds=None, root: str | Path | None = None) -> Loaded:
    """Every record of `kinds` (default: all files present). Lines that are not records `validate_record` accepts
    are reported in `problems` ("file:line: why; skipped"), never raised: any file's contents can be loaded."""
    d = records_dir(root)
    if kinds is None:
        paths = sorted(d.glob("*.jsonl"))
    else:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown record kinds {unknown}; known kinds: {', '.join(sorted(KINDS))}")
        paths = [d / f"{k}.jsonl" for k in kinds if os.path.lexists(d / f"{k}.jsonl")]
    records, problems = [], []
    for path in paths:
        lines, problem = _lines(path)
        if problem:
            problems.append(problem)
        for n, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            where = f"{shown_path(path)}:{n}"
            try:
                rec = json.loads(raw)
            except RecursionError:
                problems.append(f"{where}: nested deeper than JSON can be read here; expected at most {MAX_DEPTH} "
                                f"objects and arrays; skipped")
                continue
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's digit limit
                problems.append(f"{where}: torn or invalid JSON line ({e}); skipped")
                continue
            wrong = validate_record(rec)
            if wrong:
                problems.append(f"{where}: {'; '.join(wrong)}; skipped")
                continue
            if rec["kind"] != path.stem:
                problems.append(f"{where}: record of kind {rec['kind']!r} in the {path.stem!r} file; skipped")
                continue
            records.append(rec)
    records.sort(key=lambda r: r["time"])
    df = pd.json_normalize(records) if records else pd.DataFrame(columns=list(REQUIRED_FIELDS))
    if records:  # parsed one by one: fromisoformat reads forms pandas' ISO8601 parser does not
        df["time"] = pd.to_datetime([datetime.fromisoformat(r["time"]) for r in records], utc=True)
    return Loaded(df=df, records=records, problems=problems)

"""Append-only records: one JSON object per line in `<records dir>/<kind>.jsonl`.

Every measurement the suite makes (gate scores, benchmarks, memory events) becomes one record that
carries its own provenance (git commit, machine, library versions), so a number can always be traced
back to the code and the box that produced it.

Writers from many processes append concurrently: each record goes out as one `os.write` under an
exclusive `flock`, so lines never interleave. A writer killed mid-line leaves a torn last line; the
next append starts on a fresh line and `load` reports the torn one instead of failing.

Non-finite floats (NaN, inf) are not valid JSON. `make_record` stores them as null, adds a reason
naming the field, and marks the record INVALID: the record is kept (a long run is not lost at its
last step) and can never be mistaken for a valid measurement. `append` refuses a record that still
holds one (`ValueError`), so a hand-built record cannot slip non-JSON into the files.
"""
from __future__ import annotations

import fcntl
import functools
import json
import math
import os
import platform
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

SCHEMA = 1
# `erratum`: records are never edited; a later erratum names an earlier record (params.record) and the fields
# of it that must not be used (params.fields), with the reason (results.reason). The report honours it.
KINDS = frozenset({"gate_a", "gate_b", "memory", "bench", "kernel", "decomposition", "nightly", "erratum"})
VERDICTS = frozenset({"VALID", "INVALID"})
REQUIRED_FIELDS = ("schema", "id", "time", "kind", "git", "machine", "preset", "dtype", "device", "weights",
                   "params", "results", "verdict", "reasons")

REPO_ROOT = Path(__file__).resolve().parent.parent


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


# ---- writing ---------------------------------------------------------------------------------

def line_of(record: dict) -> bytes:
    """The line `append` writes for `record`, or a ValueError saying why it cannot be one: a missing field, a kind
    or verdict it does not know, a NaN (JSON has none). A batch checks every record with it before writing any."""
    missing = [f for f in REQUIRED_FIELDS if f not in record]
    if missing:
        raise ValueError(f"record lacks fields {', '.join(missing)}; build records with make_record")
    _check_kind_verdict(record["kind"], record["verdict"], record["reasons"])
    try:
        return json.dumps(record, allow_nan=False, separators=(",", ":")).encode() + b"\n"
    except ValueError as e:
        raise ValueError(f"record {record['id']} holds a NaN or inf, which JSON cannot carry ({e}); "
                         f"make_record stores such values as null") from e


def append(record: dict, root: str | Path | None = None) -> Path:
    """Append `record` as one line to `<kind>.jsonl`, whole, under an exclusive lock, fsynced. Returns the path."""
    line = line_of(record)
    d = records_dir(root)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{record['kind']}.jsonl"
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # a torn previous line stays torn; it must not swallow this record
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes (disk full?)")
        os.fsync(fd)
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


def _shown(path: Path) -> Path:
    try:
        return path.resolve().relative_to(REPO_ROOT)
    except ValueError:
        return path


def get(record: dict, dotted: str, default=None):
    """A record's field by dotted path ('results.tok_s'), or `default` where any part is missing or None."""
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return default
        value = value[part]
    return value


def load(kinds=None, root: str | Path | None = None) -> Loaded:
    """Every record of `kinds` (default: all files present). Bad lines are reported in `problems`, never raised."""
    d = records_dir(root)
    if kinds is None:
        paths = sorted(d.glob("*.jsonl"))
    else:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown record kinds {unknown}; known kinds: {', '.join(sorted(KINDS))}")
        paths = [d / f"{k}.jsonl" for k in kinds if (d / f"{k}.jsonl").exists()]
    records, problems = [], []
    for path in paths:
        for n, raw in enumerate(_read_locked(path).split(b"\n"), start=1):
            if not raw.strip():
                continue
            where = f"{_shown(path)}:{n}"
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                problems.append(f"{where}: torn or invalid JSON line ({e}); skipped")
                continue
            if not isinstance(rec, dict):
                problems.append(f"{where}: a JSON {type(rec).__name__}, not a record object; skipped")
                continue
            missing = [f for f in REQUIRED_FIELDS if f not in rec]
            if missing:
                problems.append(f"{where}: record lacks fields {', '.join(missing)}; skipped")
                continue
            if rec["kind"] != path.stem:
                problems.append(f"{where}: record of kind {rec['kind']!r} in the {path.stem!r} file; skipped")
                continue
            records.append(rec)
    records.sort(key=lambda r: str(r["time"]))
    df = pd.json_normalize(records) if records else pd.DataFrame(columns=list(REQUIRED_FIELDS))
    if records:
        df["time"] = pd.to_datetime(df["time"], utc=True, format="ISO8601")
    return Loaded(df=df, records=records, problems=problems)

"""The nightly run: gates, benchmarks and decomposition on whatever box this is, then regression checks
against this machine's own history, a summary, a `nightly` record, and the rendered report.

`python -m reports.nightly [--records DIR] [--out DIR] [--preset P] [--steps A,B] [--step-timeout S]`. On a
CPU the gates run their default (the reference checkpoint) and the benchmarks their `--quick` form (tiny). On a
GPU each step takes its own default unless `--preset` is given: the gates `48b-a3b` over as few GPUs as hold it
(else they refuse), the benchmarks and the decomposition `48b-a3b`; the record names the gates' model. Each step
runs in its own process, so a crash or an out-of-memory in one step cannot take the others down and device
memory is returned between steps; a step still running after `--step-timeout` seconds (a hung kernel, a wedged
device) is killed with its process group and counts as failed. Each step's output is shown as it comes, each
line behind the step's name, and kept whole in `<logs>/<step>.log`; the record names that folder and keeps a
failed step's last lines. The regression check judges the bench records this run wrote, each against the earlier
runs of its machine and configuration (none written: nothing judged). A gate that records a skip (the memory gate
without a GPU) shows as skipped: it holds nothing, and fails nothing. Exit status: 0 when every gate held, every
step ran and no benchmark regressed; 1 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from records import store
from records.exits import run_main
from records.schema import MEMORY, RECORD

from . import regress

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 15
# Generous for the 48B box: the longest step there (bench, with HF transformers decoding at ~7 tok/s as its
# peer) is the one this must not cut short; a hung step is what it is for.
STEP_TIMEOUT_S = 3 * 3600


@dataclass
class Step:
    name: str
    argv: list[str]
    gate: bool = False             # a failing gate fails the nightly; other steps fail it only if they crash
    returncode: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    skipped: bool = False          # the step ran and recorded that it could not judge here (results.decision)
    tail: str = ""


@dataclass
class Verdict:
    ok: bool
    lines: list[str] = field(default_factory=list)


def on_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def plan(preset: str | None, gpu: bool, out: Path) -> list[Step]:
    py = [sys.executable, "-m"]
    flags = ["--preset", preset] if preset else []
    quick = [] if gpu else ["--quick"]
    steps = [Step("gate-a", py + ["gates", "gate-a"] + flags, gate=True),
             Step("gate-b", py + ["gates", "gate-b"] + flags, gate=True),
             Step("gate-memory", py + ["gates", "gate-memory"] + flags, gate=True),
             Step("bench", py + ["benchmarks.bench_e2e"] + flags + quick),
             Step("decompose", py + ["benchmarks.decompose", "--trace-dir", str(out / "traces")] + flags + quick)]
    if gpu:
        steps.append(Step("bench-kernels", py + ["benchmarks.kernels"]))
    return steps


def select(steps: list[Step], names: str | None) -> list[Step]:
    """The steps named in `names` (comma-separated), in the plan's order; an unknown name is refused."""
    if not names:
        return steps
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {s.name for s in steps})
    if unknown or not wanted:
        raise SystemExit(f"nightly: {'no step named ' + ', '.join(unknown) if unknown else '--steps names no step'}; "
                         f"this box's steps are {', '.join(s.name for s in steps)}")
    return [s for s in steps if s.name in wanted]


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def run(step: Step, env: dict, logs: Path, timeout_s: float) -> Step:
    """Run one step in its own process group: its output streamed line by line behind its name and written whole
    to `logs/<name>.log`; killed, group and all, once it has run `timeout_s` seconds."""
    print(f"[nightly] {step.name}: {' '.join(step.argv[1:])}", flush=True)
    tail = collections.deque(maxlen=TAIL_LINES)
    t0 = time.perf_counter()
    with open(logs / f"{step.name}.log", "w") as log:
        proc = subprocess.Popen(step.argv, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

        def kill():
            if proc.poll() is None:
                step.timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)   # the group: a grandchild holding the pipe goes too

        watchdog = threading.Timer(timeout_s, kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip("\n"))
                print(f"[{step.name}] {line}", end="", flush=True)
            proc.wait()
        finally:
            watchdog.cancel()
    step.seconds, step.returncode = time.perf_counter() - t0, proc.returncode
    step.tail = "\n".join(tail)
    how = f"killed (--step-timeout {timeout_s:g} s)" if step.timed_out else f"exit {step.returncode}"
    print(f"[nightly] {step.name}: {how} after {step.seconds:.1f} s", flush=True)
    return step


def same_machine(records: list[dict], host: str, gpu) -> list[dict]:
    return [r for r in records if RECORD.machine.host.get(r) == host and RECORD.machine.gpu.get(r) == gpu]


def mark_skips(steps: list[Step], new: list[dict]) -> None:
    """A step whose run wrote a record with results.decision == "skipped" (the memory gate without a GPU) is
    skipped, not ok: it exits 0 and judged nothing. Records name no step, so each gate step is matched to its
    records' kind."""
    from gates.run import RECORD_KINDS as kinds   # the record kind each gate command appends
    for s in steps:
        s.skipped = s.returncode == 0 and any(r.get("kind") == kinds.get(s.name) and
                                              MEMORY.results.decision.get(r) == "skipped" for r in new)


def step_status(returncode: int | None, gate: bool, timed_out: bool, skipped: bool = False) -> str:
    """ok; skipped (ran, judged nothing); FAIL (a gate that did not hold); CRASHED (another step's nonzero exit);
    TIMEOUT (killed)."""
    if timed_out:
        return "TIMEOUT"
    if returncode == 0:
        return "skipped" if skipped else "ok"
    return "FAIL" if gate else "CRASHED"


def judge(steps: list[Step], regressions: list[regress.Regression]) -> Verdict:
    v = Verdict(ok=True)
    for s in steps:
        what = step_status(s.returncode, s.gate, s.timed_out, s.skipped)
        v.lines.append(f"{s.name:<14} {what:<8} exit {s.returncode}  {s.seconds:6.1f} s")
        v.ok &= s.returncode == 0
    if not regressions:
        v.lines.append("regression check: no bench record written by this run, nothing judged")
    for r in regressions:
        v.lines.append(f"{'REGRESSION' if r.verdict == 'regression' else r.verdict:<20} "
                       f"{regress.describe(r.key)}: {r.message}")
        v.ok &= r.verdict != "regression"
    return v


def main(argv: list[str] | None = None, steps: list[Step] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", help="records directory (default: the store's)")
    ap.add_argument("--out", default=str(ROOT / "reports"), help="where the report is rendered")
    ap.add_argument("--preset", help="default: each step's own (on a CPU the gates' reference checkpoint and tiny "
                                     "benchmarks; on a GPU 48b-a3b)")
    ap.add_argument("--steps", help="comma-separated steps to run, of gate-a, gate-b, gate-memory, bench, "
                                    "decompose and (on a GPU) bench-kernels; default: all")
    ap.add_argument("--step-timeout", type=positive_seconds, default=STEP_TIMEOUT_S,
                    help=f"seconds after which a step is killed and fails (default {STEP_TIMEOUT_S})")
    ap.add_argument("--logs", help="folder for each step's whole output (default: out/nightly/<UTC time> "
                                   "under the repository)")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    if args.records:
        env["KIMI_RECORDS_DIR"] = str(Path(args.records).resolve())
    gpu = on_gpu()
    steps = select(steps if steps is not None else plan(args.preset, gpu, Path(args.out)), args.steps)
    logs = Path(args.logs or ROOT / "out" / "nightly" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[nightly] {len(steps)} step(s); each one's whole output goes to {logs}", flush=True)
    before = {r["id"] for r in store.load(root=args.records).records}
    steps = [run(s, env, logs, args.step_timeout) for s in steps]

    loaded = store.load(root=args.records)
    new = [r for r in loaded.records if r["id"] not in before]
    mark_skips(steps, new)
    prov = store.provenance()["machine"]
    mine = same_machine(loaded.records, prov["host"], prov["gpu"])
    # tonight's bench records, each against its history; a configuration bench did not measure tonight (the step
    # not selected, or crashed before it wrote) is not judged again on an old record
    tonight = {r["id"] for r in new}
    regressions = [g for g in regress.check_latest([r for r in mine if r.get("kind") == "bench"])
                   if g.record_id in tonight]
    verdict = judge(steps, regressions)

    ran = [r["preset"] for r in new if r.get("kind") in ("gate_a", "gate_b")]   # what the gates chose
    rec = store.make_record(
        "nightly", preset=args.preset or (ran[0] if ran else "48b-a3b" if gpu else "tiny"), dtype="default",
        device="cuda" if gpu else "cpu", weights="see step records",
        params={"steps": [s.name for s in steps], "step_timeout_s": args.step_timeout, "logs": str(logs)},
        results={"passed": verdict.ok,
                 "steps": {s.name: {"returncode": s.returncode, "seconds": round(s.seconds, 2), "gate": s.gate,
                                    "timed_out": s.timed_out, "skipped": s.skipped,
                                    **({"tail": s.tail} if s.returncode != 0 else {})}
                           for s in steps},
                 "regressions": [{"key": list(r.key), "verdict": r.verdict, "ratio": r.ratio,
                                  "p_value": r.p_value, "record": r.record_id, "message": r.message}
                                 for r in regressions]},
        verdict="VALID")
    store.append(rec, root=args.records)

    try:
        from .render import render
        render(records_root=args.records, out=args.out)
        report = f"report rendered into {args.out}"
    except Exception as e:  # the verdict stands even when the report cannot be drawn
        verdict.ok = False
        report = f"report NOT rendered: {type(e).__name__}: {e}"

    print("\n== nightly summary ==")
    for line in verdict.lines:
        print(line)
    print(f"step logs in {logs}")
    print(report)
    print(f"NIGHTLY {'PASS' if verdict.ok else 'FAIL'}  (record {rec['id'][:8]})")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(run_main(main))

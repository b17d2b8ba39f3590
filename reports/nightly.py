"""The nightly run: gates, benchmarks and decomposition on whatever box this is, then regression checks
against this machine's own history, a summary, a `nightly` record, and the rendered report.

`python -m reports.nightly [--records DIR] [--out DIR] [--preset P]`. On a CPU it runs the `tiny` preset
(benchmarks in their `--quick` form); on a GPU that fits it, `48b-a3b`. Each step runs in its own process,
so a crash or an out-of-memory in one step cannot take the others down and device memory is returned
between steps. Exit status: 0 when every gate held, every step ran and no benchmark regressed; 1 otherwise.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from records import store

from . import regress

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    name: str
    argv: list[str]
    gate: bool = False             # a failing gate fails the nightly; other steps fail it only if they crash
    returncode: int | None = None
    seconds: float = 0.0
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
        steps.append(Step("bench-kernels", py + ["benchmarks.bench_kernels"]))
    return steps


def run(step: Step, env: dict) -> Step:
    print(f"[nightly] {step.name}: {' '.join(step.argv[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(step.argv, cwd=ROOT, env=env, capture_output=True, text=True)
    step.seconds, step.returncode = time.perf_counter() - t0, proc.returncode
    step.tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    print(f"[nightly] {step.name}: exit {step.returncode} after {step.seconds:.1f} s", flush=True)
    if step.returncode != 0:
        print(step.tail, flush=True)
    return step


def same_machine(records: list[dict], host: str, gpu) -> list[dict]:
    return [r for r in records if r.get("machine", {}).get("host") == host and r.get("machine", {}).get("gpu") == gpu]


def judge(steps: list[Step], regressions: list[regress.Regression]) -> Verdict:
    v = Verdict(ok=True)
    for s in steps:
        failed = s.returncode != 0
        what = "FAIL" if failed else "ok"
        if failed and not s.gate and s.returncode not in (None,):
            what = "CRASHED"
        v.lines.append(f"{s.name:<14} {what:<8} exit {s.returncode}  {s.seconds:6.1f} s")
        v.ok &= not failed
    for r in regressions:
        v.lines.append(f"{'regression' if r.verdict == 'regression' else 'speed':<14} {r.verdict:<8} "
                       f"{'/'.join(map(str, r.key))}: {r.message}")
        v.ok &= r.verdict != "regression"
    return v


def main(argv: list[str] | None = None, steps: list[Step] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", help="records directory (default: the store's)")
    ap.add_argument("--out", default=str(ROOT / "reports"), help="where the report is rendered")
    ap.add_argument("--preset", help="default: tiny on a CPU, 48b-a3b on a GPU (the gates' own default)")
    args = ap.parse_args(argv)
    import os
    env = dict(os.environ)
    if args.records:
        env["KIMI_RECORDS_DIR"] = str(Path(args.records).resolve())
    gpu = on_gpu()
    steps = [run(s, env) for s in (steps if steps is not None else plan(args.preset, gpu, Path(args.out)))]

    loaded = store.load(root=args.records)
    prov = store.provenance()["machine"]
    mine = same_machine(loaded.records, prov["host"], prov["gpu"])
    regressions = regress.check_latest([r for r in mine if r.get("kind") == "bench"])
    verdict = judge(steps, regressions)

    rec = store.make_record(
        "nightly", preset=args.preset or ("48b-a3b" if gpu else "tiny"), dtype="default",
        device="cuda" if gpu else "cpu", weights="see step records",
        params={"steps": [s.name for s in steps]},
        results={"passed": verdict.ok,
                 "steps": {s.name: {"returncode": s.returncode, "seconds": round(s.seconds, 2), "gate": s.gate}
                           for s in steps},
                 "regressions": [{"key": list(map(str, r.key)), "verdict": r.verdict, "ratio": r.ratio,
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
    print(report)
    print(f"NIGHTLY {'PASS' if verdict.ok else 'FAIL'}  (record {rec['id'][:8]})")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())

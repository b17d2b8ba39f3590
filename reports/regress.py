"""Speed-regression detection for bench records, against the history of the same machine and configuration.

A run is compared only with earlier VALID runs of the same fingerprint: machine.gpu, machine.host,
preset, params.phase, params.context, params.batch, params.impl, params.peer, dtype. Two conditions must BOTH hold to flag a regression:

1. Statistical: a one-sided Mann-Whitney U test says the new run's per-token latencies
   (results.samples_ms) are larger than the pooled samples of the last K runs (p < ALPHA).
   Alone this over-flags: samples within one run are autocorrelated (clock, thermal and allocator
   state persist for the whole run), so a run's hundreds of samples carry far fewer independent
   observations than their count, and on an H200 the run medians wander ~1-2% from run to run. Any
   such drift gives a tiny p-value.
2. Practical: the new median exceeds the LARGEST history run median by more than
   max(MIN_SLOWDOWN, MAD_FACTOR * MAD of history run medians / their median). The bar is set by the
   run-to-run spread the history itself shows, counted in runs, not samples.
A run that meets both is a `regression`, unless the host slowed as much: where the new run and at least
MIN_HISTORY_RUNS of its history carry the host probe (results.host_launch_us, the host's time for one eager launch,
`benchmarks.roofline.measure_launch_us`), a run whose probe rose past the same bar over the history's median probe
and whose slowdown is no larger than the probe's is `host-slower`: launch-bound work (an eager prefill of a short
prompt, HF's eager decode) moves with the host, and on the H200 the host has moved by 1.6x between two device calls
while graph-captured and GPU-bound runs did not move. It is reported, and it does not fail the check: a real
regression hidden under an equal host slowdown shows again in the next run on a normal host. Where the runs carry
the GPU's clocks (`results.clocks`), the message adds the new run's mean SM clock and power-cap share against the
history's (`clock_note`), and a prefill record says how many of its calls the host paced (`pacing_note`); both
inform and do not change the verdict.

`python -m reports.regress [--records DIR]` checks the latest run of every fingerprint and exits 1
when any regressed, 0 when none did, 2 when it could not run (a records folder that is not there, a bad option),
with one line saying which. Record lines that are not records are skipped with a warning naming each, and a record
whose latencies `check` cannot use (not finite positive numbers) is not judged, nor taken as another's history.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import numpy as np
from scipy.stats import mannwhitneyu

from records.schema import BENCH, CLOCKS, RECORD, Field

HISTORY_RUNS = 8  # K: how many earlier runs form the history
MIN_HISTORY_RUNS = 3  # fewer cannot estimate run-to-run spread
ALPHA = 0.01
MIN_SLOWDOWN = 0.03
MAD_FACTOR = 3.0

# impl and peer too: the recompute path is not the graph decoder's history, and a run writes one record of
# ours per peer, whose samples must not be pooled twice.
KEY_FIELDS = (RECORD.machine.gpu, RECORD.machine.host, RECORD.preset, BENCH.params.phase, BENCH.params.context,
              BENCH.params.batch, BENCH.params.impl, BENCH.params.peer, RECORD.dtype)


@dataclass(frozen=True)
class Regression:
    key: tuple
    verdict: str  # 'regression' | 'host-slower' | 'ok' | 'insufficient-history'
    new_median: float
    hist_median: float | None
    ratio: float | None  # new median / history median; > 1 is slower
    p_value: float | None
    message: str
    record_id: str | None = None
    history_ids: tuple[str, ...] = ()


def describe(key: tuple) -> str:
    """A fingerprint (KEY_FIELDS) as words: '48b-a3b decode ctx 1024 batch 1 ours-graph vs hf, bfloat16, NVIDIA
    H200 @ host'."""
    gpu, host, preset, phase, context, batch, impl, peer, dtype = key
    return (f"{preset} {phase} ctx {context} batch {batch} {impl}{f' vs {peer}' if peer else ''}, {dtype}, "
            f"{gpu or 'no GPU'} @ {host}")


def _field(record: dict, field: Field):
    try:
        return field.lookup(record)
    except KeyError:
        raise KeyError(f"record {record.get('id', '?')!r} has no field {field.path!r}") from None


def fingerprint(record: dict) -> tuple:
    """The comparability key of a bench record (see KEY_FIELDS)."""
    return tuple(_field(record, f) for f in KEY_FIELDS)


def _samples(record: dict) -> np.ndarray:
    """The record's per-token latencies; ValueError unless a non-empty list of finite positive numbers (a median of
    zero could not be divided by)."""
    try:
        samples = np.asarray(_field(record, BENCH.results.samples_ms), dtype=float)
    except (TypeError, ValueError) as e:
        raise ValueError(f"record {record.get('id', '?')!r}: results.samples_ms must be a list of numbers ({e})") from e
    if samples.ndim != 1 or samples.size == 0 or not np.all(np.isfinite(samples)) or not np.all(samples > 0):
        raise ValueError(f"record {record.get('id', '?')!r}: results.samples_ms must be a non-empty list of "
                         f"finite positive numbers")
    return samples


def _key(record: dict) -> tuple | None:
    try:
        return fingerprint(record)
    except KeyError:
        return None


def comparable(record: dict) -> bool:
    """A VALID bench record with latency samples `check` can use and every fingerprint field: one that can be
    checked, or be another's history."""
    if record.get("kind") != "bench" or record.get("verdict") != "VALID" or _key(record) is None:
        return False
    try:
        _samples(record)
    except (KeyError, ValueError):
        return False
    return True


def check(new: dict, history: list[dict], k: int = HISTORY_RUNS) -> Regression:
    """Compare run `new` with the last `k` runs of `history` that share its fingerprint and precede it."""
    key = fingerprint(new)
    new_samples = _samples(new)
    new_median = float(np.median(new_samples))
    earlier = sorted((r for r in history if r["id"] != new["id"] and r["time"] < new["time"] and _key(r) == key
                      and comparable(r)), key=lambda r: r["time"])[-k:]  # the cheap tests first
    hist_ids = tuple(r["id"] for r in earlier)
    if len(earlier) < MIN_HISTORY_RUNS:
        return Regression(key, "insufficient-history", new_median, None, None, None,
                          f"{len(earlier)} earlier run(s) of this configuration, need {MIN_HISTORY_RUNS}",
                          new["id"], hist_ids)
    run_medians = np.array([np.median(_samples(r)) for r in earlier])
    hist_median = float(np.median(run_medians))
    mad = float(np.median(np.abs(run_medians - hist_median)))
    margin = max(MIN_SLOWDOWN, MAD_FACTOR * mad / hist_median)
    bar = float(run_medians.max()) * (1 + margin)
    p_value = float(mannwhitneyu(new_samples, np.concatenate([_samples(r) for r in earlier]),
                                 alternative="greater").pvalue)
    ratio = new_median / hist_median
    slow, significant = new_median > bar, p_value < ALPHA
    verdict = "regression" if slow and significant else "ok"
    message = (f"median {new_median:.4g} ms vs history {hist_median:.4g} ms ({ratio - 1:+.1%}) over "
               f"{len(earlier)} runs; bar {bar:.4g} ms (max run median +{margin:.1%}) "
               f"{'exceeded' if slow else 'not exceeded'}; Mann-Whitney p={p_value:.2g}")
    host = host_ratio(new, earlier)
    if host is not None:
        message += f"; host probe {host - 1:+.1%} against the history's"
        if verdict == "regression" and host > 1 + margin and ratio <= host:
            verdict = "host-slower"
            message += ": the host slowed as much as the run did"
    message += clock_note(new, earlier) + pacing_note(new)
    return Regression(key, verdict, new_median, hist_median, ratio, p_value, message, new["id"], hist_ids)


def host_ratio(new: dict, earlier: list[dict]) -> float | None:
    """The new run's host probe over the median probe of the history runs that have one; None where the new run
    lacks it or fewer than MIN_HISTORY_RUNS of the history runs have it."""
    def probe(r):
        v = BENCH.results.host_launch_us.get(r)
        return float(v) if isinstance(v, (int, float)) and v > 0 else None
    mine, theirs = probe(new), [p for p in map(probe, earlier) if p is not None]
    if mine is None or len(theirs) < MIN_HISTORY_RUNS:
        return None
    return mine / float(np.median(theirs))


def clock_note(new: dict, earlier: list[dict]) -> str:
    """The GPU's mean SM clock and power-cap share over the new run's timed calls (`results.clocks`; older records
    lack it) against the history runs that carry them: a note, not a verdict. A long prefill on the H200 runs at
    its 700 W cap with the clock lowered, so a slower run at a lower clock may be the board, not the code."""
    def clocks(r):
        c = BENCH.results.clocks.get(r)
        return c if isinstance(c, dict) and isinstance(CLOCKS.sm_mhz_mean.get(c), (int, float)) else None
    mine = clocks(new)
    if mine is None:
        return ""
    note = (f"; SM clock {CLOCKS.sm_mhz_mean.get(mine):.0f} MHz, at the power cap in "
            f"{CLOCKS.power_cap_share.get(mine) or 0:.0%}")
    theirs = [CLOCKS.sm_mhz_mean.get(c) for c in map(clocks, earlier) if c is not None]
    if theirs:
        note += f" (history: {float(np.median(theirs)):.0f} MHz over {len(theirs)} run(s))"
    return note


def pacing_note(r: dict, prefix: str = "") -> str:
    """How many of a record's timed calls the host paced, "; host-paced n/total" (`results.host_paced` over
    `results.host_ms` of prefill records, `benchmarks.timing.Samples.host_paced`), or "" where the record
    has none (decode steps, CPU runs, older records); `prefix` "peer_" reads the peer's. The one wording of it: this
    module's message and the report's speed table use it. A note, not a verdict: it says the host set the pace of
    those calls, not whether the host's CPU or our own host-side code got slower; the host probe tells those apart."""
    n, host = BENCH.results.field(f"{prefix}host_paced").get(r), BENCH.results.field(f"{prefix}host_ms").get(r)
    if not isinstance(n, int) or not isinstance(host, list):
        return ""
    return f"; host-paced {n}/{len(host)}"


def check_latest(records: list[dict], k: int = HISTORY_RUNS) -> list[Regression]:
    """Check the latest VALID run of every bench fingerprint against its own history."""
    latest: dict[tuple, dict] = {}
    for r in records:
        if comparable(r):
            key = fingerprint(r)
            if key not in latest or r["time"] > latest[key]["time"]:
                latest[key] = r
    return [check(r, records, k) for _, r in sorted(latest.items(), key=lambda kv: str(kv[0]))]


def one_line(text: str) -> str:
    """`text` with control characters (newlines, terminal escapes) shown as \\xNN: a record's strings cannot add
    lines to the verdict or drive the terminal."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", text)


def main(argv: list[str] | None = None) -> int:
    from records.store import load, records_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default=None, help="records directory (default: the store's)")
    parser.add_argument("--history", type=int, default=HISTORY_RUNS,
                        help=f"runs of history to compare with (at least {MIN_HISTORY_RUNS}; default {HISTORY_RUNS})")
    args = parser.parse_args(argv)
    if args.history < MIN_HISTORY_RUNS:
        # fewer could never judge; 0 or less would take the whole history through Python's slicing
        parser.error(f"--history must be at least {MIN_HISTORY_RUNS}, got {args.history}")
    folder = records_dir(args.records)
    if not folder.is_dir():     # a mistyped KIMI_RECORDS_DIR would otherwise judge nothing and pass
        parser.error(f"records folder {folder}: no such directory (--records or KIMI_RECORDS_DIR)")
    loaded = load(kinds=["bench"], root=args.records)
    for p in loaded.problems:
        print(f"warning: skipped an unreadable line: {p}", file=sys.stderr)
    results = check_latest(loaded.records, args.history)
    for r in results:
        print(one_line(f"{r.verdict:>20}  {describe(r.key)}  {r.record_id[:8]}: {r.message}"))
    flagged = sum(r.verdict == "regression" for r in results)
    print(f"{len(results)} configuration(s) judged: {flagged} regression(s), "
          f"{sum(r.verdict == 'insufficient-history' for r in results)} with too little history")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())

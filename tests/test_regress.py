"""reports/regress.py on synthetic histories: a planted slowdown is flagged, run-to-run noise is not."""
import re
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from records.store import make_record
from reports import regress

T0 = datetime(2026, 8, 1, tzinfo=timezone.utc)
FIXTURE = Path(__file__).parent / "fixtures" / "records"


def bench_run(rng, hour: int, slowdown: float = 1.0, *, host="h200-a", gpu="NVIDIA H200", context=2048,
              median_ms=2.5, drift=0.015, n=64) -> dict:
    """One run: per-token latencies ~ lognormal around `median_ms`, with a run-level drift (clocks, placement)
    and AR(1) per-sample jitter, so samples within a run are autocorrelated like real ones."""
    jitter = np.empty(n)
    jitter[0] = rng.normal(0, 0.02)
    for i in range(1, n):
        jitter[i] = 0.8 * jitter[i - 1] + rng.normal(0, 0.012)
    samples = median_ms * slowdown * np.exp(rng.normal(0, drift) + jitter)
    rec = make_record("bench", preset="48b-a3b", dtype="bfloat16", device="cuda", weights="random:0",
                      params={"phase": "decode", "context": context, "batch": 1, "impl": "ours-graph", "peer": None},
                      results={"tok_s": 1000 / float(np.mean(samples)), "samples_ms": samples.tolist()})
    rec["time"] = (T0 + timedelta(hours=hour)).isoformat()
    rec["machine"] = {**rec["machine"], "host": host, "gpu": gpu}
    return rec


def history(seed: int, runs: int = 8, **kw) -> tuple[np.random.Generator, list[dict]]:
    rng = np.random.default_rng(seed)
    return rng, [bench_run(rng, h, **kw) for h in range(runs)]


@pytest.mark.parametrize("seed", range(5))
def test_planted_slowdown_is_flagged(seed):
    rng, hist = history(seed)
    result = regress.check(bench_run(rng, 100, slowdown=1.10), hist)
    assert result.verdict == "regression", result.message
    assert 1.06 < result.ratio < 1.15 and result.p_value < regress.ALPHA
    assert len(result.history_ids) == regress.HISTORY_RUNS


def test_run_to_run_noise_is_not_flagged_though_its_p_values_are_tiny():
    p_values = []
    for seed in range(20):
        rng, hist = history(100 + seed)
        result = regress.check(bench_run(rng, 100), hist)
        assert result.verdict == "ok", f"seed {seed}: {result.message}"
        p_values.append(result.p_value)
    # Why the effect-size bar exists: autocorrelated samples make the test alone flag pure drift.
    assert sum(p < regress.ALPHA for p in p_values) >= 3, p_values


def with_probe(rec: dict, us: float) -> dict:
    rec["results"]["host_launch_us"] = us
    return rec


@pytest.mark.parametrize("seed", range(3))
def test_a_slowdown_the_host_probe_matches_is_host_slower_not_a_regression(seed):
    """A launch-bound run slows with the host: when the probe rose as much, the verdict says so and does not fail;
    the same slowdown on an unchanged host, or one larger than the host's, is still a regression."""
    rng, hist = history(seed)
    hist = [with_probe(r, 10.0) for r in hist]
    slowed_host = regress.check(with_probe(bench_run(rng, 100, slowdown=1.5), 16.0), hist)
    assert slowed_host.verdict == "host-slower" and "host probe +60" in slowed_host.message, slowed_host.message
    same_host = regress.check(with_probe(bench_run(rng, 101, slowdown=1.5), 10.0), hist)
    assert same_host.verdict == "regression", same_host.message
    worse_than_host = regress.check(with_probe(bench_run(rng, 102, slowdown=1.5), 11.5), hist)
    assert worse_than_host.verdict == "regression", worse_than_host.message
    # without probes in the history (records before it existed) the check is as before
    unprobed = regress.check(with_probe(bench_run(rng, 103, slowdown=1.5), 16.0), history(seed)[1])
    assert unprobed.verdict == "regression" and "host probe" not in unprobed.message


def test_nightly_does_not_fail_on_host_slower():
    from reports import nightly
    key = ("NVIDIA H200", "vm", "48b-a3b", "decode", 1024, 1, "ours-graph", "hf", "bfloat16")
    r = regress.Regression(key, "host-slower", 3.0, 2.0, 1.5, 1e-9, "host probe +60%")
    assert nightly.judge([], [r]).ok
    assert not nightly.judge([], [replace(r, verdict="regression")]).ok
    assert regress.describe(key) == "48b-a3b decode ctx 1024 batch 1 ours-graph vs hf, bfloat16, NVIDIA H200 @ vm"


def test_a_speedup_is_not_a_regression():
    rng, hist = history(7)
    assert regress.check(bench_run(rng, 100, slowdown=0.85), hist).verdict == "ok"


def test_insufficient_history():
    rng, hist = history(8, runs=regress.MIN_HISTORY_RUNS - 1)
    result = regress.check(bench_run(rng, 100, slowdown=1.5), hist)
    assert result.verdict == "insufficient-history"
    assert result.p_value is None and result.ratio is None
    assert f"need {regress.MIN_HISTORY_RUNS}" in result.message


def test_only_earlier_runs_count_as_history():
    rng, hist = history(9)
    first = hist[0]
    assert regress.check(first, hist).verdict == "insufficient-history"
    assert regress.check(hist[4], hist).history_ids == tuple(r["id"] for r in hist[:4])


def test_other_machines_and_contexts_do_not_mix():
    rng = np.random.default_rng(10)
    fast_elsewhere = ([bench_run(rng, h, host="h200-b", median_ms=2.0) for h in range(8)]
                      + [bench_run(rng, h, gpu="NVIDIA H100", median_ms=2.0) for h in range(8)]
                      + [bench_run(rng, h, context=128, median_ms=2.0) for h in range(8)])
    # Against the 2.0 ms runs of other fingerprints, a 2.5 ms run would be a 25% slowdown.
    assert regress.check(bench_run(rng, 100), fast_elsewhere).verdict == "insufficient-history"
    own = [bench_run(rng, h) for h in range(8)]
    result = regress.check(bench_run(rng, 100), fast_elsewhere + own)
    assert result.verdict == "ok" and set(result.history_ids) == {r["id"] for r in own}


def test_invalid_runs_are_not_history():
    rng, hist = history(11)
    for r in hist:
        r["verdict"], r["reasons"] = "INVALID", ["clocks throttled"]
    assert regress.check(bench_run(rng, 100, slowdown=1.2), hist).verdict == "insufficient-history"


def test_check_latest_flags_only_the_slowed_configuration():
    rng = np.random.default_rng(12)
    records = [bench_run(rng, h, context=c) for h in range(6) for c in (128, 2048)]
    records += [bench_run(rng, 10, context=128), bench_run(rng, 10, context=2048, slowdown=1.12)]
    verdicts = {r.key[4]: r.verdict for r in regress.check_latest(records)}
    assert verdicts == {128: "ok", 2048: "regression"}


def test_bad_records_are_named():
    rng, hist = history(13, runs=3)
    bad = bench_run(rng, 100)
    bad["results"]["samples_ms"] = [1.0, float("nan")]
    with pytest.raises(ValueError, match=rf"{bad['id']}.*samples_ms"):
        regress.check(bad, hist)
    del bad["params"]["context"]
    with pytest.raises(KeyError, match="params.context"):
        regress.check(bad, hist)


def test_cli_on_the_fixture_history_exits_1_for_the_planted_slowdown(capsys):
    assert regress.main(["--records", str(FIXTURE)]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.strip().startswith("regression")]
    assert len(flagged) == 1 and " decode ctx 8192 " in flagged[0]
    assert re.search(r"^\d+ configuration\(s\) judged: 1 regression\(s\)", out, re.M)


@pytest.mark.parametrize("argv, why", [(["--history", "0"], "--history must be at least 3, got 0"),
                                       (["--history", "-1"], "--history must be at least 3"),
                                       (["--records", "/no/such/records"], "no such directory")])
def test_cli_refuses_what_would_judge_nothing_or_everything(argv, why, capsys):
    """--history 0 or -1 took the whole history (Python's slicing) and lifted the bar past a 2.4x slowdown; a
    records folder that does not exist printed nothing and passed."""
    with pytest.raises(SystemExit) as e:
        regress.main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_the_message_names_the_gpu_clock_against_the_historys_and_the_verdict_stands():
    """A slower run at a lower clock is still judged on its times; the message says what the clocks were."""
    rng, hist = history(7)
    for r, mhz in zip(hist, (1980, 1975, 1980, 1970, 1980, 1980, 1978, 1980)):
        r["results"]["clocks"] = {"sm_mhz_mean": float(mhz), "power_cap_share": 0.0}
    new = bench_run(rng, 100, slowdown=1.10)
    new["results"]["clocks"] = {"sm_mhz_mean": 1807.0, "power_cap_share": 0.81}
    result = regress.check(new, hist)
    assert result.verdict == "regression", result.message
    assert "SM clock 1807 MHz, at the power cap in 81% (history: 1980 MHz over 8 run(s))" in result.message
    bare = regress.check(bench_run(rng, 101, slowdown=1.10), history(7)[1])
    assert bare.verdict == "regression" and "SM clock" not in bare.message


def test_the_message_says_how_many_calls_the_host_paced_and_the_verdict_stands():
    """Host pacing says who set the pace, not whose host got slower: a slowed run whose calls were all host-paced
    is still a regression (no host probe moved), and its message says so."""
    rng, hist = history(8)
    new = bench_run(rng, 100, slowdown=1.10)
    new["results"].update(host_ms=list(new["results"]["samples_ms"]), host_paced=len(new["results"]["samples_ms"]))
    result = regress.check(new, hist)
    assert result.verdict == "regression", result.message
    n = len(new['results']['samples_ms'])
    assert result.message.endswith(f"; host-paced {n}/{n}")
    bare = regress.check(bench_run(rng, 101, slowdown=1.10), history(8)[1])
    assert bare.verdict == "regression" and "host-paced" not in bare.message

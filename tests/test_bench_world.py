"""The end-to-end benchmark over several ranks (`python -m benchmarks.bench_e2e --world N`, benchmarks/ranks.py) on
tiny over gloo: one record per configuration, from rank 0 alone, with the world size, the ranks' rooflines and the
all_reduce's share of the decode step; the benchmarked decode gives one process's logits; the hook that skips the
collective for the A/B restores it; a rank that fails stops the run with exit 2, naming it, and leaves no record of
what it did not finish; bad world sizes are refused."""
import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from benchmarks import bench_e2e, ranks, roofline
from model import parallel
from model.build import load_model
from model.config import PRESETS
from model.parallel import ExpertParallel
from records import schema
from records.exits import EXIT_REFUSED, run_main
from records.store import load
from tests.test_parallel import TOL

TINY = PRESETS["tiny"]
ARGS = ["--quick", "--contexts", "16", "--prefill", "16", "--recompute-steps", "0"]  # decode, then prefill, at 16

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py; the forked ranks inherit it


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    monkeypatch.setenv("FLA_FLASH_KDA", "0")  # main() sets it when unset; keep the test process unchanged
    return tmp_path


def command(argv) -> int:
    """The command's exit code, as `python -m benchmarks.bench_e2e` gives it."""
    return run_main(lambda: bench_e2e.main(argv), kinds=("bench",))


# ---- a run over two ranks ------------------------------------------------------------------------------------

def test_bench_over_two_ranks_records_world_2_from_rank_0_alone(records, capfd):
    returned = bench_e2e.main([*ARGS, "--world", "2"])
    out = capfd.readouterr().out
    got = load(kinds="bench", root=records)
    # one record per configuration: rank 0's alone (two ranks writing would leave four)
    assert got.problems == [] and len(got.records) == len(returned) == 2
    assert [r["id"] for r in got.records] == [r["id"] for r in returned]
    assert "bench over 2 ranks, 4 experts each: tiny float32 (cpu, gloo)\n" in out
    assert out.count("summary (tok/s") == 1 and out.count("done: 2 bench records appended") == 1
    assert out.count("the all_reduce takes") == 1
    weights = load_model("tiny").weights  # the whole model's id, as one process reports it
    by_phase = {r["params"]["phase"]: r for r in got.records}
    for r in got.records:
        p, q = r["params"], r["results"]
        assert schema.problems(r) == [] and r["schema"] == schema.VERSION
        assert r["verdict"] == "VALID" and r["weights"] == weights
        assert (p["world"], p["experts_per_rank"], p["peer"]) == (2, 4, None) and p["impl"].endswith("-ep2")
        assert "gpus" not in p  # no GPUs to name on a CPU
        assert any(x.startswith("peers hf not run over 2 ranks") for x in r["reasons"])
        assert len(q["rank_hbm_gbps"]) == len(q["rank_matmul_tflops"]) == 2
        assert q["hbm_gbps"] == pytest.approx(sum(q["rank_hbm_gbps"]))
        assert q["matmul_tflops"] == pytest.approx(sum(q["rank_matmul_tflops"]))
        assert q["roofline_derivation"].startswith("over 2 ranks") and q["roofline_tok_s"] is None  # a CPU's
        assert q["tok_s"] > 0
    dec, pre = by_phase["decode"]["results"], by_phase["prefill"]["results"]
    one = roofline.decode_bytes_per_token(TINY, 16, torch.float32)
    assert len(dec["rank_bytes_per_token"]) == 2 and dec["bytes_per_token"] == sum(dec["rank_bytes_per_token"])
    assert one < dec["bytes_per_token"] < 2 * one  # the replicated part on every rank, the experts once
    assert pre["flops_per_token"] == 2 * roofline.prefill_flops_per_token(TINY, 16)
    # the collective's share of the decode step, from the A/B of this run
    assert 0.0 <= dec["collective_share"] <= 1.0
    assert len(dec["rank_no_collective_median_ms"]) == 2
    assert dec["no_collective_median_ms"] == max(dec["rank_no_collective_median_ms"])
    assert dec["collective_ms"] == pytest.approx(dec["median_ms"] - dec["no_collective_median_ms"])
    assert "collective_share" not in pre


def test_a_collective_ab_whose_skip_does_nothing_is_void(records, monkeypatch):
    """Negative control: a skip that leaves the all_reduce in place keeps the ranks' logits equal, and the decode
    record says the A/B is void instead of reporting a share."""
    monkeypatch.setattr(parallel, "collective_skipped", contextlib.nullcontext)  # the forked ranks inherit it
    bench_e2e.main([*ARGS, "--world", "2"])
    [dec] = [r for r in load(kinds="bench", root=records).records if r["params"]["phase"] == "decode"]
    assert dec["verdict"] == "INVALID" and any("collective A/B is void" in x for x in dec["reasons"])
    assert "collective_share" not in dec["results"]


def _benchmarked_decode(world: int) -> torch.Tensor:
    """Every step's logits of the decode the benchmark times (its settings, prompt, decoder and collective A/B)."""
    s = bench_e2e.Settings(**dict(bench_e2e.QUICK, world=world))
    ep = ExpertParallel.of(TINY.num_experts) if world > 1 else None
    loaded = load_model("tiny", ep=ep)
    bench = bench_e2e.Bench(s, loaded, bench_e2e.Plan(s), ep=ep)
    kept = []

    def keeping(cache):   # the benchmark's decoder, each step's logits copied out
        decode = bench.make_decoder(cache)
        return lambda tok, cache: kept.append(decode(tok, cache).clone()) or kept[-1]

    bench_e2e.ours_decode(s, loaded.model, bench.prompt(16), keeping, collective_ab=world > 1)
    return torch.stack(kept[:s.warmup_steps + s.decode_tokens])   # the steps before the A/B's


def test_the_benchmarked_decode_over_two_ranks_gives_one_process_logits():
    r0, r1 = parallel.spawn(_benchmarked_decode, 2, (2,), start_method="fork", timeout_s=120)
    one = _benchmarked_decode(1)
    assert r0.shape == one.shape and r0.shape[0] == 5  # one warm-up and four timed steps
    assert torch.equal(r0, r1)  # every rank gets the same bits
    assert (r0 - one).abs().max().item() <= TOL
    assert torch.equal(r0.argmax(-1), one.argmax(-1))


def test_rooflines_over_ranks_count_each_rank_share_and_take_the_slowest():
    big = PRESETS["48b-a3b"]
    for cfg in (TINY, big):
        routed = ranks.routed_active_params(cfg) * 2
        whole = roofline.decode_bytes_per_token(cfg, 1024)
        assert ranks.rank_decode_bytes_per_token(cfg, 1024, torch.bfloat16, 1) == whole
        for world in (2, 4):
            share = ranks.rank_decode_bytes_per_token(cfg, 1024, torch.bfloat16, world)
            assert world * share == pytest.approx(world * whole - (world - 1) * routed)  # the experts counted once
    ceil = [roofline.Ceilings(4000.0, 700.0, 1.0, 1.0, 0, 0, 0), roofline.Ceilings(3000.0, 600.0, 1.0, 1.0, 0, 0, 0)]
    tok_s, f = ranks.over_ranks(big, 1024, torch.bfloat16, True, ceil)
    assert f["hbm_gbps"] == 7000.0 and f["rank_hbm_gbps"] == [4000.0, 3000.0]
    # the ranks step together: the slower GPU's bandwidth over its share bounds both, not the sum over the sum
    assert tok_s == pytest.approx(3000.0 * 1e9 / f["rank_bytes_per_token"][1])
    assert tok_s < 7000.0 * 1e9 / f["bytes_per_token"]
    assert tok_s > roofline.decode_roofline_tok_s(big, 1024, 3000.0)  # two GPUs, less read by each
    tok_s, f = ranks.over_ranks(big, 1024, torch.bfloat16, False, ceil)
    assert tok_s == pytest.approx(roofline.prefill_roofline_tok_s(big, 1024, 600.0))  # every rank does every FLOP
    assert ranks.collective_share(10.0, [7.0, 8.0])["collective_share"] == pytest.approx(0.2)
    assert ranks.collective_share(10.0, [11.0, 9.0])["collective_share"] == 0.0  # noise: clamped, the ms kept
    assert ranks.collective_share(10.0, [11.0, 9.0])["collective_ms"] == -1.0


# ---- the hook the A/B uses ----------------------------------------------------------------------------------

def test_the_collective_hook_skips_the_all_reduce_inside_its_block_only(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(t.dtype))
    ep = ExpertParallel(2, 0, TINY.num_experts)
    y = torch.full((3, 4), 1.5, dtype=torch.bfloat16)
    assert torch.equal(ep.reduce(y), y) and calls == [torch.float32]  # summed in fp32
    with parallel.collective_skipped():
        out = ep.reduce(y)
        with parallel.collective_skipped():
            ep.reduce(y)
        ep.reduce(y)  # still skipped after an inner block
    assert out.dtype == torch.bfloat16 and torch.equal(out, y) and len(calls) == 1
    ep.reduce(y)
    assert len(calls) == 2  # restored on exit
    with pytest.raises(RuntimeError, match="boom"):
        with parallel.collective_skipped():
            raise RuntimeError("boom")
    ep.reduce(y)
    assert len(calls) == 3  # restored when the block raised


# ---- failures and refusals ------------------------------------------------------------------------------------

def _fail_on_rank_1(*args, **kwargs):
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(60)  # outside any collective: rank 1's error is the one seen


@pytest.mark.parametrize("where, kept", [("ours_decode", []), ("ours_prefill", ["decode"])])
def test_a_rank_that_fails_exits_2_naming_it_and_keeps_only_what_every_rank_finished(records, capfd, monkeypatch,
                                                                                       where, kept):
    """Negative control: rank 1 fails in the first configuration (decode), or in the second (prefill), after both
    ranks finished the first."""
    monkeypatch.setattr(bench_e2e, where, _fail_on_rank_1)  # the forked ranks inherit it
    t = time.perf_counter()
    assert command([*ARGS, "--world", "2"]) == EXIT_REFUSED
    assert time.perf_counter() - t < 30  # rank 0 was stopped, not waited for
    err = capfd.readouterr().err
    assert "Traceback" in err and "error: bench over 2 ranks stopped: rank 1 crashed: ValueError: rank 1 fails " \
                                  "on purpose" in err
    got = load(kinds="bench", root=records)
    assert got.problems == [] and [r["params"]["phase"] for r in got.records] == kept


@pytest.mark.parametrize("argv, says", [
    (["--world", "0"], "--world must be a positive integer, got 0"),
    (["--world", "-2"], "--world must be a positive integer, got -2"),
    (["--world", "3"], "--world 3: the 8 routed experts do not split evenly over 3 ranks; use one of 1, 2, 4, 8"),
    (["--world", "2", "--rank-timeout-s", "0"], "--rank-timeout-s must be a number of seconds in (0, 604800], got 0.0"),
    (["--world", "two"], "argument --world: invalid int value: 'two'"),
])
def test_a_bad_world_is_refused_with_exit_2_and_no_record(records, capsys, argv, says):
    assert command([*ARGS, *argv]) == EXIT_REFUSED
    assert f"error: {says}\n" in capsys.readouterr().err
    assert not list(records.glob("*.jsonl"))


@pytest.mark.parametrize("argv, says", [
    (["--device", "cuda", "--world", "2"],
     "--world 2: each rank computes on a GPU of its own, and torch sees 1 CUDA device"),
    (["--device", "cuda:1", "--world", "2"],
     "--device cuda:1 with --world 2: rank r computes on cuda:r; give --device cuda or cpu"),
])
def test_a_world_the_gpus_cannot_hold_is_refused(records, capsys, monkeypatch, argv, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert command([*ARGS, *argv]) == EXIT_REFUSED
    assert f"error: {says}\n" in capsys.readouterr().err
    assert not list(records.glob("*.jsonl"))

"""Benchmarks on the CPU: roofline arithmetic from the config, timing helpers, and the quick modes of
bench_e2e and decompose end to end (tiny preset), with negative controls for what makes a record INVALID."""
import gzip
import json
import time
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, strategies as st
import torch

from benchmarks import bench_e2e, decompose, roofline
from benchmarks.kernels import runner as kernels_runner
from benchmarks.timing import Samples, summarize, time_calls, time_steps
from model.build import load_model
from model.config import get_config
from records.store import load

CFG = get_config("48b-a3b")


# ---- roofline --------------------------------------------------------------------------------------

def test_weight_bytes_per_token_48b_is_6_21_gb():
    # SPEC §1: 3,106,972,544 active parameters; the 89,216 fp32 ones (A_log, dt_bias, router bias) take 4 bytes
    b = roofline.weight_bytes_per_token(CFG, torch.bfloat16)
    assert b == 2 * 3_106_972_544 + 2 * 89_216
    assert round(b / 1e9, 2) == 6.21
    assert round(roofline.weight_bytes_per_token(CFG, torch.float32) / 1e9, 2) == 12.43


def test_state_bytes_per_token():
    mla = 7 * 576 * 2 * 131072  # 7 MLA layers x (512 + 64) latent values x bf16, read
    kda = 20 * 32 * 128 * 128 * 4  # 40 MiB fp32 recurrent state
    taps = 20 * 3 * 3 * 4096 * 2  # W-1 = 3 taps of q|k|v, bf16
    assert kda == 40 * 2 ** 20
    assert roofline.state_bytes_per_token(CFG, 131072) == mla + 2 * (kda + taps)
    assert roofline.state_bytes_per_token(CFG, 0) == 2 * (kda + taps)
    with pytest.raises(ValueError, match="context"):
        roofline.state_bytes_per_token(CFG, -1)


def test_decode_roofline_arithmetic():
    # SPEC §4: 6.21 GB / 4.25 TB/s = 1.46 ms per token from the weights alone
    assert roofline.weight_bytes_per_token(CFG) / 4250e9 * 1e3 == pytest.approx(1.462, abs=1e-3)
    for ctx in (0, 1024, 131072):
        expected = 4250e9 / (roofline.weight_bytes_per_token(CFG) + roofline.state_bytes_per_token(CFG, ctx))
        assert roofline.decode_roofline_tok_s(CFG, ctx, 4250) == pytest.approx(expected)
    assert roofline.decode_roofline_tok_s(CFG, 0, 4250) == pytest.approx(674.5, abs=0.1)
    assert roofline.decode_roofline_tok_s(CFG, 131072, 4250) == pytest.approx(577.6, abs=0.1)
    with pytest.raises(ValueError, match="hbm_gbps"):
        roofline.decode_roofline_tok_s(CFG, 0, 0)


def test_prefill_flops_and_roofline():
    lm_head = 163840 * 2304
    dense = 2 * (3_106_972_544 - lm_head)
    kda = 20 * 32 * (6 * 128 * 128 + 10 * 64 * 128 + 64 * 64)
    for T in (1, 2048, 32768):
        mla = 7 * 2 * 32 * (192 + 128) * (T + 1) / 2
        flops = dense + 2 * lm_head / T + mla + kda
        assert roofline.prefill_flops_per_token(CFG, T) == pytest.approx(flops)
        assert roofline.prefill_roofline_tok_s(CFG, T, 790) == pytest.approx(790e12 / flops)
    # about SPEC's ~127k tok/s at 790 TFLOP/s, less as the causal attention grows with the prompt
    assert 120e3 < roofline.prefill_roofline_tok_s(CFG, 2048, 790) < 150e3
    assert roofline.prefill_roofline_tok_s(CFG, 32768, 790) < 0.75 * roofline.prefill_roofline_tok_s(CFG, 2048, 790)
    with pytest.raises(ValueError, match="prefill length"):
        roofline.prefill_flops_per_token(CFG, 0)


def test_measured_ceilings_on_cpu_are_positive():
    c = roofline.measure_ceilings("cpu", read_bytes=4 << 20, matmul_n=64, reps=3)
    assert c.hbm_gbps > 0 and c.matmul_tflops > 0 and c.launch_us > 0 and c.kernel_launch_us > 0


def test_launch_probe_reads_the_cost_of_one_call():
    """`measure_launch_us` is per call: an op that takes 2 ms on the host reads at least 2000 us, and the default
    trivial op reads far less; bad counts are refused."""
    import time
    slow = roofline.measure_launch_us("cpu", n=3, reps=2, op=lambda: time.sleep(0.002))
    fast = roofline.measure_launch_us("cpu", n=200, reps=3)
    assert slow >= 2000 and 0 < fast < slow / 10
    with pytest.raises(ValueError, match="n and reps"):
        roofline.measure_launch_us("cpu", n=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_launch_probe_times_our_triton_path():
    """On CUDA the kernel probe's op is a Triton launch through our wrapper, which allocates its output with an eager
    op of its own: it cannot cost the host less than the eager probe's trivial op, and its op runs a Triton kernel."""
    eager = roofline.measure_launch_us("cuda", n=500, reps=5)
    ours = roofline.measure_kernel_launch_us("cuda", n=500, reps=5)
    assert ours > eager > 0, (ours, eager)
    from model import ops
    x = torch.ones(1, 8, device="cuda", dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.rmsnorm(x, torch.ones(8, device="cuda", dtype=torch.bfloat16), 1e-6)
        torch.cuda.synchronize()
    assert any(e.name == "_rmsnorm_kernel" for e in prof.events()), [e.name for e in prof.events()]


# ---- timing ----------------------------------------------------------------------------------------

def test_summarize_and_samples():
    s = summarize([float(x) for x in range(1, 11)])
    assert s == pytest.approx({"median_ms": 5.5, "p10_ms": 1.9, "p90_ms": 9.1})
    assert Samples([2.0, 2.0], 5.0).per_s == pytest.approx(400.0)
    with pytest.raises(ValueError, match="no samples"):
        Samples([], 0.0)


def test_host_paced_counts_calls_whose_host_time_reached_the_gpu_time():
    s = Samples([10.0, 10.0, 10.0, 10.0], 40.0, host_ms=[9.6, 5.0, 10.4, 9.4])
    assert s.host_paced() == 2                      # 9.6 and 10.4 reach 0.95 x 10; 9.4 and 5.0 do not
    assert Samples([10.0], 10.0).host_paced() is None          # not measured (a CPU run, or back-to-back steps)
    assert bench_e2e.host_pacing(s) == {"host_ms": [9.6, 5.0, 10.4, 9.4], "host_paced": 2}
    assert bench_e2e.host_pacing(Samples([10.0], 10.0)) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_calls_tells_a_host_paced_call_from_a_gpu_paced_one():
    """A call that sleeps on the host around a tiny kernel is host-paced; one big matmul, enqueued in microseconds,
    is not. Both measured on the device by `time_calls`."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a  # warm-up: cuBLAS's first call spends ~0.1 s on the host (a GPU-paced call would read host-paced)
    host = time_calls(lambda: (torch.cuda._sleep(1000), time.sleep(0.02)), 3, "cuda")
    gpu = time_calls(lambda: [a @ a for _ in range(8)], 3, "cuda")
    assert host.host_paced() == 3 and min(host.host_ms) >= 20.0, host
    assert gpu.host_paced() == 0 and max(h / g for h, g in zip(gpu.host_ms, gpu.samples_ms)) < 0.5, gpu


def test_time_steps_and_calls_count_every_call():
    calls = []
    s = time_steps(lambda: calls.append(1), 5, "cpu")
    assert len(s.samples_ms) == 5 and len(calls) == 5 and s.total_ms >= sum(s.samples_ms) * 0.999
    setups = []
    c = time_calls(lambda: calls.append(2), 3, "cpu", setup=lambda: setups.append(1))
    assert len(c.samples_ms) == 3 and len(setups) == 3 and calls.count(2) == 3


# ---- bench_e2e -----------------------------------------------------------------------------------------

@pytest.fixture
def records_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    monkeypatch.setenv("FLA_FLASH_KDA", "0")  # main() sets it when unset; keep the test process unchanged
    return tmp_path


def test_bench_quick_end_to_end(records_dir):
    returned = bench_e2e.main(["--quick"])
    got = load(kinds="bench", root=records_dir)
    assert not got.problems and len(got.records) == len(returned) == 5
    by_cfg = {(r["params"]["phase"], r["params"]["context"], r["params"]["impl"], r["params"]["peer"]): r
              for r in got.records}
    assert set(by_cfg) == {("decode", 16, "recompute", None), ("decode", 16, "ours-eager", "hf"),
                           ("prefill", 16, "ours-eager", "hf"), ("decode", 48, "ours-eager", "hf"),
                           ("prefill", 48, "ours-eager", "hf")}
    for r in got.records:
        q = r["results"]
        assert r["verdict"] == "VALID", r["reasons"]
        assert r["preset"] == "tiny" and r["device"] == "cpu" and r["weights"].startswith("sha256:")
        assert q["tok_s"] > 0 and q["hbm_gbps"] > 0 and q["host_launch_us"] > 0 and q["host_kernel_launch_us"] > 0
        assert q["roofline_fraction"] is None and q["roofline_tok_s"] is None   # a CPU has no roofline here
        assert q["roofline_note"] == bench_e2e.CPU_ROOFLINE_NOTE
        assert q["median_ms"] == pytest.approx(summarize(q["samples_ms"])["median_ms"])
        if r["params"]["peer"]:
            assert q["peer_tok_s"] > 0 and q["speedup_vs_peer"] == pytest.approx(q["tok_s"] / q["peer_tok_s"])
            # fp32 on the same weights: HF's first greedy tokens are ours
            assert q["spot_check"]["agree"] == q["spot_check"]["total"] == 4
            assert q["spot_check"]["verdict"] == "match" and "explanation" not in q["spot_check"]
    decode = by_cfg[("decode", 48, "ours-eager", "hf")]
    assert len(decode["results"]["samples_ms"]) == decode["params"]["decode_tokens"] == 4
    assert len(decode["results"]["peer_samples_ms"]) == decode["params"]["peer_decode_tokens"] == 3
    assert any("CUDA graphs need a CUDA device" in x for x in decode["reasons"])
    assert len(by_cfg[("decode", 16, "recompute", None)]["results"]["samples_ms"]) == 2

def _gen(tokens, tops):
    """A Generation with per-step top-5 (ids, log-probabilities)."""
    from model.generate import Generation
    return Generation([1, 2, 3], list(tokens), [t[0] for t in tops], [t[1] for t in tops])


def test_spot_result_explains_a_divergence():
    """The spot check's entry: agreement counted, and where ours and the peer part, the first divergence diagnosed
    as the gates do. Two almost equal logits read near-tie; a peer that chose a token ours ranks far down reads
    real (the negative control)."""
    ids, lp = [5, 6, 7, 8, 9], [-0.5, -0.55, -3.0, -4.0, -5.0]
    agree = (ids, lp)
    ours = _gen([5, 5, 5], [agree, agree, agree])
    assert bench_e2e.spot_result(ours, _gen([5, 5, 5], [agree] * 3), "hf", 0.125) == \
        {"agree": 3, "total": 3, "prompt_len": 3, "verdict": "match"}
    tie = _gen([5, 6, 9], [agree, ([6, 5, 7, 8, 9], [-0.5, -0.56, -3.0, -4.0, -5.0]), agree])
    r = bench_e2e.spot_result(ours, tie, "hf-fla", 0.125)
    assert (r["agree"], r["first_divergence"], r["verdict"]) == (1, 1, "near-tie")
    assert "ours chose 5" in r["explanation"] and "hf-fla chose 6" in r["explanation"]
    real = _gen([5, 9, 9], [agree, ([9, 5, 6, 7, 8], [-0.1, -3.0, -3.1, -4.0, -5.0]), agree])
    r = bench_e2e.spot_result(ours, real, "hf-fla", 0.125)
    assert (r["agree"], r["first_divergence"], r["verdict"]) == (1, 1, "real")



def _small(**kw):
    return replace(bench_e2e.Settings(**bench_e2e.QUICK), contexts=(16,), prefill=(16,), recompute_steps=0, **kw)


def test_bench_nan_logits_make_records_invalid(records_dir):
    """Negative control: a NaN in lm_head poisons the logits; every record must say so."""
    loaded = load_model("tiny")
    with torch.no_grad():
        loaded.model.lm_head.weight[0, 0] = float("nan")
    s = _small(peers=())
    recs = bench_e2e.Bench(s, loaded, bench_e2e.Plan(s)).run()
    assert len(recs) == 2
    for r in recs:
        assert r["verdict"] == "INVALID"
        assert any("NaN/inf" in x for x in r["reasons"]), r["reasons"]


def test_bench_over_budget_is_skipped_and_recorded(records_dir):
    s = _small(peers=(), budget_s=0.0)
    recs = bench_e2e.Bench(s, load_model("tiny"), bench_e2e.Plan(s)).run()
    assert [r["verdict"] for r in recs] == ["INVALID", "INVALID"]
    assert all("budget" in r["reasons"][0] and r["results"]["tok_s"] is None for r in recs)


def test_plan_skips_slow_peers_from_spec_rates():
    plan = bench_e2e.Plan(bench_e2e.Settings())
    # HF with torch KDA at ~3.7k tok/s needs ~35 s just to prefill 128k tokens: over the 30 s cap
    assert "peer-max-s" in plan.skip_reason("hf", "decode", 131072)
    assert plan.skip_reason("hf-fla", "decode", 131072) is None
    plan.learn("hf-fla", "prefill", 1000.0)  # measured rates replace the plan's
    assert "peer-max-s" in plan.skip_reason("hf-fla", "decode", 131072)


def test_hf_kernel_switch_restores_hf_module():
    pytest.importorskip("transformers")
    mod = __import__(bench_e2e.HF_MODULE, fromlist=["_"])
    before = {n: getattr(mod, n) for n in bench_e2e.HF_KDA_FUNCS}
    with bench_e2e.hf_kernels("hf"):
        assert all(b == bench_e2e.HF_MODULE for b in bench_e2e.hf_kda_backends().values())
        assert all(getattr(mod, n) is not before[n] for n in bench_e2e.HF_KDA_FUNCS)
    assert {n: getattr(mod, n) for n in bench_e2e.HF_KDA_FUNCS} == before
    with pytest.raises(ValueError, match="unknown peer"):
        with bench_e2e.hf_kernels("vllm"):
            pass


def test_bench_missing_fla_peer_is_invalid(records_dir):
    try:
        import fla  # noqa: F401
        pytest.skip("fla is importable here: the peer is available")
    except ImportError:
        pass
    s = _small(peers=("hf-fla",))
    recs = bench_e2e.Bench(s, load_model("tiny"), bench_e2e.Plan(s)).run()
    assert len(recs) == 2 and all(r["verdict"] == "INVALID" for r in recs)
    assert all(any("hf-fla unavailable" in x for x in r["reasons"]) for r in recs)
    assert all(r["results"]["tok_s"] > 0 for r in recs)  # ours was still measured


def test_attempt_turns_errors_and_oom_into_reasons():
    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 34.00 GiB\nmore detail")

    assert bench_e2e.attempt(lambda: {"x": 1}, "cpu") == ({"x": 1}, None)
    assert bench_e2e.attempt(oom, "cpu") == (None, "out of memory: CUDA out of memory. Tried to allocate 34.00 GiB")
    res, why = bench_e2e.attempt(lambda: 1 / 0, "cpu")
    assert res is None and why.startswith("ZeroDivisionError")


def test_bench_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bench_e2e.settings(["--quick", "--peers", "vllm"])
    with pytest.raises(SystemExit):
        bench_e2e.settings(["--quick", "--contexts", "0,16"])
    assert bench_e2e.settings(["--quick", "--peers", "none"]).peers == ()


# ---- decompose -------------------------------------------------------------------------------------

def test_decompose_quick_end_to_end(records_dir, tmp_path):
    recs = decompose.main(["--quick", "--trace-dir", str(tmp_path / "traces")])
    got = load(kinds="decomposition", root=records_dir).records
    assert len(recs) == len(got) == 1
    r = got[0]
    assert r["verdict"] == "VALID" and r["params"]["device"] == "cpu" and r["params"]["mode"] == "eager"
    assert any("graph mode not profiled" in x for x in r["reasons"])
    q = r["results"]
    assert sum(q["shares"].values()) == pytest.approx(1.0)
    assert 0 <= q["idle_fraction"] < 1 and q["step_ms"] > 0 and q["kernels_per_step"] > 0
    with gzip.open(q["trace"], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "cpu_op" for e in events)


def test_decompose_prefill_quick(records_dir, tmp_path):
    recs = decompose.main(["--quick", "--phase", "prefill", "--trace-dir", str(tmp_path / "traces")])
    got = load(kinds="decomposition", root=records_dir).records
    assert len(recs) == len(got) == 1
    r = got[0]
    assert r["verdict"] == "VALID" and r["params"]["phase"] == "prefill" and r["params"]["steps"] == 2
    assert r["params"]["context"] == 16 and "prefill" in r["results"]["trace"]
    q = r["results"]
    assert sum(q["shares"].values()) == pytest.approx(1.0) and q["step_ms"] > 0
    # a prefill runs every layer once over the prompt: far more operators than one decode step
    assert q["kernels_per_step"] > 27


@pytest.mark.slow  # the whole tiny model through Triton's interpreter (a minute or more)
def test_decompose_traces_under_a_variant_and_records_it(records_dir, tmp_path, monkeypatch, capsys):
    """`--variant` holds the config changed while the model runs (and only then), and the record names it; a key
    the module lacks is refused before anything runs. The kernels run through Triton's interpreter, so the prefill
    reaches the chunk kernel's module."""
    from model.triton import kda_chunk
    monkeypatch.setenv("KIMI_KERNELS", "triton")
    seen = []
    real = decompose.run_prefill

    def spy(*a, **k):
        seen.append(kda_chunk.CONFIG["scan_warps"])
        return real(*a, **k)
    monkeypatch.setattr(decompose, "run_prefill", spy)
    decompose.main(["--quick", "--phase", "prefill", "--trace-dir", str(tmp_path / "traces"),
                    "--variant", 'v=kda_chunk:{"scan_warps": 2}'])
    assert seen == [2] and kda_chunk.CONFIG["scan_warps"] == 4
    r = load(kinds="decomposition", root=records_dir).records[-1]
    assert r["params"]["variant"] == {"name": "v", "module": "kda_chunk", "changes": {"scan_warps": 2}}
    assert r["verdict"] == "VALID", r["reasons"]
    with pytest.raises(SystemExit):
        decompose.main(["--quick", "--phase", "prefill", "--variant",
                        'v=benchmarks.candidates.moe_grouped:{"nokey": 1}'])
    assert "unknown cfg keys ['nokey']" in capsys.readouterr().err


def test_benchmark_arguments_that_would_measure_nothing_are_refused(records_dir, capsys):
    """Each exits 2 with a usage error naming what is wrong, before any model is built, and writes nothing."""
    cases = [(lambda: kernels_runner.main(["--ops", "bogus"]), "unknown ['bogus']; the ops: "),
             (lambda: kernels_runner.main(["--ops", ","]), "--ops: names no op"),
             (lambda: kernels_runner.main(["--ops", "chunk_kda", "--rep-ms", "-1"]), "--rep-ms must be >= 1"),
             (lambda: decompose.main(["--quick", "--modes", "graph"]), "nothing to trace: --modes graph"),
             (lambda: bench_e2e.main(["--quick", "--budget-s", "-5"]), "--budget-s must be > 0 seconds"),
             (lambda: bench_e2e.main(["--quick", "--preset", "nope"]), "--preset 'nope': no such preset"),
             (lambda: bench_e2e.main(["--quick", "--contexts", ",", "--prefill", ",", "--recompute-steps", "0"]),
              "nothing to measure")]
    if not torch.cuda.is_available():
        cases.append((lambda: bench_e2e.main(["--quick", "--device", "cuda"]), "--device cuda: no CUDA device here"))
    for run, why in cases:
        with pytest.raises(SystemExit) as e:
            run()
        assert e.value.code == 2 and why in capsys.readouterr().err, why
    assert not load(root=records_dir).records


def test_decompose_under_a_variant_no_call_reaches_is_invalid(records_dir, tmp_path):
    """The negative control: on a CPU the model's MoE never runs the grouped experts, where a candidate is installed,
    so the trace is the defaults' whatever the variant says; the record says so, INVALID, instead of naming a variant
    that never ran."""
    (r,) = decompose.main(["--quick", "--phase", "prefill", "--trace-dir", str(tmp_path / "traces"),
                           "--variant", 'v=benchmarks.candidates.moe_grouped:{"down": {"tma": true}}'])
    assert r["verdict"] == "INVALID"
    assert any("reached no call of benchmarks.candidates.moe_grouped" in x for x in r["reasons"]), r["reasons"]


@pytest.mark.slow  # the whole tiny model through Triton's interpreter (a minute or more)
def test_decompose_holds_the_variant_for_every_mode(records_dir, tmp_path, monkeypatch):
    """With two modes (eager, then graph) each runs under the variant: a context that could run only once would
    leave the second mode's trace unmade (INVALID) or made without the variant."""
    from model.triton import kda_chunk
    monkeypatch.setenv("KIMI_KERNELS", "triton")
    seen, real = [], decompose.run_mode

    def spy(model, mode, *a, **k):
        seen.append((mode, kda_chunk.CONFIG["scan_warps"]))
        return real(model, "eager", *a, **k)  # the CPU has no graph mode: trace eager twice
    monkeypatch.setattr(decompose, "graph_unavailable", lambda device: None)
    monkeypatch.setattr(decompose, "run_mode", spy)
    recs = decompose.main(["--quick", "--trace-dir", str(tmp_path / "traces"),
                           "--variant", 'v=kda_chunk:{"scan_warps": 2}'])
    assert seen == [("eager", 2), ("graph", 2)] and kda_chunk.CONFIG["scan_warps"] == 4
    assert [r["verdict"] for r in recs] == ["VALID", "VALID"]


def test_self_time_ops_split_each_operator_around_its_children():
    ev = [dict(name="aten::linear", ts=0, dur=10, pid=1, tid=1), dict(name="aten::mm", ts=1, dur=8, pid=1, tid=1),
          dict(name="aten::resolve_conj", ts=2, dur=1, pid=1, tid=1), dict(name="aten::add", ts=12, dur=2, pid=1, tid=1),
          dict(name="aten::mm", ts=0, dur=5, pid=1, tid=2)]
    parts = decompose.self_time_ops(ev)
    got = sorted((e["tid"], e["ts"], e["dur"], e["name"]) for e in parts)
    assert got == [(1, 0, 1, "aten::linear"), (1, 1, 1, "aten::mm"), (1, 2, 1, "aten::resolve_conj"),
                   (1, 3, 6, "aten::mm"), (1, 9, 1, "aten::linear"), (1, 12, 2, "aten::add"), (2, 0, 5, "aten::mm")]
    # the parts sum to the outermost operators' time: 10 + 2 on thread 1, 5 on thread 2
    assert sum(e["dur"] for e in parts) == 17


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=12))
def test_self_time_ops_partition_the_outermost_spans(shape):
    """Random nestings (each operator (children, own time) in a depth-first layout): the parts never overlap
    and sum to the outermost operators' time, and each operator keeps exactly its own time."""
    ev, t, own = [], 0.0, {}

    def build(i, depth):  # lays out operator i and its children from t; returns the next unused operator
        nonlocal t
        kids, mine = shape[i]
        op = dict(name=f"op{i}", ts=t, pid=1, tid=1)
        ev.append(op)
        t += mine / 2  # half its own time before its children, half after
        j = i + 1
        for _ in range(kids if depth < 3 else 0):
            if j >= len(shape):
                break
            j = build(j, depth + 1)
        t += mine - mine / 2
        op["dur"] = t - op["ts"]
        own[op["name"]] = mine
        return j
    i = 0
    while i < len(shape):
        i = build(i, 0)
        t += 1.0
    parts = sorted(decompose.self_time_ops(ev), key=lambda e: e["ts"])
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-9 for a, b in zip(parts, parts[1:]))
    mine = defaultdict(float)
    for e in parts:
        mine[e["name"]] += e["dur"]
    assert dict(mine) == pytest.approx(own)


def test_graph_trace_without_kernels_is_invalid():
    """Negative control: a graph trace where the profiler saw only the kernels outside the graph."""
    argmax = [dict(name="reduce_kernel<ArgMaxOps>", ts=100.0 * i, dur=3.0) for i in range(4)]
    results, problems = decompose.summarize_trace(argmax, 4, "graph", layers=27)
    assert problems and "graph" in problems[0] and "shares" not in results
    many = [dict(name=f"gemv_kernel_{j}", ts=100.0 * i + 3 * j, dur=2.0) for i in range(4) for j in range(30)]
    results, problems = decompose.summarize_trace(many, 4, "graph", layers=27)
    assert not problems and results["shares"]["gemm"] == 1.0 and results["kernels_per_step"] == 30


# ---- bench_e2e: a peer that does not fit ------------------------------------------------------------

def test_a_peer_out_of_memory_is_a_skip_not_a_failure():
    oom = bench_e2e.peer_measured(None, "out of memory: CUDA out of memory. Tried to allocate 128.00 GiB", 1, "hf")
    assert not oom.invalid and oom.tok_s is None and oom.reason.startswith("hf not measured (does not fit")
    crash = bench_e2e.peer_measured(None, "RuntimeError: boom", 1, "hf")
    assert crash.invalid and crash.reason == "hf: RuntimeError: boom"
    ours = bench_e2e.measured(None, "out of memory: CUDA out of memory.", 1, "ours")
    assert ours.invalid  # our own OOM still voids the record


# ---- bench_ab: model-level A/B of launch configs ---------------------------------------------------

CANDIDATE = "benchmarks.candidates.moe_grouped"


def test_ab_variant_parsing_rejects_what_it_cannot_apply(capsys):
    from benchmarks import bench_ab
    assert bench_ab.parse_variant(f'x={CANDIDATE}:{{"use": ["down"]}}') == ("x", CANDIDATE, {"use": ["down"]})
    assert bench_ab.parse_variant(f"x={CANDIDATE}:{{}}") == ("x", CANDIDATE, {})  # a candidate as it stands
    for bad in ("x", "x=kda_chunk", "=kda_chunk:{}", 'x=kda_chunk:{"scan_warps"', "x=kda_chunk:[1]",
                "x=kda_chunk:{}", f"x={CANDIDATE}", f"x={CANDIDATE}@HEAD"):
        with pytest.raises(Exception):
            bench_ab.parse_variant(bad)
    # each fails before any model is built: an unknown key, a `use` of no kernel, a reserved name, and the grouped
    # kernels' old name, which is no kernel module of model.triton
    for variant, why in ((f'x={CANDIDATE}:{{"tiles": 1}}', "unknown cfg keys ['tiles']"),
                         (f'x={CANDIDATE}:{{"use": []}}', "'use' must name one or both of"),
                         (f'defaults={CANDIDATE}:{{"use": ["down"]}}', "not 'defaults'"),
                         ('x=moe_grouped:{"use": ["down"]}', "model.triton.moe_grouped")):
        with pytest.raises(SystemExit):
            bench_ab.main(["--preset", "tiny", "--device", "cpu", "--variant", variant])
        assert why in capsys.readouterr().err, variant


def test_ab_applied_changes_only_the_named_keys_and_restores_them(monkeypatch):
    """A candidate arm installs the candidate for its block alone: the model's grouped experts call it with its
    CONFIG changed in the named keys only (JSON lists as tuples), nothing written; after the block, and after a
    change it refuses, the torch form runs again."""
    from benchmarks import bench_ab
    import model.triton as mt
    from benchmarks.candidates import moe_grouped
    from model import ops
    before = mt.plain(moe_grouped.CONFIG)
    seen = []

    def spy(x, order, offs, gate_up, down, K, cfg=None):  # the torch form's outputs: no Triton kernel runs
        seen.append(cfg)
        return ops.grouped_experts(x, order, offs, gate_up, down, K)
    monkeypatch.setattr(moe_grouped, "experts", spy)
    g = torch.Generator().manual_seed(0)
    x, idx, w = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5, 2), generator=g), torch.rand(5, 2)
    gate_up, down = torch.randn(3, 8, 8, generator=g), torch.randn(3, 8, 4, generator=g)
    ref = ops.moe_experts_grouped(x, idx, w, gate_up, down)
    with bench_ab.applied(CANDIDATE, {"use": ["down"], "down": {"tma": True}}):
        assert torch.equal(ops.moe_experts_grouped(x, idx, w, gate_up, down), ref)
    assert len(seen) == 1 and seen[0]["use"] == ("down",) and seen[0]["down"] == {**before["down"], "tma": True}
    assert {k: v for k, v in seen[0].items() if k not in ("use", "down")} == {
        k: v for k, v in before.items() if k not in ("use", "down")}
    ops.moe_experts_grouped(x, idx, w, gate_up, down)
    assert len(seen) == 1 and mt.plain(moe_grouped.CONFIG) == before
    with pytest.raises(KeyError, match=r"CONFIG\[.down.\]: unknown cfg keys \[.BQ.\]; its keys: \[.BK., "):
        with bench_ab.applied(CANDIDATE, {"down": {"BQ": 1}}):
            pass
    ops.moe_experts_grouped(x, idx, w, gate_up, down)
    assert len(seen) == 1 and mt.plain(moe_grouped.CONFIG) == before


def test_ab_candidate_arm_counts_only_the_calls_that_reach_its_kernels():
    """The positive control of the unreached-arm error: each grouped-experts call of the model inside the arm
    reaches the candidate's kernels once for each kernel its `use` names (Triton's interpreter, bf16), and
    installing it or checking its config is no call."""
    from benchmarks import bench_ab
    from model import ops
    g = torch.Generator().manual_seed(0)
    N, E, K, D, I = 6, 4, 2, 16, 8
    x = torch.randn(N, D, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).bfloat16()
    down = (torch.randn(E, D, I, generator=g) / I ** 0.5).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=g)
    tiles = dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=2)
    for use, calls in ((["down"], 1), (["gate_up", "down"], 2)):
        changes = {"use": use, "gate_up": tiles, "down": tiles}

        def run(n):
            with bench_ab.applied(CANDIDATE, changes), ops.use("triton"):
                for _ in range(n):
                    ops.moe_experts_grouped(x, idx, w, gate_up, down)
        assert bench_ab.calls_during(CANDIDATE, changes, lambda: run(2)) == 2 * calls
        assert bench_ab.calls_during(CANDIDATE, changes, lambda: run(0)) == 0


@pytest.mark.slow  # the whole tiny model through Triton's interpreter (a minute or more)
def test_ab_quick_end_to_end(records_dir, monkeypatch):
    """On the tiny preset on the CPU, the kernels through Triton's interpreter: a record per variant and length,
    both arms timed in every round, the logits compared (fp32 inputs take the chunk kernel's `exact` config, which
    these variants leave alone: the defaults' bits)."""
    from benchmarks import bench_ab
    monkeypatch.setenv("KIMI_KERNELS", "triton")
    recs = bench_ab.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill", "9,17",
                          "--rounds", "2", "--variant", 'a=kda_chunk:{"scan_warps": 2}',
                          "--variant", 'b=kda_chunk:{"prep_stages": 2}'])
    assert [(r["params"]["variant"], r["params"]["T"]) for r in recs] == [("a", 9), ("b", 9), ("a", 17), ("b", 17)]
    for r in recs:
        res = r["results"]
        assert r["verdict"] == "VALID" and r["kind"] == "kernel" and r["params"]["op"] == "prefill_ab"
        assert len(res["samples_ms"]) == len(res["peer_samples_ms"]) == 2 and res["same_bits"]
        assert res["paired_ratio_min"] <= res["paired_ratio_median"] <= res["paired_ratio_max"]
    assert len(load("kernel", root=records_dir).records) == 4
    assert all(r["results"]["timing"].startswith("host clock") for r in recs)   # not "CUDA events" on a CPU


def test_ab_config_arm_that_no_call_reaches_is_an_error(records_dir, capsys):
    """The negative control: on a CPU the model's MoE never runs the grouped experts (CUDA only), where a candidate
    is installed, so an A/B of it would time the defaults twice and call it VALID; it is an error, and no record is
    written. A value of the wrong kind is refused before the model is built."""
    from benchmarks import bench_ab
    with pytest.raises(SystemExit):
        bench_ab.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill", "9", "--rounds", "1",
                       "--variant", f'a={CANDIDATE}:{{"use": ["down"]}}'])
    assert f"no call of the prefill reached {CANDIDATE}, so the arm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_ab.main(["--preset", "tiny", "--device", "cpu", "--variant", 'x=kda_chunk:{"scan_warps": "eight"}'])
    assert "'scan_warps' must be a number as its default 4 is, got 'eight'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_ab.main(["--preset", "tiny", "--variant", 'x=kda_chunk:{"scan_warps": 2}'] +
                      ([] if not torch.cuda.is_available() else ["--device", "cuda:99"]))
    assert len(load("kernel", root=records_dir).records) == 0


def test_ab_logits_that_moved_make_the_record_invalid(records_dir):
    """The negative control: a variant whose logits moved by order 1, or went non-finite, is INVALID."""
    from benchmarks import bench_ab
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 64, generator=g)
    def clocks(mhz, cap):
        return {"samples": 10, "sm_mhz_mean": mhz, "sm_mhz_min": mhz - 100, "power_w_mean": 650.0,
                "power_w_max": 700.0, "power_cap_share": cap, "hw_slowdown_share": 0.0, "thermal_share": 0.0}
    out = {"defaults": {"samples": [10.0, 11.0], "logits": ref, "clocks": [clocks(1900, 0.0), clocks(1800, 0.5)],
                        "host_ms": [9.6, 5.0]},
           "close": {"samples": [9.0, 10.0], "logits": ref + 1e-4 * torch.randn(1, 64, generator=g),
                     "host_ms": [9.0, 10.0]},
           "moved": {"samples": [9.0, 10.0], "logits": ref.flip(-1)},
           "nan": {"samples": [9.0, 10.0], "logits": torch.full_like(ref, float("nan"))}}
    variants = [(n, CANDIDATE, {"use": ["down"]}) for n in ("close", "moved", "nan")]
    recs = bench_ab.ab_records({"preset": "tiny", "model_dtype": "float32", "weights": "w"}, 64, variants, out, "cpu")
    assert [r["verdict"] for r in recs] == ["VALID", "INVALID", "INVALID"]
    assert "differ" in recs[1]["reasons"][0] and "finite" in recs[2]["reasons"][0]
    assert recs[0]["results"]["paired_ratio_median"] == pytest.approx((0.9 + 10.0 / 11.0) / 2)
    peer = recs[0]["results"]["clocks_peer"]
    assert peer["sm_mhz_mean"] == 1850 and peer["power_cap_share"] == 0.25 and peer["sm_mhz_min"] == 1700
    assert peer["samples"] == 20 and "clocks_ours" not in recs[0]["results"]
    res = recs[0]["results"]  # the host's time in each call, and the calls it paced (host >= 0.95 x GPU)
    assert (res["host_ms"], res["host_paced"], res["peer_host_ms"], res["peer_host_paced"]) == ([9.0, 10.0], 2,
                                                                                                [9.6, 5.0], 1)
    assert "host_ms" not in recs[1]["results"]


def _git_head() -> str | None:
    from records.store import git
    head = git("rev-parse", "HEAD")
    return head.strip() if head else None


@pytest.mark.slow  # the tiny model's prefill through the interpreter, once per arm and round (about 40 s)
def test_ab_code_arm_runs_the_module_as_it_was_at_a_commit(records_dir, monkeypatch):
    """NAME=MODULE@REV: the arm's prefill calls the kernel module as it was at REV. At HEAD (a fresh clone's working
    tree) that is today's code: the defaults' bits, and the arm's calls counted; today's module is back after it."""
    import sys
    from benchmarks import bench_ab
    import model.triton.kda_chunk as kc
    head = _git_head()
    if head is None:
        pytest.skip("not a git checkout: a code arm reads the module from git")
    monkeypatch.setenv("KIMI_KERNELS", "triton")  # the CPU path through Triton's interpreter, so prefill calls kc
    assert bench_ab.parse_variant("old=kda_chunk@HEAD~1") == ("old", "kda_chunk", {"@": "HEAD~1"})
    (r,) = bench_ab.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill", "9",
                          "--rounds", "1", "--variant", "head=kda_chunk@HEAD"])
    assert r["verdict"] == "VALID" and r["results"]["same_bits"], r["results"]
    assert r["params"]["module"] == "kda_chunk" and r["params"]["changes"] == {"@": head}
    assert bench_ab.code_calls("kda_chunk", head) >= 2  # the untimed call and the round's, at least
    assert sys.modules["model.triton.kda_chunk"] is kc and sys.modules["model.triton"].kda_chunk is kc


def test_ab_code_arm_that_no_call_reaches_is_an_error(records_dir, monkeypatch, capsys):
    """The negative control: with the torch forms no call reaches model.triton, so the arm would time the defaults
    twice; it is an error instead. An unknown revision fails before any model is built."""
    from benchmarks import bench_ab
    if _git_head() is None:
        pytest.skip("not a git checkout: a code arm reads the module from git")
    monkeypatch.setenv("KIMI_KERNELS", "torch")
    with pytest.raises(SystemExit):
        bench_ab.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill", "9", "--rounds", "1",
                       "--variant", "head=kda_chunk@HEAD"])
    assert "no call of the prefill reached model.triton.kda_chunk as it was at" in capsys.readouterr().err
    for bad, why in (("x=kda_chunk@no-such-revision", "git bundle create"),
                     ("x=no_such_module@HEAD", "no_such_module")):
        with pytest.raises(SystemExit):
            bench_ab.main(["--preset", "tiny", "--device", "cpu", "--variant", bad])
        assert why in capsys.readouterr().err, bad  # an unknown revision says how a copy of the tree gets one
    assert len(load("kernel", root=records_dir).records) == 0


def test_ab_varies_the_clock_sampler_through_the_timing_config():
    """A variant can name a dotted module's CONFIG: benchmarks.timing's sampler mode, for the sampler's own A/B."""
    from benchmarks import bench_ab, timing
    with bench_ab.applied("benchmarks.timing", {"clocks": "off"}):
        assert timing.clock_sampler("cpu").where == "off"
    assert timing.CONFIG["clocks"] == "process" and timing.clock_sampler("cpu").where == "process"
    with pytest.raises(TypeError):
        timing.CONFIG["clocks"] = "off"  # read-only: a change is scoped to a block
    with pytest.raises(KeyError, match="unknown keys"):
        with timing.configured({"sampler": "off"}):
            pass
    with pytest.raises(KeyError, match="no CONFIG"):
        bench_ab.changed_config("benchmarks.roofline", {"x": 1})
    with pytest.raises(KeyError):
        bench_ab.changed_config("benchmarks.timing", {"sampler": "off"})


def test_clock_summary_counts_each_slowdown_reason():
    from benchmarks import gpu_clocks as gc_
    rows = [(1980.0, 400.0, 0), (1755.0, 700.0, gc_.POWER_CAP), (1600.0, 690.0, gc_.POWER_CAP | 0x20),
            (1500.0, 710.0, gc_.POWER_BRAKE)]
    s = gc_.summarize_clocks(rows, {"power_limit_w": 700.0})
    assert s["samples"] == 4 and s["sm_mhz_min"] == 1500.0 and s["power_w_max"] == 710.0
    assert s["sm_mhz_mean"] == pytest.approx((1980 + 1755 + 1600 + 1500) / 4)
    assert (s["power_cap_share"], s["thermal_share"], s["hw_slowdown_share"]) == (0.5, 0.25, 0.25)
    assert s["power_limit_w"] == 700.0


class _FakeNvml:
    """Stands in for `gpu_clocks.Nvml` where no driver runs (the CPU machine): a fixed sample."""
    limits = {"sm_mhz_max": 1980.0, "power_limit_w": 700.0}

    def read(self):
        return (1700.0, 650.0, 0x4)


def test_clock_sampler_without_nvml_records_nothing_wherever_it_runs():
    """On a machine without the driver every mode records nothing and the summary is None; the process mode's
    child says why and exits (a real child process, not a stand-in). An unknown mode is an error."""
    from benchmarks import gpu_clocks as gc_
    try:
        gc_.Nvml(0)
        pytest.skip("NVML runs here: the GPU tests cover the sampling")
    except Exception:
        pass
    for where in gc_.WHERE:
        s = gc_.ClockSampler(where=where)
        with s:
            time.sleep(0.01)
        assert s.summary() is None and s.rows == [], where
    server = gc_._server(0, 0.002)
    assert server.error and server.proc.wait(timeout=10) == 0, server.error
    with pytest.raises(ValueError, match="where"):
        gc_.ClockSampler(where="fiber")


def test_clock_server_protocol_samples_between_start_and_stop():
    """`serve`, the child's loop, over real pipes with a stand-in reader: the limits first, then per start/stop a
    block of samples; it exits at the end of its input. Without NVML: one error
    line, then it exits."""
    import io
    import os
    import threading
    from benchmarks import gpu_clocks as gc_
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    inp, to_child = os.fdopen(r_in, "r"), os.fdopen(w_in, "w")
    out, from_child = os.fdopen(w_out, "w"), os.fdopen(r_out, "r")
    child = threading.Thread(target=gc_.serve, args=(_FakeNvml(), 0.001, inp, out), daemon=True)
    child.start()
    assert json.loads(from_child.readline()) == _FakeNvml.limits
    for _ in range(2):
        to_child.write("start\n")
        to_child.flush()
        assert from_child.readline() == "ok\n"
        time.sleep(0.05)
        to_child.write("stop\n")
        to_child.flush()
        got = json.loads(from_child.readline())
        assert len(got["rows"]) > 5 and got["rows"][0] == [1700.0, 650.0, 4]
    to_child.close()
    child.join(timeout=5)
    assert not child.is_alive(), "serve must exit at the end of its input"
    err = io.StringIO()
    gc_.serve(RuntimeError("no driver"), 0.001, io.StringIO("start\n"), err)
    assert json.loads(err.getvalue()) == {"error": "RuntimeError: no driver"}


def test_clock_sampler_thread_samples_until_the_block_ends():
    """The thread mode (kept for the A/B against the child process): samples until the block ends."""
    from benchmarks.gpu_clocks import ClockSampler
    s = ClockSampler(interval_s=0.001, where="thread")
    s._nvml, s.limits = _FakeNvml(), dict(_FakeNvml.limits)
    with s:
        time.sleep(0.05)
    n = len(s.rows)
    time.sleep(0.02)
    assert n == len(s.rows) > 5, "sampling must stop with the block"
    summ = s.summary()
    assert summ["power_cap_share"] == 1.0
    assert summ["power_limit_w"] == 700.0 and summ["sampler"] == "thread"



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_clock_sampler_reads_the_gpu_from_its_child_process_and_its_thread():
    """On the H200: both modes sample the SM clock over seconds of bf16 GEMMs, at about the interval asked for;
    time_calls says where its samples were taken."""
    from benchmarks.gpu_clocks import ClockSampler
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    for where in ("process", "thread"):
        s = ClockSampler(0, 0.01, where)
        t = time.perf_counter()
        with s:
            for _ in range(300):
                a @ a
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        summ = s.summary()
        assert summ is not None and summ["samples"] >= 0.5 * wall / 0.01, (where, summ, wall)
        assert 0 < summ["sm_mhz_mean"] <= summ["sm_mhz_max"] and summ["sampler"] == where, summ
    c = time_calls(lambda: [a @ a for _ in range(50)], 2, "cuda").clocks
    assert c["samples"] > 0 and c["sampler"] == "process", c


def test_energy_sustained_run_counts_calls_and_the_counter_over_the_window():
    """`bench_energy`'s window on the CPU with a stand-in counter (the board's is NVML's): at least two calls,
    each after its setup, and the counter's difference over the whole window; per call and per token after."""
    from benchmarks import bench_energy
    calls, setups, joules = [], [], iter([100.0, 160.0])
    run = bench_energy.sustained(lambda: calls.append(1), 0.02, "cpu", lambda: next(joules),
                                 setup=lambda: setups.append(1))
    assert run["calls"] == len(calls) == len(setups) >= 2 and run["joules"] == 60.0 and run["seconds"] >= 0.02
    s = bench_energy.summarize_side({"calls": 4, "seconds": 2.0, "joules": 1400.0}, 1000)
    assert (s["ms"], s["j_per_token"], s["watts"]) == (500.0, 0.35, 700.0)


def test_energy_record_says_the_peer_over_ours(records_dir):
    from benchmarks import bench_energy
    ours = bench_energy.summarize_side({"calls": 30, "seconds": 4.0, "joules": 2800.0}, 8192)
    peer = bench_energy.summarize_side({"calls": 13, "seconds": 4.1, "joules": 2255.0}, 8192)
    rec = bench_energy.energy_record({"preset": "48b-a3b", "model_dtype": "bfloat16", "weights": "w"}, 8192, 0,
                                     ours, peer, {"ours": 90.0, "peer": 91.0}, "cpu")
    r = rec["results"]
    assert r["energy_ratio"] == pytest.approx((2255.0 / 13) / (2800.0 / 30))
    assert r["speedup"] == pytest.approx((4100.0 / 13) / (4000.0 / 30)) and r["peer"] == "hf-fla"
    assert rec["params"]["op"] == "prefill_energy" and load("kernel", root=records_dir).records[0]["id"] == rec["id"]
    assert rec["verdict"] == "VALID"
    bad = bench_energy.energy_record({"preset": "48b-a3b", "model_dtype": "bfloat16", "weights": "w"}, 8192, 1,
                                     ours, peer, {"ours": 90.0, "peer": 91.0}, "cpu",
                                     ["ours: last logits not all finite"])
    assert bad["verdict"] == "INVALID" and "finite" in bad["reasons"][0]  # the negative control


def test_energy_bench_refuses_without_cuda_before_loading_anything():
    from benchmarks import bench_energy
    if torch.cuda.is_available():
        pytest.skip("CUDA here: the device run is the check")
    with pytest.raises(SystemExit):
        bench_energy.main(["--preset", "tiny"])
    with pytest.raises(SystemExit):
        bench_energy.main(["--rounds", "0"])

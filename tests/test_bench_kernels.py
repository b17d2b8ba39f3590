"""The kernel benchmarks' registry and command line (`python -m benchmarks.kernels`) on the CPU: the ops of `--ops`
are the registry's, every bench declares what it times and checks, the runner's order and records, the shared
clocks and the list arguments."""
import dataclasses

import pytest
import torch

from benchmarks.cli import ints
from benchmarks.kernels import common, runner
from benchmarks.kernels.registry import DEFAULT_OPS, REGISTRY, cases, studies
from benchmarks.kernels.spec import Bench, Size, Sweep, resolve
import model.triton as mt
from model.triton import kda_decode
from model.triton.kda_chunk import CONFIG

# the options of the command line, each with its default where it takes a value
OPTIONS = {"--ops": "chunk_kda,kda_decode_step,mla_decode,causal_conv1d,moe_combine",
           "--chunk-T": (1024, 8192, 32768), "--decode-B": (1, 8, 64), "--mla-T": (1024, 32768, 131072),
           "--prefill-T": (8192,), "--moe-N": (1, 8), "--moe-sweep": False, "--decode-sweep": False,
           "--chunk-sweep": False, "--conv-sweep": False, "--sweep-keys": None, "--rep-ms": 200}


@pytest.fixture
def records_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    return tmp_path


# ---- the registry and the command line ----------------------------------------------------------------

def test_the_ops_of_the_command_line_are_the_registrys(capsys):
    """--ops takes exactly the registry's ops (its help lists them, an unknown one is refused naming them all), its
    default is the registry's default ops, and every option keeps its name and default."""
    ap = runner.parser()
    actions = {a.option_strings[0]: a for a in ap._actions if a.option_strings and a.dest != "help"}
    assert {k: a.default for k, a in actions.items()} == OPTIONS
    assert ",".join(DEFAULT_OPS) == OPTIONS["--ops"]
    assert actions["--ops"].help == "comma-separated: " + ", ".join(REGISTRY)
    with pytest.raises(SystemExit) as e:
        runner.main(["--ops", "bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1] == (
        f"{runner.PROG}: error: --ops: unknown ['bogus']; the ops: " + ", ".join(sorted(REGISTRY)))


def test_every_bench_declares_inputs_ours_peer_check_and_sizes():
    for op, b in REGISTRY.items():
        assert isinstance(b, Bench) and b.op == op
        assert callable(b.inputs), op
        assert callable(resolve(b.ours)), (op, b.ours)
        assert b.peer, op
        if b.peer_fn is not None and not b.peer_fn.startswith("fla."):  # fla: imported by load_fla when it runs
            assert callable(resolve(b.peer_fn)), (op, b.peer_fn)
        assert b.check and isinstance(b.tol, float) and b.tol >= 0, op
        assert isinstance(b.sizes, Size) and (b.sizes.flag is None) == (b.sizes.default == ()), op
        assert (b.case is None) != (b.study is None), f"{op}: a case or a study, one of them"
        assert b.size_key in ("T", "B") and all(cmp in ("<", "<=") for _, _, cmp in b.targets), op
        if b.sweep is not None:
            assert isinstance(b.sweep, Sweep) and len(b.sweep.configs()) > 0 and b.sweep.tol >= 0, op
            assert (b.sweep.flag is None) == (b.sweep.help is None), op
            # a flagged sweep of a case bench runs after its cases; a study's is run by the study (`swept`)
            assert (b.sweep.run is not None) == (b.sweep.flag is not None and b.case is not None), op
    assert [b.op for b in REGISTRY.values() if b.fla] == ["chunk_kda", "kda_decode_step"]


def test_sweep_grids_are_read_when_called(monkeypatch):
    """A sweep's `configs()` is the grid as its module holds it now, so that what a test narrows is what runs."""
    from benchmarks.kernels import chunk_kda
    monkeypatch.setattr(chunk_kda, "CHUNK_SWEEP", [dict(slice=16)])
    assert REGISTRY["chunk_kda"].sweep.configs() == [dict(slice=16)]


def test_runner_runs_cases_size_by_size_then_sweeps_summary_and_studies(monkeypatch):
    """The run's order with every case, sweep and study faked: each group of cases (ops sharing a size option) size
    by size, its flagged sweeps after it, the summary, then the studies; fla is loaded only for an fla bench."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "kernel_record", lambda params, results, reasons, device: {
        "params": params, "results": results, "verdict": "INVALID" if reasons else "VALID", "reasons": reasons})
    monkeypatch.setattr(runner, "load_fla", lambda: calls.append("load_fla") or (None, "peer unavailable: test"))
    monkeypatch.setattr(runner, "summarize", lambda recs: calls.append(("summary", len(recs))))

    def fake_case(op):
        def case(n, *rest):
            calls.append((op, n))
            return {"ours_ms": 1.0, "peer_ms": 2.0, "rel_err_vs_peer": 0.0}, []
        return case

    for op, b in REGISTRY.items():
        sweep = b.sweep and dataclasses.replace(b.sweep, run=b.sweep.run and (
            lambda n, rep_ms, keys, op=op: calls.append((op + " sweep", n, rep_ms, keys))))
        b = dataclasses.replace(b, sweep=sweep)
        if b.case is not None:
            b = dataclasses.replace(b, case=fake_case(op))
        else:
            b = dataclasses.replace(b, study=lambda sizes, rep_ms, swept, op=op: calls.append((op, sizes, swept)))
        monkeypatch.setitem(REGISTRY, op, b)
    runner.main(["--ops", "moe_decode,moe_combine,causal_conv1d,mla_absorb", "--prefill-T", "16,32",
                 "--conv-sweep", "--moe-N", "2", "--rep-ms", "5", "--sweep-keys", "BT"])
    assert calls == [("causal_conv1d", 16), ("moe_combine", 16), ("causal_conv1d", 32), ("moe_combine", 32),
                     ("causal_conv1d sweep", 16, 5, {"BT"}), ("causal_conv1d sweep", 32, 5, {"BT"}),
                     ("summary", 4), ("mla_absorb", (), False), ("moe_decode", (2,), False)]
    calls.clear()
    runner.main(["--ops", "kda_decode_step", "--decode-B", "4"])
    assert calls == ["load_fla", ("kda_decode_step", 4), ("summary", 1)]
    assert [[b.op for b in g] for g in cases()] == [["chunk_kda"], ["kda_decode_step"], ["mla_decode"],
                                                    ["causal_conv1d", "moe_combine", "moe_prefill"]]
    assert [b.op for b in studies()] == ["mla_absorb", "mla_decode_layout", "mla_decode_rows", "moe_prefill_rows",
                                         "moe_decode"]


def test_kernel_records_carry_the_launch_config_they_ran(records_dir):
    """A kernel's default config changes (the chunk length did): each vs-peer record names the one in force."""
    fake = lambda n, peer, rep_ms: ({"ours_ms": 1.0, "peer_ms": 2.0, "rel_err_vs_peer": 0.0}, [])  # noqa: E731
    chunk_bench = dataclasses.replace(REGISTRY["chunk_kda"], case=fake)
    step_bench = dataclasses.replace(REGISTRY["kda_decode_step"], case=fake)
    chunk = runner.run_case(chunk_bench, 8192, None, None, 1, device="cpu")
    step = runner.run_case(step_bench, 64, None, None, 1, device="cpu")
    assert chunk["params"]["cfg"] == CONFIG and step["params"]["cfg"] == kda_decode.DECODE
    assert (chunk["params"]["B"], chunk["params"]["T"], step["params"]["B"], step["params"]["T"]) == (1, 8192, 64, 1)
    changed = dict(BV=32, num_warps=2, grid="adjacent")  # another config in force: the record follows it
    with mt.overrides({"kda_decode.DECODE": changed}):
        assert runner.run_case(step_bench, 64, None, None, 1, device="cpu")["params"]["cfg"] == {
            **kda_decode.DECODE.defaults, **changed}


def test_a_case_that_raises_is_an_invalid_record_and_the_run_goes_on(records_dir):
    def broken(n, rep_ms):
        raise RuntimeError("out of memory")

    rec = runner.run_case(dataclasses.replace(REGISTRY["mla_decode"], case=broken), 1024, None, None, 1, device="cpu")
    assert rec["verdict"] == "INVALID" and rec["reasons"] == ["mla_decode failed: RuntimeError: out of memory"]
    assert rec["results"] == {"peer": "torch-einsum"} and rec["params"]["H"] == 32 and rec["params"]["d"] == 576


def test_kernel_bench_cli_rejects_bad_lists(capsys):
    """The list arguments go through the shared `benchmarks.cli.ints`: a bad list is an argparse error naming it,
    raised before anything is timed (this machine has no GPU, which would be the next error)."""
    assert ints("1,8, 64") == (1, 8, 64)
    for bad in ("1,x", "0,8"):
        with pytest.raises(SystemExit) as e:
            runner.main(["--decode-B", bad])
        assert e.value.code == 2 and "--decode-B" in capsys.readouterr().err


# ---- the shared clocks ---------------------------------------------------------------------------------

def test_kernel_ms_sums_the_work_of_one_call():
    """`kernel_ms` on the CPU (operators' own time stands for kernels): a call of two matmuls takes about twice the
    time of a call of one, and nothing is counted from outside the calls."""
    a = torch.randn(384, 384)
    # One intra-op thread: with two, another process on a 2-core machine stalls a matmul at its threads' barrier
    # (seen: 4.9x for two matmuls, with a second pytest running beside CI). The least of three alternating runs
    # each: a stray slow spell (or the first profile a process takes) lands on one run, not on the ratio.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one, two = (min(ms) for ms in zip(*[(common.kernel_ms(lambda: a @ a, "cpu", n=20),
                                              common.kernel_ms(lambda: (a @ a, a @ a), "cpu", n=20))
                                             for _ in range(3)]))
    finally:
        torch.set_num_threads(threads)
    assert one > 0 and 1.3 < two / one < 3.0, (one, two)

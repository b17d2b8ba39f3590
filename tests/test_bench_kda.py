"""The KDA kernel benchmarks (chunk_kda, kda_decode_step) and the prefill conv's (causal_conv1d) on the CPU, through
Triton's interpreter at small shapes with fake clocks: the sweeps' plumbing and checks, and the decode step against
a peer. Shapes are patched on the bench module, clocks on `benchmarks.kernels.common`."""
import pytest
import torch

from benchmarks.kernels import causal_conv1d, chunk_kda, common, kda_decode_step
from model import kda
from model.triton import conv, kda_chunk, kda_decode
from records.store import load


@pytest.fixture
def records_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    monkeypatch.setenv("FLA_FLASH_KDA", "0")  # load_fla sets it when unset; keep the test process unchanged
    return tmp_path


def fake_graph_ms(calls):
    return ([c() for c in calls], 0.01)[1]


# ---- kda_decode_step: the sweep ------------------------------------------------------------------

@pytest.mark.slow  # every config of the sweep through the interpreter: tens of seconds
def test_decode_sweep_plumbing(records_dir, monkeypatch):
    """`--ops kda_decode_step --decode-sweep` on the CPU through the interpreter, small shapes, a fake clock:
    every config of DECODE_SWEEP (each grid) runs, matches the default config's output and is recorded VALID
    with its whole config."""
    for name, value in (("H", 2), ("D", 32)):
        monkeypatch.setattr(kda_decode_step, name, value)
    monkeypatch.setattr(common, "GRAPH_LAYERS", 2)
    monkeypatch.setattr(common, "graph_ms", fake_graph_ms)
    recs = kda_decode_step.decode_sweep(2, device="cpu")
    assert all(r["verdict"] == "VALID" for r in recs), [r["reasons"] for r in recs if r["verdict"] != "VALID"]
    assert [r["params"]["cfg"]["grid"] for r in recs] == [c["grid"] for c in kda_decode_step.DECODE_SWEEP]
    assert {c["grid"] for c in kda_decode_step.DECODE_SWEEP} == {"strided", "adjacent"}
    assert all(r["results"]["rel_err_vs_default"] <= 1e-5 for r in recs)
    assert len(load(kinds="kernel", root=records_dir).records) == len(kda_decode_step.DECODE_SWEEP)


def test_decode_sweep_flags_a_config_that_computes_something_else(records_dir, monkeypatch):
    """The check against the default config's output must be able to fail: a config whose step is 1% off (far
    past bf16 rounding, which DECODE_SWEEP_TOL allows) is recorded INVALID, the others stay VALID."""
    for name, value in (("H", 2), ("D", 32),
                        ("DECODE_SWEEP", [dict(grid="strided", BV=16, num_warps=1), dict(grid="adjacent", BV=16,
                                                                                           num_warps=1)])):
        monkeypatch.setattr(kda_decode_step, name, value)
    monkeypatch.setattr(common, "GRAPH_LAYERS", 2)
    monkeypatch.setattr(common, "graph_ms", fake_graph_ms)
    real = kda_decode.fused_kda_decode

    def off_when_adjacent(*args, cfg=None, **kw):
        o = real(*args, cfg=cfg, **kw)
        return o * 1.01 if cfg and cfg["grid"] == "adjacent" else o

    monkeypatch.setattr(kda_decode, "fused_kda_decode", off_when_adjacent)
    recs = kda_decode_step.decode_sweep(2, device="cpu")
    assert [r["verdict"] for r in recs] == ["VALID", "INVALID"]
    assert "differs from the default config" in recs[1]["reasons"][0]


# ---- chunk_kda and causal_conv1d: the sweeps ------------------------------------------------------

@pytest.mark.slow  # every config of the sweep through the interpreter: tens of seconds
def test_chunk_sweep_plumbing_and_its_check(records_dir, monkeypatch):
    """`--ops chunk_kda --chunk-sweep` on the CPU through the interpreter, small shapes, a fake clock: every
    config runs, matches the default's output and is recorded VALID with its whole config; and the check can
    fail: a config whose output is 5% off (past bf16 rounding, which CHUNK_SWEEP_TOL allows) is INVALID."""
    for name, value in (("H", 2), ("D", 32), ("CHUNK_SWEEP", [dict(slice=32), dict(slice=16),
                                                              dict(scan_bv=16, scan_warps=4), dict(prep_warps=8)])):
        monkeypatch.setattr(chunk_kda, name, value)
    monkeypatch.setattr(common, "gpu_ms", lambda fn, rep_ms: (fn(), 0.5)[1])
    real = kda_chunk.chunk_kda_fwd

    def off_at_8_warps(*args, cfg=None, **kw):
        o, ht = real(*args, cfg=cfg, **kw)
        return (o * 1.05, ht) if cfg and cfg.get("prep_warps") == 8 else (o, ht)

    monkeypatch.setattr(kda_chunk, "chunk_kda_fwd", off_at_8_warps)
    recs = chunk_kda.chunk_sweep(70, rep_ms=1, device="cpu")
    assert [r["verdict"] for r in recs] == ["VALID", "VALID", "VALID", "INVALID"], [r["reasons"] for r in recs]
    assert all(r["results"]["rel_err_vs_default"] <= 1e-2 for r in recs[:3])
    assert "differs from the default config" in recs[3]["reasons"][0]
    assert recs[1]["params"]["cfg"] == {**kda_chunk.CONFIG, "slice": 16}
    assert len(load(kinds="kernel", root=records_dir).records) == 4
    # --sweep-keys: only the configs that change nothing outside the keys named
    recs = chunk_kda.chunk_sweep(70, rep_ms=1, device="cpu", keys={"scan_bv", "scan_warps"})
    assert [r["params"]["cfg"]["scan_bv"] for r in recs] == [16]


def test_conv_sweep_plumbing_and_its_exact_check(records_dir, monkeypatch):
    """`--ops causal_conv1d --conv-sweep` on the CPU through the interpreter, small shapes, a fake clock: each tile
    config gives the default's bits and is recorded VALID with its whole config; a config with one element off is
    INVALID (the tolerance is 0: every tile must give torch's bits)."""
    for name, value in (("H", 2), ("D", 16), ("CONV_SWEEP", [dict(BT=16, BC=64, num_warps=2), dict(BT=64),
                                                              dict(BC=32)])):
        monkeypatch.setattr(causal_conv1d, name, value)
    monkeypatch.setattr(common, "gpu_ms", lambda fn, rep_ms: (fn(), 0.5)[1])
    real = conv.causal_conv1d

    def off_at_bc32(x, w, taps=None, cfg=None):
        y, new_taps = real(x, w, taps, cfg)
        if cfg and cfg.get("BC") == 32:
            y = y.clone()
            y[0, 0, 0] += 0.125  # one element of 40 x 96 off
        return y, new_taps

    monkeypatch.setattr(conv, "causal_conv1d", off_at_bc32)
    recs = causal_conv1d.conv_sweep(40, rep_ms=1, device="cpu")
    assert [r["verdict"] for r in recs] == ["VALID", "VALID", "INVALID"], [r["reasons"] for r in recs]
    assert all(r["results"]["rel_err_vs_default"] == 0 for r in recs[:2])
    assert "differs from the default config" in recs[2]["reasons"][0]
    assert recs[1]["params"]["cfg"] == {**conv.CONFIG, "BT": 64} and recs[1]["params"]["sweep"]
    assert len(load(kinds="kernel", root=records_dir).records) == 3


# ---- kda_decode_step against the peer, graph-timed too ---------------------------------------------

def test_decode_case_times_both_sides_in_graphs(monkeypatch):
    """`decode_case` on the CPU through the interpreter, small shapes, fake clocks, the peer a torch recurrence
    with fla's signature: ours and the peer are compared, and both get a graph time beside the do_bench one;
    a peer that fails inside the graph leaves peer_graph_error and keeps the record's verdict."""
    for name, value in (("H", 2), ("D", 16)):
        monkeypatch.setattr(kda_decode_step, name, value)
    monkeypatch.setattr(common, "GRAPH_LAYERS", 2)
    monkeypatch.setattr(common, "gpu_ms", lambda fn, rep_ms: (fn(), 0.02)[1])
    monkeypatch.setattr(common, "eager_ms", lambda fn: (fn(), 0.03)[1])
    monkeypatch.setattr(common, "kernel_ms", lambda fn, device: (fn(), 0.04)[1])
    in_graph = []

    def counting_graph_ms(calls):
        in_graph.append(True)
        try:
            return ([c() for c in calls], 0.01 * len(in_graph))[1]
        finally:
            in_graph.pop()

    monkeypatch.setattr(common, "graph_ms", counting_graph_ms)

    def recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, fail=False):
        if fail and in_graph:
            raise RuntimeError("operation not permitted when stream is capturing")
        o, s = kda.naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                       dtype=torch.float32)
        return o.to(q.dtype), s

    res, reasons = kda_decode_step.decode_case(3, (None, recurrent, "torch"), 10, device="cpu")
    assert not reasons and res["rel_err_vs_peer"] < 2e-2
    assert (res["ours_ms"], res["peer_ms"], res["ours_graph_ms"], res["peer_graph_ms"]) == (0.02, 0.02, 0.01, 0.01)
    assert res["timing_graph"].startswith("cuda-graph of 2 layers")
    assert (res["ours_kernel_ms"], res["peer_kernel_ms"]) == (0.04, 0.04)
    assert res["timing_kernel"].startswith("profiler")
    res, reasons = kda_decode_step.decode_case(3, (None, lambda *a, **kw: recurrent(*a, **kw, fail=True), "torch"), 10,
                                  device="cpu")
    assert not reasons and "peer_ms" in res and "peer_graph_ms" not in res
    assert "capturing" in res["peer_graph_error"]

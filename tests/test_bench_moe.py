"""The MoE kernel benchmarks (moe_decode, moe_prefill_rows) on the CPU, through Triton's interpreter at small shapes
with fake clocks. Shapes are patched on the bench module, clocks on `benchmarks.kernels.common`."""
import pytest
import torch

from benchmarks import roofline
from benchmarks.kernels import common, moe_decode, moe_prefill_rows
from model import ops
from model.triton import moe
from records import store
from records.store import load


@pytest.fixture
def records_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    return tmp_path


# ---- moe_decode --------------------------------------------------------------------------------------

@pytest.mark.slow  # every MoE part and a sweep of six configs through Triton's interpreter (about 40 s)
def test_moe_decode_bench_plumbing(records_dir, monkeypatch):
    """`--ops moe_decode [--moe-sweep]` on the CPU through Triton's interpreter, at small shapes with a fake
    clock: every part is compared with its PyTorch form and recorded VALID with its bandwidth; the sweep
    records each config and every config computes what the peer does."""
    monkeypatch.setattr(moe_decode, "MOE_E", 16)
    monkeypatch.setattr(moe_decode, "MOE_D", 64)
    monkeypatch.setattr(moe_decode, "MOE_I", 32)
    monkeypatch.setattr(moe_decode, "MOE_K", 4)
    monkeypatch.setattr(common, "GRAPH_LAYERS", 3)
    monkeypatch.setattr(common, "graph_ms", lambda calls: ([c() for c in calls], 0.01)[1])
    monkeypatch.setattr(roofline, "measure_read_gbps", lambda device, nbytes, reps: 4000.0)
    grid = {"moe_gate_up": [dict(BLOCK_I=8, BLOCK_D=32, num_warps=4), dict(BLOCK_I=4, BLOCK_D=64, num_warps=4)],
            "moe_down": [dict(BLOCK_D=2, BLOCK_I=16, num_warps=4)], "moe_router": [dict(BLOCK_E=4, num_warps=4)]}
    monkeypatch.setattr(moe_decode, "moe_sweep_grid", lambda: grid)
    recs = moe_decode.run_moe([2], sweep=True, rep_ms=1, device="cpu")
    assert [r["params"]["kernel"] for r in recs] == list(moe_decode.MOE_PARTS) + [k for k, v in grid.items()
                                                                                 for _ in v]
    assert all(r["verdict"] == "VALID" for r in recs), [r["reasons"] for r in recs]
    assert len(load(kinds="kernel", root=records_dir).records) == len(recs)
    router, gate_up, down, layer, plain, normed = (r["results"] for r in recs[:6])
    assert router["bytes"] == 16 * 64 * 4 and router["routing_mismatch_tokens"] == 0
    experts = gate_up["bytes"] / (2 * 32 * 64 * 2)  # distinct routed experts + the shared one, mean of the layers
    assert 4 + 1 <= experts <= 8 + 1 and down["bytes"] == pytest.approx(experts * 64 * 32 * 2, abs=1)
    assert layer["bytes"] == router["bytes"] + gate_up["bytes"] + down["bytes"]
    assert layer["ours_gbps"] == pytest.approx(layer["bytes"] / 1e-5 / 1e9)
    assert layer["ours_frac_of_measured"] == pytest.approx(layer["ours_gbps"] / 4000.0)
    assert plain["rel_err_vs_peer"] == 0 and plain["peer"] == moe_decode.MOE_PLAIN_PEER
    assert plain["bytes"] == layer["bytes"]
    # the norm before the block: its bits do not depend on whether it signals; its bytes on top of the block's
    assert normed["rel_err_vs_peer"] == 0 and normed["peer"] == moe_decode.MOE_NORM_PEER
    assert normed["bytes"] == layer["bytes"] + (4 * 2 * 64 + 64) * 2
    assert recs[6]["params"]["sweep"] and recs[6]["params"]["cfg"] == grid["moe_gate_up"][0]
    assert recs[7]["params"]["cfg"] == grid["moe_gate_up"][1] and recs[7]["results"]["timing"].startswith("cuda-graph")


def test_moe_sweep_grid_holds_the_defaults():
    """Each kernel has a handful of configs to choose from, its default among them."""
    grid = moe_decode.moe_sweep_grid()
    assert all(len(grid[k]) >= 5 for k in ("moe_gate_up", "moe_down", "moe_router"))
    assert moe.GATE_UP in grid["moe_gate_up"] and moe.DOWN in grid["moe_down"] and moe.ROUTER in grid["moe_router"]


# ---- moe_prefill_rows --------------------------------------------------------------------------------

def test_moe_rows_case_plumbing(records_dir, monkeypatch):
    """`moe_rows_case` on the CPU at `tiny` (fake clock): one record with both sides timed, the padded rows of
    each side counted from its rows per expert, and the grouped GEMMs checked against per-expert torch.mm."""
    monkeypatch.setattr(moe_prefill_rows, "DTYPE", torch.float32)
    monkeypatch.setattr(common, "gpu_ms", lambda fn, rep_ms: (fn(), 0.02)[1])
    rec = moe_prefill_rows.moe_rows_case(64, 1, device="cpu", preset="tiny")
    x = rec["results"]
    assert rec["verdict"] == "VALID", rec["reasons"]
    assert x["ours_ms"] == x["peer_ms"] == 0.02 and x["peer"] == "balanced rows"
    assert x["rel_err_vs_per_expert_mm"] < 1e-5 and x["rows_per_expert_max"] >= x["rows_per_expert_min"]
    E, K = 8, 2  # tiny: 8 experts, top 2 -> 128 rows, 16 an expert when balanced, 112 padded in 128-row tiles
    assert list(moe_prefill_rows.balanced_counts(64 * K, E)) == [16] * E
    assert x["peer_tile_rows_wasted"] == E * (128 - 16)
    assert [r["id"] for r in store.load("kernel").records] == [rec["id"]]
    assert list(moe_prefill_rows.balanced_counts(10, 4)) == [3, 3, 2, 2]


def test_moe_rows_case_flags_grouped_gemms_that_compute_something_else(records_dir, monkeypatch):
    monkeypatch.setattr(moe_prefill_rows, "DTYPE", torch.float32)
    monkeypatch.setattr(common, "gpu_ms", lambda fn, rep_ms: (fn(), 0.02)[1])
    real = ops.grouped_mm
    monkeypatch.setattr(ops, "grouped_mm", lambda a, b, offs: real(a, b, offs) * 1.05)
    rec = moe_prefill_rows.moe_rows_case(64, 1, device="cpu", preset="tiny")
    assert rec["verdict"] == "INVALID" and "differ from per-expert torch.mm" in rec["reasons"][0]

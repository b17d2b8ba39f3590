"""The MLA kernel benchmarks (mla_decode_layout, mla_decode_rows, mla_absorb) on the CPU, through Triton's
interpreter at small shapes with a fake clock. Shapes are patched on the bench module, clocks on
`benchmarks.kernels.common`."""
import pytest

import model.triton as mt
from benchmarks.kernels import common, mla_absorb, mla_decode_layout, mla_decode_rows
from model.triton import mla_decode as ml
from records.store import load


@pytest.fixture
def records_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def fake_graph_ms(monkeypatch):
    monkeypatch.setattr(common, "graph_ms", lambda calls: ([c() for c in calls], 0.01)[1])


def test_mla_layout_bench_plumbing(records_dir, fake_graph_ms, monkeypatch):
    """`--ops mla_decode_layout` on the CPU through the interpreter, small shapes, a fake clock: each SHORT
    layout is compared with the all-heads layout and the fp32 reference and recorded VALID."""
    for name, value in (("MLA_H", 4), ("MLA_R", 32), ("MLA_P", 16),
                        ("MLA_LAYERS", 2), ("MLA_SHORTS", (dict(heads=2, BL=32), dict(heads=1, BL=64)))):
        monkeypatch.setattr(mla_decode_layout, name, value)
    recs = mla_decode_layout.mla_layout_case(200, device="cpu")
    assert all(r["verdict"] == "VALID" for r in recs), [r["reasons"] for r in recs]
    assert [r["params"]["op"] for r in recs] == ["mla_decode_layout"] * 2
    # the CPU's 8 "SMs": 200 positions in 2 head groups x 2 shortest splits fit, so SHORT's layout is timed
    assert [(r["params"]["split"], r["params"]["heads"]) for r in recs] == [(64, 2), (128, 1)]
    assert all(r["params"]["peer_split"] == 128 for r in recs) and ml.SHORT == dict(heads=16, BL=32)
    assert len(load(kinds="kernel", root=records_dir).records) == 2


def test_mla_rows_bench_plumbing(records_dir, fake_graph_ms, monkeypatch):
    """`--ops mla_decode_rows` on the CPU through the interpreter, small shapes, a fake clock: the positions-as-rows
    kernel against the heads-as-rows one, recorded VALID with both outputs checked; nothing timed where the layout's
    loop step (SHORT's 32) runs the heads-as-rows kernel either way."""
    for name, value in (("MLA_H", 4), ("MLA_R", 32), ("MLA_P", 16), ("MLA_LAYERS", 2)):
        monkeypatch.setattr(mla_decode_rows, name, value)
    recs = mla_decode_rows.mla_rows_case(300, device="cpu")
    assert [r["verdict"] for r in recs] == ["VALID", "VALID"], [r["reasons"] for r in recs]
    assert [r["params"]["warps"] for r in recs] == [4, 8]
    for r in recs:
        assert (r["params"]["op"], r["params"]["split"], r["params"]["step"]) == ("mla_decode_rows", 128, 64)
        assert 0 < r["results"]["rel_err_vs_peer"] < 1e-5 and r["results"]["peer"] == "heads-rows"
    with mt.overrides({"mla_decode.SHORT": dict(heads=2, BL=32)}):
        assert mla_decode_rows.mla_rows_case(200, device="cpu") == []
    assert len(load(kinds="kernel", root=records_dir).records) == 2


def test_mla_absorb_sweep_plumbing(records_dir, fake_graph_ms, monkeypatch):
    """`--ops mla_absorb` on the CPU through the interpreter, small shapes, a fake clock: a record per (shape,
    config), each checked against the default config's output; a failing config is recorded INVALID."""
    for name, value in (("MLA_H", 2), ("MLA_R", 32), ("MLA_LAYERS", 2),
                        ("ABSORB_SWEEP", [dict(BN=16, BK=32, num_warps=2), dict(BN=0, BK=32, num_warps=2)])):
        monkeypatch.setattr(mla_absorb, name, value)  # BN=0 cannot launch
    recs = mla_absorb.mla_absorb_sweep(device="cpu")
    assert [(r["params"]["shape"], r["verdict"]) for r in recs] == [("q", "VALID"), ("q", "INVALID"),
                                                                    ("o", "VALID"), ("o", "INVALID")]
    assert recs[0]["results"]["rel_err_vs_default"] < 1e-5 and "failed" in recs[1]["reasons"][0]
    assert (recs[2]["params"]["K"], recs[2]["params"]["N"]) == (32, 128)

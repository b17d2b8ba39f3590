"""benchmarks/routing_noise.py: the pinned run really routes as the fp32 run did, a run with no rounding to flip
anything finds no noise (the negative control), and the record it writes validates."""
import torch

from benchmarks import routing_noise
from model.build import load_model
from model.layers import Router
from records import store


def test_pinning_routes_every_layer_as_the_fp32_run_did():
    wide = load_model("tiny", dtype=torch.float32).model
    narrow = load_model("tiny", dtype=torch.bfloat16).model
    seq = torch.arange(3, 40)[None]
    tw, tn = routing_noise.RoutingTap(wide), routing_noise.RoutingTap(narrow)
    used = {}   # a hook after the tap's sees the choice the layer went on with

    def keep(name):
        def hook(module, args, out):
            used[name] = out[0]
        return hook
    after = [m.register_forward_hook(keep(n)) for n, m in narrow.named_modules() if isinstance(m, Router)]
    try:
        tw.start("record")
        wide.forward(seq)
        tn.chosen = tw.chosen
        tn.start("pin")
        narrow.forward(seq)
    finally:
        for h in after:
            h.remove()
        tw.close(), tn.close()
    assert set(used) == set(tw.chosen) and len(used) == sum(isinstance(m, Router) for m in narrow.modules())
    for name, idx in used.items():
        assert torch.equal(idx, tw.chosen[name][0]), name
    assert tn.rows == seq.shape[1] * len(used)


def test_a_run_against_itself_finds_no_noise_and_records_it(tmp_path, monkeypatch, capsys):
    """fp32 against fp32: no choice flips and no logit moves, pinned or not; a tool that reported noise here
    would be measuring itself."""
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    assert routing_noise.main(["--preset", "tiny", "--dtype", "fp32", "--new-tokens", "3"]) == 0
    got = store.load("routing_noise", root=tmp_path)
    assert got.problems == [] and len(got.records) == 1
    r = got.records[0]["results"]
    assert r["flips"] == 0 and r["decisions"] > 0 and r["steps"] == 3 * len(r["prompts"])
    assert r["max_abs_logit_diff_free"] == r["max_abs_logit_diff_pin"] == 0.0
    assert r["agree_free"] == r["agree_pin"] == r["steps"]
    assert 0 <= r["gap_quantiles"]["p10"] <= r["gap_quantiles"]["p50"] <= r["gap_quantiles"]["p90"]
    assert "flipped: 0 of" in capsys.readouterr().out


def test_a_rounding_dtype_moves_the_logits_and_pinning_keeps_the_count_of_flips(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    assert routing_noise.main(["--preset", "tiny", "--dtype", "bf16", "--new-tokens", "3"]) == 0
    r = store.load("routing_noise", root=tmp_path).records[0]["results"]
    assert r["max_abs_logit_diff_free"] > 0 and r["max_abs_logit_diff_pin"] > 0
    assert r["flip_fraction"] == r["flips"] / r["decisions"]


def test_a_preset_and_a_model_at_once_are_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    assert routing_noise.main(["--preset", "tiny", "--model", "x"]) == 2
    assert "give --preset or --model, not both" in capsys.readouterr().err
    assert not (tmp_path / "routing_noise.jsonl").exists()

"""The gates end to end on tiny (CPU): Gate A, its negative controls, Gate B against the committed golden and a
perturbed one, golden md5s and refusals, the memory gate's floor (simulated NVML readings), the CLI's exit codes."""
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gates.__main__ import main
from gates import gate_a
from gates.gate_a import run_gate_a
from gates.gate_b import run_gate_b
from gates.gate_memory import run_memory_gate
from gates.golden import (GOLDEN_DIR, GoldenError, find_golden, golden_name, ids_md5, load_golden, make_golden,
                          write_golden)
from gates.memory import GiB, MemReading, project_peak
from gates.prompts import battery
from gates.run import EXIT_FAIL, EXIT_PASS, EXIT_REFUSED, context_len, load_subject, resolve
from model.cache import KDAState
from records.store import load

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = GOLDEN_DIR / "tiny-fp64-cpu-hf.json"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """tiny's ops are too small to gain from threads, and on the 2-core CI box two intra-op threads competing
    with other processes run up to 10x slower; one thread keeps the file's time steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def opts():
    return resolve(preset="tiny", device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def subject(opts):
    return load_subject(opts)


def only_record(root, kind):
    got = load(kind, root=root)
    assert got.problems == [] and len(got.records) == 1, (got.problems, len(got.records))
    return got.records[0]


def cli(*args, records):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KIMI_RECORDS_DIR": str(records)}
    return subprocess.run([sys.executable, "-m", "gates", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def tampered(path, edit, fix_md5=True):
    """A copy of the committed golden with `edit(golden)` applied; its md5 recomputed unless told not to."""
    g = json.loads(COMMITTED.read_text())
    edit(g)
    if fix_md5:
        g["md5"] = ids_md5([p["expected"] for p in g["prompts"]])
    path.write_text(json.dumps(g))
    return path


def flip_prompt2_step5(g):
    """Prompt 2, step 5: the golden 'chose' its runner-up (ids of top-1 and top-2 swapped, a consistent golden)."""
    p = g["prompts"][2]
    top = p["topk_ids"][5]
    top[0], top[1] = top[1], top[0]
    p["expected"][5] = top[0]


# ---- Gate A ------------------------------------------------------------------------------------------------

def test_cli_gate_a_passes_on_tiny(tmp_path, subject):
    r = cli("gate-a", "--preset", "tiny", "--device", "cpu", records=tmp_path)
    assert r.returncode == EXIT_PASS, r.stdout + r.stderr
    assert "Gate A PASS 128/128" in r.stdout
    rec = only_record(tmp_path, "gate_a")
    res = rec["results"]
    assert (res["score"], res["total"], res["passed"], res["diagnoses"]) == (128, 128, True, [])
    assert [len(d) for d in res["max_abs_logit_diff"]] == [16] * 8
    # the two paths agree to rounding, far inside the near-tie epsilon
    assert 0 < res["max_abs_logit_diff_overall"] < 1e-4 == res["near_tie_eps"]
    assert set(res["timings"]) == {"load_s", "recompute_s", "incremental_s", "control_s", "logit_floor_s", "total_s"}
    assert res["timings"]["control_s"] == 0  # nothing diverged: no control run
    assert (rec["kind"], rec["dtype"], rec["device"], rec["weights"]) == ("gate_a", "float32", "cpu", subject.weights)
    assert rec["verdict"] == "VALID" and rec["params"]["new_tokens"] == 16


def dropped_state_carry(model):
    def decode(tokens, cache):
        for layer in cache.layers:
            if isinstance(layer, KDAState):
                layer.state.zero_()
        return model.decode_step(tokens, cache)
    return decode


def stale_conv_taps(model):
    def decode(tokens, cache):
        kda = [layer for layer in cache.layers if isinstance(layer, KDAState)]
        saved = [layer.taps.clone() for layer in kda]
        logits = model.decode_step(tokens, cache)
        for layer, taps in zip(kda, saved):
            layer.taps.copy_(taps)
        return logits
    return decode


@pytest.mark.parametrize("broken", [dropped_state_carry, stale_conv_taps])
def test_gate_a_catches_a_broken_state_carry(tmp_path, opts, subject, broken, capsys):
    assert run_gate_a(opts, subject=subject, decode=broken(subject.model), records_root=tmp_path) == EXIT_FAIL
    res = only_record(tmp_path, "gate_a")["results"]
    assert not res["passed"] and res["score"] < 64
    assert len(res["diagnoses"]) == 8
    for d in res["diagnoses"]:
        # step 0 comes from the prefill, which the broken decode never touches
        assert d["verdict"] == "real" and d["step"] >= 1, d["explanation"]
    assert "Gate A FAIL" in capsys.readouterr().out


def test_gate_a_noise_control_does_not_excuse_a_broken_carry(tmp_path, opts, subject, monkeypatch):
    """The control wiring end to end: with the PyTorch kernels as the control (the same kernels here, so the
    control matches the reference exactly), a dropped state carry stays beyond the noise floor."""
    monkeypatch.setattr(gate_a, "control_kernels", lambda opts, device: "torch")
    assert run_gate_a(opts, subject=subject, decode=dropped_state_carry(subject.model),
                      records_root=tmp_path) == EXIT_FAIL
    res = only_record(tmp_path, "gate_a")["results"]
    noise = [p["noise"] for p in res["per_prompt"]]
    assert len(noise) == 8 and all(not n["within_noise"] and n["control_first_divergence"] is None for n in noise)
    assert res["timings"]["control_s"] > 0


def test_gate_a_refuses_under_the_memory_floor(tmp_path, opts):
    proj = project_peak(opts.config, opts.torch_dtype, 1, context_len(battery(opts.config), 16), device="cpu")
    low = lambda: MemReading(total=140 * GiB, free=proj.total + 10 * GiB, source="simulated")
    assert run_gate_a(opts, reader=low, records_root=tmp_path) == EXIT_REFUSED
    rec = only_record(tmp_path, "gate_a")
    assert rec["verdict"] == "INVALID" and rec["weights"] is None  # refused before loading
    assert rec["results"]["passed"] is False and "memory floor REFUSED" in rec["reasons"][0]


# ---- Gate B and goldens ------------------------------------------------------------------------------------

def test_committed_golden_passes_with_the_fp32_path(tmp_path, opts, subject):
    g = load_golden(COMMITTED)
    assert find_golden(opts) == COMMITTED  # fp32 on a CPU falls back to the fp64 CPU HF golden
    assert g["provenance"]["implementation"] == "hf-transformers-5.17.0"
    assert (g["dtype"], g["device"], g["source"], g["seed"], g["weights"]) == ("fp64", "cpu", "hf", 0, subject.weights)
    assert [p["ids"] for p in g["prompts"]] == battery(opts.config).ids
    assert run_gate_b(opts, subject=subject, records_root=tmp_path) == EXIT_PASS
    res = only_record(tmp_path, "gate_b")["results"]
    assert (res["score"], res["total"], res["passed"], res["md5"]) == (128, 128, True, g["md5"])


def test_cli_gate_b_fails_on_a_perturbed_golden(tmp_path):
    path = tampered(tmp_path / "perturbed.json", flip_prompt2_step5)
    r = cli("gate-b", "--preset", "tiny", "--device", "cpu", "--golden", str(path), records=tmp_path)
    assert r.returncode == EXIT_FAIL, r.stdout + r.stderr
    assert "Gate B FAIL 127/128" in r.stdout and "md5 differs" in r.stdout
    res = only_record(tmp_path, "gate_b")["results"]
    assert res["md5"] == load_golden(COMMITTED)["md5"] != res["golden_md5"] == load_golden(path)["md5"]
    assert [p["first_divergence"] for p in res["per_prompt"]] == [None, None, 5, None, None, None, None, None]
    (d,) = res["diagnoses"]
    assert (d["prompt"], d["step"], d["verdict"]) == (2, 5, "real")
    assert d["ref"]["token"] == d["test"]["topk_ids"][1] and d["test"]["token"] == d["ref"]["topk_ids"][1]


def test_cli_golden_from_hf_holds_the_checkpoint_to_our_checks(tmp_path):
    """On a CPU HF transformers loads `--model` itself; it would take an fp32 A_log stored as bf16 (and a NaN, and
    a directory short of a shard it does not ask for). The golden command refuses it as Gate A would: exit 2, the
    tensor named, no golden written, no record."""
    from model.checkpoint import save_checkpoint
    from model.config import PRESETS
    from model.weights import synthetic_weights
    from tests.test_weights import rewrite

    tiny = PRESETS["tiny"]
    path = save_checkpoint(synthetic_weights(tiny, seed=1, dtype=torch.bfloat16), tiny, tmp_path / "ckpt",
                           max_shard_bytes=100_000)
    rewrite(path, "model.layers.3.self_attn.A_log", lambda t: t.to(torch.bfloat16))
    out = cli("golden", "--source", "hf", "--model", str(path), "--device", "cpu", "--golden", str(tmp_path / "g.json"),
              records=tmp_path / "rec")
    assert out.returncode == EXIT_REFUSED, out.stderr[-2000:]
    assert "model.layers.3.self_attn.A_log" in out.stderr and "expected dtype F32, got BF16" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "g.json").exists() and not (tmp_path / "rec").exists()


def test_golden_md5_is_int32_little_endian():
    ids = [[1, 2, 3], [256, -1, 2**31 - 1]]
    by_hand = bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0, 255, 255, 255, 255, 255, 255, 255, 127])
    assert by_hand == struct.pack("<6i", 1, 2, 3, 256, -1, 2**31 - 1)
    assert ids_md5(ids) == hashlib.md5(by_hand).hexdigest() == "566f6d008839365aeeb7f6727638a939"
    assert ids_md5([[1, 2], [3, 4]]) != ids_md5([[1, 3], [2, 4]])  # row-major
    with pytest.raises(ValueError, match="outside int32"):
        ids_md5([[2**31]])
    with pytest.raises(ValueError, match="must be 2-D"):
        ids_md5([1, 2])


def test_self_golden_round_trip(tmp_path, subject):
    opts = resolve(preset="tiny", device="cpu", source="self")
    g = make_golden(opts, subject)
    assert g["provenance"]["implementation"] == "self-recompute" and g["weights"] == subject.weights
    path = write_golden(g, tmp_path / golden_name(opts.label, opts.dtype, opts.device, opts.source))
    assert path.name == "tiny-fp32-cpu-self.json" and load_golden(path) == json.loads(path.read_text())
    # our fp32 recompute path and HF in fp64 choose the same 128 tokens
    assert g["md5"] == load_golden(COMMITTED)["md5"]
    with pytest.raises(GoldenError, match="exists; delete it first"):
        write_golden(g, path)


def test_golden_refusals(tmp_path, opts, subject):
    with pytest.raises(GoldenError, match="does not match its own expected ids"):
        load_golden(tampered(tmp_path / "a.json", flip_prompt2_step5, fix_md5=False))

    def not_greedy(g):
        g["prompts"][1]["expected"][3] = g["prompts"][1]["topk_ids"][3][4]
    with pytest.raises(GoldenError, match="prompt 1 step 3: expected id .* is not the top-1"):
        load_golden(tampered(tmp_path / "b.json", not_greedy))

    def other_prompt(g):
        g["prompts"][0]["ids"][3] += 1
    path = tampered(tmp_path / "c.json", other_prompt)
    assert run_gate_b(resolve(preset="tiny", device="cpu", golden=str(path)), records_root=tmp_path) == EXIT_REFUSED
    rec = only_record(tmp_path, "gate_b")
    assert rec["verdict"] == "INVALID" and "prompt 0's ids differ" in rec["reasons"][0] and rec["weights"] is None

    other_seed = resolve(preset="tiny", device="cpu", seed=1, golden=str(COMMITTED), new_tokens=16)
    assert run_gate_b(other_seed, records_root=tmp_path / "seed") == EXIT_REFUSED
    assert "was made from weights" in only_record(tmp_path / "seed", "gate_b")["reasons"][0]

    fewer = resolve(preset="tiny", device="cpu", new_tokens=8)
    assert run_gate_b(fewer, subject=subject, records_root=tmp_path / "n") == EXIT_REFUSED
    assert "holds 16 new tokens per prompt, --new-tokens is 8" in only_record(tmp_path / "n", "gate_b")["reasons"][0]

    with pytest.raises(GoldenError, match="no golden for tiny-seed1 bf16 cpu"):
        find_golden(resolve(preset="tiny", device="cpu", dtype="bf16", seed=1))


# ---- the memory gate ---------------------------------------------------------------------------------------

class Readings:
    """A simulated NVML reader: `free` for the first `calls` readings, then `then`."""

    def __init__(self, free, then=None, calls=None):
        self.free, self.then, self.calls, self.n = free, then, calls, 0

    def __call__(self):
        self.n += 1
        free = self.free if self.calls is None or self.n <= self.calls else self.then
        return MemReading(total=140 * GiB, free=free, source="simulated")


def test_memory_gate_refuses_under_the_floor_and_records_it(tmp_path, opts):
    proj = project_peak(opts.config, opts.torch_dtype, 1, context_len(battery(opts.config), 16), device="cpu")
    code = run_memory_gate(opts, reader=Readings(proj.total + 10 * GiB), records_root=tmp_path)
    assert code == EXIT_REFUSED
    rec = only_record(tmp_path, "memory")
    res = rec["results"]
    assert (res["decision"], res["passed"], res["projected_bytes"], res["floor_bytes"]) == \
        ("refused", False, proj.total, 15 * GiB)
    assert res["free_before_bytes"] == proj.total + 10 * GiB and res["measured_peak_bytes"] is None
    assert rec["weights"] is None and "REFUSED" in rec["reasons"][0] and "leaves 10.00 GiB" in rec["reasons"][0]


def test_memory_gate_aborts_when_free_memory_drops_under_the_floor(tmp_path, opts):
    # roomy for the check before loading and the sampler's first reading, then 1 GiB free
    code = run_memory_gate(opts, reader=Readings(100 * GiB, then=GiB, calls=2), records_root=tmp_path)
    assert code == EXIT_FAIL
    rec = only_record(tmp_path, "memory")
    assert (rec["results"]["decision"], rec["results"]["passed"], rec["results"]["min_free_bytes"]) == ("tripped", False, GiB)
    assert "memory floor crossed: free 1.00 GiB" in rec["reasons"][0]


def test_cli_memory_gate_skips_without_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    assert main(["gate-memory", "--device", "cpu"]) == EXIT_PASS
    out = capsys.readouterr().out
    assert "Memory gate SKIP" in out and "device is cpu" in out and "PASS" not in out
    res = only_record(tmp_path, "memory")["results"]
    assert (res["decision"], res["passed"]) == ("skipped", None)


# ---- bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(new_tokens=0), r"--new-tokens must be an integer in 1\.\.1024"),
    (dict(preset="huge"), "unknown preset 'huge'"),
    (dict(preset="tiny", model="."), "--preset or --model, not both"),
    (dict(model="/nonexistent"), "no such checkpoint directory"),
    (dict(dtype="fp8"), "--dtype 'fp8'"),
    (dict(floor_gib=-1), r"--floor-gib must be a number of GiB in 0\.\.1024"),
])
def test_resolve_rejects_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        resolve(**{"device": "cpu", **kw})


def test_cli_bad_input_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    assert main(["gate-a", "--new-tokens", "0", "--device", "cpu"]) == EXIT_REFUSED
    assert "error: --new-tokens must be an integer in 1..1024, got 0" in capsys.readouterr().err
    assert not (tmp_path / "gate_a.jsonl").exists()
    with pytest.raises(SystemExit) as e:  # argparse: unknown choices
        main(["gate-a", "--dtype", "fp8"])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    # a flag the command does not read is refused, not ignored
    for argv in (["gate-a", "--golden", "g.json"], ["gate-a", "--source", "self"], ["gate-b", "--source", "self"],
                 ["gate-memory", "--golden", "g.json"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "unrecognized arguments: " + " ".join(argv[1:]) in capsys.readouterr().err


@pytest.mark.parametrize("command, kind, where", [("gate-a", "gate_a", "gates.gate_a.load_subject"),
                                                   ("gate-b", "gate_b", "gates.gate_b.load_subject")])
def test_a_gate_that_crashes_still_leaves_a_record(tmp_path, monkeypatch, capsys, command, kind, where):
    """A crash inside a gate (here the model load) exits 2 with the traceback and appends an INVALID record naming
    the exception, so that a nightly run's records say what happened."""
    def boom(opts):
        raise RuntimeError("kernel failed to compile")
    monkeypatch.setattr(where, boom)
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    assert main([command, "--preset", "tiny", "--device", "cpu"]) == EXIT_REFUSED
    assert "RuntimeError: kernel failed to compile" in capsys.readouterr().err  # the traceback
    rec = only_record(tmp_path, kind)
    assert rec["verdict"] == "INVALID" and rec["results"]["passed"] is False
    assert rec["reasons"] == ["refused: crashed: RuntimeError: kernel failed to compile"]


def test_a_golden_that_crashes_exits_2_with_its_traceback(tmp_path, monkeypatch, capsys):
    """Not 1, which means a gate failed; no record (a golden run makes none), no golden file."""
    def boom(opts, subject):
        raise RuntimeError("HF generate failed")
    monkeypatch.setattr("gates.__main__.make_golden", boom)
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    out = tmp_path / "g.json"
    assert main(["golden", "--preset", "tiny", "--device", "cpu", "--golden", str(out)]) == EXIT_REFUSED
    assert "RuntimeError: HF generate failed" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.jsonl"))


def test_gates_reject_empty_and_out_of_vocab_prompts(subject):
    from model.generate import generate_incremental, generate_recompute
    for gen in (generate_recompute, generate_incremental):
        with pytest.raises(ValueError, match="empty prompt"):
            gen(subject.model, [], 4)
        with pytest.raises(ValueError, match="token id 512 lies outside the vocabulary 0..511"):
            gen(subject.model, [1, 512], 4)
    assert torch.equal(torch.tensor(battery(subject.cfg).ids[0]).clamp(0, 511), torch.tensor(battery(subject.cfg).ids[0]))

"""The reference model's training (model.train, model.bpe) at toy sizes on the CPU: the corpus split, the tokenizer
against HF tokenizers and the gates' reader, the training step and its controls, and the written checkpoint against
our loader and HF transformers."""
import dataclasses
import json
import math
import shutil
from pathlib import PurePosixPath

import pytest
import torch

from gates.prompts import PROMPTS, battery
from model.tokenizer import KimiTokenizer, TokenizerError
from model import bpe, train
from model.build import load_model
from model.checkpoint import check_checkpoint, internal_names
from model.hf import hf_from_checkpoint
from records import store
from tests.conftest import rel_err

TOY = train.ModelSize(n_base=300, hidden=32, layers=4, heads=2, head_dim=16, kv_lora_rank=16, dense=64, experts=4,
                      top_k=2, expert_dim=16)


@pytest.fixture(scope="module")
def stdlib():
    return train.load_corpus()


@pytest.fixture(scope="module")
def toy_corpus(stdlib):
    return stdlib.limited(60_000)


@pytest.fixture(scope="module")
def hf_tok(toy_corpus):
    return bpe.train_bpe([d.text for d in toy_corpus.train], TOY.n_base)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, hf_tok):
    path = tmp_path_factory.mktemp("tok")
    bpe.write_tiktoken(bpe.ranks_of(hf_tok), path / "tiktoken.model")
    return path


# ---- corpus --------------------------------------------------------------------------------------------------

def plant(root, files: dict) -> None:
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


PLANTED = {"a.py": b"x = 1\n", "pkg/b.py": b"def f():\n    return 2\n", "pkg/__init__.py": b"",
           "test/test_a.py": b"t = 1\n", "pkg/tests/t.py": b"t = 2\n", "idlelib/idle_test/i.py": b"i = 1\n",
           "site-packages/s.py": b"s = 1\n", "pydoc_data/topics.py": b"topics = {}\n",
           "config-3.12-x86_64/c.py": b"c = 1\n", "_sysconfigdata__linux.py": b"d = 1\n",
           "latin.py": "é = 1\n".encode("latin-1"), "notes.txt": b"not python\n"}


def test_corpus_keeps_library_sources_and_drops_tests_packages_and_build_files(tmp_path):
    plant(tmp_path, PLANTED)
    c = train.load_corpus(tmp_path, heldout_fraction=0.5)
    names = sorted(d.name for d in c.train + c.heldout)
    assert names == ["a.py", "pkg/b.py"]
    assert c.skipped_not_utf8 == ["latin.py"]
    for split, docs in ((False, c.train), (True, c.heldout)):
        assert all(train.is_heldout(d.name, 0.5) == split for d in docs)


def test_split_is_by_file_stable_and_hashed(tmp_path):
    files = {f"m{i}.py": f"v = {i}\n".encode() for i in range(40)}
    plant(tmp_path, files)
    a = train.load_corpus(tmp_path, heldout_fraction=0.3)
    assert train.load_corpus(tmp_path, heldout_fraction=0.3).sha256 == a.sha256
    split = {d.name: False for d in a.train} | {d.name: True for d in a.heldout}
    assert 0 < sum(split.values()) < 40
    plant(tmp_path, {"zz_new.py": b"n = 1\n"})           # a new file moves no other file across the split
    b = train.load_corpus(tmp_path, heldout_fraction=0.3)
    b_split = {d.name: False for d in b.train} | {d.name: True for d in b.heldout}
    assert b_split.pop("zz_new.py") == train.is_heldout("zz_new.py", 0.3) and b_split == split
    assert b.sha256 != a.sha256
    (tmp_path / "zz_new.py").write_bytes(b"n = 2\n")      # one byte changed: another hash
    assert train.load_corpus(tmp_path, heldout_fraction=0.3).sha256 != b.sha256


def test_stdlib_corpus_is_split_by_file(stdlib):
    train_names, held_names = {d.name for d in stdlib.train}, {d.name for d in stdlib.heldout}
    assert not train_names & held_names
    assert len(train_names) > 300 and 0.02 < len(held_names) / (len(train_names) + len(held_names)) < 0.1
    assert all(not train.is_excluded(PurePosixPath(n)) for n in train_names | held_names)
    assert not any(n.startswith("test/") or "/tests/" in n or "site-packages" in n for n in train_names | held_names)
    assert stdlib.sha256.startswith("sha256:") and len(stdlib.sha256) == 7 + 64


# ---- tokenizer -----------------------------------------------------------------------------------------------

def segments(pieces: list[bytes]) -> list[int]:
    """Token boundaries (byte offsets) of a segmentation."""
    out, at = [], 0
    for p in pieces:
        at += len(p)
        out.append(at)
    return out


def test_tiktoken_file_reproduces_hf_tokenization_and_is_read_by_the_gates(tok_dir, hf_tok, toy_corpus):
    ids = bpe.special_ids(TOY.n_base)
    tok = KimiTokenizer(tok_dir, ids["vocab_size"], ids["bos_token_id"])
    assert tok.encoding.n_vocab == TOY.n_base and ids["bos_token_id"] == TOY.n_base
    checked = 0
    for d in toy_corpus.heldout:
        ours = tok.encode(d.text)
        assert ours[0] == ids["bos_token_id"]
        assert ours[1:] == hf_tok.encode(d.text).ids          # the same ids, so the same count
        assert tok.encoding.decode(ours[1:]) == d.text
        checked += len(ours) - 1
    assert checked > 1000
    for text in PROMPTS:   # the gates' prompts: Han, Cyrillic, accents, digits
        assert tok.encode(text)[1:] == hf_tok.encode(text).ids and tok.encoding.decode(tok.encode(text)[1:]) == text
    with pytest.raises(TokenizerError, match="must lie after"):
        KimiTokenizer(tok_dir, ids["vocab_size"], TOY.n_base - 1)


def test_ranks_in_another_order_segment_differently(hf_tok, toy_corpus):
    """Negative control: the same vocabulary with ranks by byte order (not merge order) is another tokenizer."""
    import tiktoken

    from model.tokenizer import KIMI_PAT_STR
    ranks = bpe.ranks_of(hf_tok)
    shuffled = {t: r for r, t in enumerate(sorted(ranks, key=lambda t: (len(t) > 1, t)))}
    text = "".join(d.text for d in toy_corpus.heldout)
    good = tiktoken.Encoding("good", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    bad = tiktoken.Encoding("bad", pat_str=KIMI_PAT_STR, mergeable_ranks=shuffled, special_tokens={})
    hf_pieces = [bytes(good.decode_single_token_bytes(i)) for i in hf_tok.encode(text).ids]
    assert segments([good.decode_single_token_bytes(i) for i in good.encode_ordinary(text)]) == segments(hf_pieces)
    assert segments([bad.decode_single_token_bytes(i) for i in bad.encode_ordinary(text)]) != segments(hf_pieces)


def test_bpe_training_is_deterministic(tmp_path, hf_tok, toy_corpus, tok_dir):
    again = bpe.train_bpe([d.text for d in toy_corpus.train], TOY.n_base)
    bpe.write_tiktoken(bpe.ranks_of(again), tmp_path / "tiktoken.model")
    assert (tmp_path / "tiktoken.model").read_bytes() == (tok_dir / "tiktoken.model").read_bytes()


def test_bpe_refuses_a_vocabulary_the_text_cannot_fill():
    with pytest.raises(ValueError, match="fewer than the 4096 asked"):
        bpe.train_bpe(["ab ab ab"], 4096)
    with pytest.raises(ValueError, match="257"):
        bpe.train_bpe(["ab"], 256)


# ---- model and training --------------------------------------------------------------------------------------

def test_default_config_has_every_block_kind_and_fits_32_mib():
    cfg = train.ModelSize().config()
    assert "".join("M" if k == "mla" else "K" for k in cfg.layer_kinds) == "KKKMKKKM"   # the 48B's 3:1
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, cfg.num_hidden_layers))
    assert cfg.num_shared_experts == 1 and cfg.num_experts >= 16 and cfg.num_experts_per_token > 1
    assert cfg.to_dict()["moe_router_activation_func"] == "sigmoid"
    d = cfg.kda_head_dim
    assert 16 <= d <= 128 and d & (d - 1) == 0   # the Triton KDA kernels' head dims
    assert train.checkpoint_bytes(cfg) <= 32 << 20
    assert (cfg.vocab_size, cfg.bos_token_id) == (4096 + 256, 4096)


def toy_model(seed=0):
    return train.build_model(TOY.config(), seed, torch.device("cpu"))


def fixed_batch(cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TOY.n_base, (2, 33), generator=g)


def losses_on(model, window, steps, lr, bias_rate=1e-3):
    opt, load = train.MasterAdamW(model, lr, 0.1), train.ExpertLoad(model)
    out = []
    for _ in range(steps):
        load.reset()
        out.append(train.train_step(model, opt, window, lr, 1.0)[0])
        train.balance_experts(load, bias_rate)
    load.close()
    return out


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch():
    model = toy_model()
    losses = losses_on(model, fixed_batch(model.cfg), 8, 1e-2)
    assert losses[-1] < losses[0] - 0.5, losses


def test_lr_zero_leaves_the_loss_unchanged():
    """Negative control for the one above: no learning rate and no bias steps, no change."""
    model = toy_model()
    losses = losses_on(model, fixed_batch(model.cfg), 3, 0.0, bias_rate=0.0)
    assert losses[0] == losses[1] == losses[2]


def test_gradient_reaches_every_weight_and_the_checkpoint_sees_the_packed_updates():
    model = toy_model()
    names = set(internal_names(model.cfg))
    before = {n: t.clone() for n, t in train.checkpoint_state(model).items()}
    assert set(before) == names
    window = fixed_batch(model.cfg)
    loss = torch.nn.functional.cross_entropy(train.logits_of(model, window[:, :-1]).flatten(0, 1),
                                             window[:, 1:].flatten())
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(model.get_parameter(n).grad is not None and model.get_parameter(n).grad.abs().sum() > 0 for n in trained)
    assert any(n.endswith("in_proj_weight") for n in trained) and not any(n.endswith("q_proj.weight") for n in trained)
    assert not any(n.endswith("e_score_correction_bias") for n in trained)
    model.zero_grad()
    losses_on(model, window, 1, 1e-2)
    after = train.checkpoint_state(model)
    q = "model.layers.0.self_attn.q_proj.weight"
    packed = model.get_parameter("model.layers.0.self_attn.in_proj_weight")
    assert not torch.equal(after[q], before[q]) and torch.equal(after[q], packed[:after[q].shape[0]])
    mla_q = "model.layers.3.self_attn.q_proj.weight"
    assert not torch.equal(after[mla_q], before[mla_q])
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(after[bias], before[bias])        # moved by balancing, not by the gradient


def test_balancing_raises_the_bias_of_idle_experts_and_lowers_busy_ones():
    model = toy_model()
    load = train.ExpertLoad(model)
    load.counts[:] = torch.tensor([10.0, 0.0, 3.0, 3.0])
    train.balance_experts(load, 0.01)
    bias = load.routers[0].e_score_correction_bias
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert load.summary()[0]["unused"] == 1 and load.summary()[0]["max"] == pytest.approx(10 / 4)
    load.close()


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [train.lr_at(s, 100, 1.0, 10) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[100] == pytest.approx(0.1)


def test_a_time_limit_lowers_the_step_count_once_timed(monkeypatch):
    """The step count is cut once the steps are timed to what fits; a limit already spent leaves the next step the
    last."""
    monkeypatch.setattr(train, "TIMED_STEPS", 3)
    model = toy_model()
    ids = torch.randint(0, TOY.n_base, (400,), generator=torch.Generator().manual_seed(0))
    opts = train.TrainOptions(steps=10, batch=1, seq_len=16, warmup=2, eval_every=100, eval_windows=1,
                              time_limit=1e-6)
    curve = []
    summary = train.train(model, ids, ids[:40], torch.ones(TOY.config().vocab_size, dtype=torch.int64), opts,
                          curve=curve.append, log=lambda _: None)
    assert summary["steps"] == 5 and max(c["step"] for c in curve) == 5
    assert summary["evals"][-1]["step"] == 5
    opts = dataclasses.replace(opts, time_limit=None)       # control: no limit, every step
    assert train.train(toy_model(), ids, ids[:40], torch.ones(TOY.config().vocab_size, dtype=torch.int64), opts,
                       log=lambda _: None)["steps"] == 10


def test_evaluate_counts_every_held_out_byte(toy_corpus, tok_dir):
    cfg = TOY.config()
    tok = KimiTokenizer(tok_dir, cfg.vocab_size, cfg.bos_token_id)
    docs = sorted(toy_corpus.heldout, key=lambda d: len(d.text))[:2]
    tokens = train.tokenize(docs, tok)
    r = train.evaluate(toy_model(), tokens.ids, train.token_bytes(tok), 16, 3, cfg.bos_token_id)
    assert len(tokens.ids) > 3 * 16 + 1   # full batches and a short last window
    assert r["bytes"] == tokens.bytes and r["tokens"] == len(tokens.ids) - len(docs)
    assert r["bits_per_byte"] == pytest.approx(r["loss"] * r["tokens"] / r["bytes"] / math.log(2))


# ---- the whole run -------------------------------------------------------------------------------------------

QUICK_ARGS = ["--quick", "--vocab", "300", "--steps", "10", "--batch", "2", "--seq-len", "32", "--lr", "0.01",
              "--eval-every", "5", "--max-corpus-bytes", "40000"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A quick run's checkpoint folder; its train record goes to `records/` beside it, not to the suite's."""
    out = tmp_path_factory.mktemp("ref") / "reference"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMI_RECORDS_DIR", str(out.parent / "records"))
        assert train.main(["--out", str(out), *QUICK_ARGS]) == 0
    return out


def test_the_run_writes_a_checkpoint_our_loader_and_the_gates_read(reference):
    assert {p.name for p in reference.iterdir()} >= {"config.json", "model.safetensors.index.json", "tiktoken.model",
                                                   "provenance.json", "loss_curve.jsonl"}
    cfg = check_checkpoint(reference)
    loaded = load_model(checkpoint=str(reference))
    prov = json.loads((reference / "provenance.json").read_text())
    assert prov["weights"] == loaded.weights
    assert prov["corpus"]["sha256"].startswith("sha256:") and prov["training"]["steps"] == 10
    assert prov["command"].startswith("python -m model.train --out")
    r = prov["results"]
    assert r["heldout_bits_per_byte"] == pytest.approx(
        r["heldout_loss"] * r["heldout_tokens"] / r["heldout_bytes"] / math.log(2), rel=1e-3)
    assert r["evals"][-1]["heldout_loss"] < r["evals"][0]["heldout_loss"]
    assert len(r["expert_load"]) == cfg.num_hidden_layers - 1
    curve = [json.loads(line) for line in (reference / "loss_curve.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve if "loss" in c] == list(range(1, 11))
    assert [c["step"] for c in curve if "heldout_loss" in c] == [0, 5, 10]
    assert battery(cfg, reference).source.startswith("tiktoken:")


def test_the_checkpoint_gives_hf_transformers_our_logits(reference):
    ours = load_model(checkpoint=str(reference)).model
    hf = hf_from_checkpoint(reference, dtype=torch.float32)
    cfg = ours.cfg
    ids = torch.tensor([KimiTokenizer(reference, cfg.vocab_size, cfg.bos_token_id).encode(
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n")])
    with torch.no_grad():
        ref = hf(ids).logits.float()
    got = ours(ids)
    assert rel_err(got, ref) <= 1e-5
    assert rel_err(got, ref.roll(1, dims=1)) > 1e-2   # the comparison can fail


def test_cli_refuses_bad_options_and_a_used_folder(reference, tmp_path, capsys):
    for bad in (["--steps", "0"], ["--lr", "nan"], ["--heldout-fraction", "1.5"], ["--top-k", "64"]):
        with pytest.raises(SystemExit) as e:
            train.main(["--out", str(tmp_path / "new"), *bad])
        assert e.value.code == 2, bad
    with pytest.raises(SystemExit) as e:
        train.main(["--out", str(reference), "--quick"])
    assert e.value.code == 2 and "not an empty directory" in capsys.readouterr().err
    with pytest.raises(FileExistsError):
        train.run(dataclasses.replace(train.RunOptions(out=reference), size=TOY))


# ---- the train record ----------------------------------------------------------------------------------------

def curve_of(folder):
    lines = [json.loads(line) for line in (folder / "loss_curve.jsonl").read_text().splitlines()]
    return ([{"step": c["step"], "loss": c["loss"]} for c in lines if "loss" in c],
            [c for c in lines if "heldout_loss" in c])


def test_the_run_appends_its_train_record(reference):
    [rec] = store.load("train", root=reference.parent / "records").records
    assert store.validate_record(rec) == [] and rec["verdict"] == "VALID"
    prov = json.loads((reference / "provenance.json").read_text())
    steps, evals = curve_of(reference)
    r, p = rec["results"], rec["params"]
    assert r["curve"] == steps and len(steps) == 10 and r["evals"] == evals == prov["results"]["evals"]
    assert r["heldout_bpb"] == prov["results"]["heldout_bits_per_byte"] and r["heldout_loss"] > 0
    assert len(r["expert_load_max"]) == len(prov["results"]["expert_load"])
    assert (p["label"], p["steps"], p["seed"], p["corpus"]["sha256"], p["tokenizer"]["vocab"]) == (
        "reference", 10, 0, prov["corpus"]["sha256"], 300 + bpe.N_SPECIAL)
    assert rec["weights"] == prov["weights"] and (rec["device"], rec["dtype"]) == ("cpu", "float32")
    assert rec["machine"] == store.provenance()["machine"] and rec["git"] == store.provenance()["git"]


def head() -> str:
    return store.git("rev-parse", "HEAD").strip()


def copy_of(reference, tmp_path, drop=(), edit=None):
    """A copy of the reference folder without the files `drop`, its provenance edited by `edit(prov)`."""
    folder = tmp_path / "kimi-linear-toy"
    shutil.copytree(reference, folder)
    for name in drop:
        (folder / name).unlink()
    if edit and (folder / "provenance.json").exists():
        prov = json.loads((folder / "provenance.json").read_text())
        edit(prov)
        (folder / "provenance.json").write_text(json.dumps(prov))
    return folder


def on_h100(prov):
    prov["training"].update(device="NVIDIA H100 80GB HBM3", precision=train.CUDA_PRECISION, torch="2.11.0+cu130",
                            python="3.12.3")


def test_record_from_a_folder_carries_the_provenance_machine_and_the_given_commit(reference, tmp_path, monkeypatch,
                                                                                   capsys):
    folder = copy_of(reference, tmp_path, edit=on_h100)
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "records"))
    sha = head()
    assert train.main(["--record-from", str(folder), "--commit", sha]) == 0
    [rec] = store.load("train", root=tmp_path / "records").records
    assert store.validate_record(rec) == []
    assert rec["machine"] == {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "python": "3.12.3"}
    assert rec["machine"] != store.provenance()["machine"]          # not the machine that ran the command
    assert rec["git"]["commit"] == sha and "--record-from" in rec["git"]["note"] and "dirty" not in rec["git"]
    assert (rec["device"], rec["dtype"], rec["preset"]) == ("cuda", "bfloat16", "kimi-linear-toy")
    steps, evals = curve_of(folder)
    assert rec["results"]["curve"] == steps and rec["results"]["evals"] == evals
    assert rec["params"]["device_name"] == "NVIDIA H100 80GB HBM3" and "--record-from" in rec["params"]["source"]
    assert rec["id"] in capsys.readouterr().out
    assert train.main(["--record-from", str(folder), "--commit", sha]) == 0     # the same weights: not again
    assert len(store.load("train", root=tmp_path / "records").records) == 1


@pytest.mark.parametrize("drop", ["provenance.json", "loss_curve.jsonl"])
def test_record_from_refuses_a_folder_without_its_provenance_or_curve(reference, tmp_path, monkeypatch, capsys, drop):
    folder = copy_of(reference, tmp_path, drop=[drop])
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "records"))
    assert train.main(["--record-from", str(folder), "--commit", head()]) == 2
    err = capsys.readouterr().err
    assert f"no {drop}" in err and str(folder) in err
    assert not (tmp_path / "records" / "train.jsonl").exists()


def later_steps(prov):
    prov["training"]["steps"] += 1


def other_weights(prov):
    prov["weights"] = "sha256:0000000000000000"


@pytest.mark.parametrize("edit,why", [(later_steps, "ends at step"), (other_weights, "weights are"),
                                      (lambda p: p.pop("weights"), "lacks weights")])
def test_record_from_refuses_a_provenance_that_is_not_of_the_folder(reference, tmp_path, monkeypatch, capsys, edit,
                                                                    why):
    folder = copy_of(reference, tmp_path, edit=edit)
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "records"))
    assert train.main(["--record-from", str(folder), "--commit", head()]) == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "records" / "train.jsonl").exists()


def test_record_from_refuses_a_torn_curve_and_a_bad_commit(reference, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "records"))
    folder = copy_of(reference, tmp_path)
    assert train.main(["--record-from", str(folder), "--commit", "abc123"]) == 2
    assert "40-digit" in capsys.readouterr().err
    assert train.main(["--record-from", str(folder), "--commit", "0" * 40]) == 2
    assert "not a commit of this repository" in capsys.readouterr().err
    with open(folder / "loss_curve.jsonl", "a") as f:
        f.write('{"step": 11, "loss": NaN}\n')
    assert train.main(["--record-from", str(folder), "--commit", head()]) == 2
    assert "loss_curve.jsonl" in capsys.readouterr().err
    (folder / "provenance.json").write_text("[]")
    assert train.main(["--record-from", str(folder), "--commit", head()]) == 2
    assert "provenance.json: expected a JSON object" in capsys.readouterr().err
    assert not (tmp_path / "records" / "train.jsonl").exists()


def test_record_from_options_are_checked(tmp_path):
    for bad in (["--record-from", str(tmp_path)], ["--record-from", str(tmp_path), "--commit", "a" * 40, "--steps",
                                                   "3"], ["--commit", "a" * 40], []):
        with pytest.raises(SystemExit) as e:
            train.main(bad)
        assert e.value.code == 2, bad


def test_a_run_that_cannot_be_recorded_is_refused_before_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path / "file"))
    monkeypatch.setattr(train, "load_corpus", lambda *a, **k: pytest.fail("trained without a records file"))
    assert train.main(["--out", str(tmp_path / "out"), *QUICK_ARGS]) == 2
    assert "file" in capsys.readouterr().err and not (tmp_path / "out").exists()

"""What the checkpoint loader says about a damaged original-format directory: the right error type, one short line
naming the file and what is wrong in it, counts in the right number ("1 tensor", "2 tensors").

Damaged copies are built under tmp_path, from the committed reference checkpoint or from a tiny-preset checkpoint
written by `save_checkpoint`; the committed files are only read.
"""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import (INDEX_FILE, CheckpointError, check_checkpoint, load_checkpoint, original_names,
                              save_checkpoint, to_internal)
from model.config import PRESETS, ConfigError, KimiConfig
from model.weights import synthetic_weights

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "checkpoints" / "kimi-linear-ref"
TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny bf16 checkpoint in 7 shards, written once; tests change copies of it (`_copy`)."""
    return save_checkpoint(synthetic_weights(TINY, seed=1, dtype=torch.bfloat16), TINY,
                           tmp_path_factory.mktemp("messages") / "ckpt", max_shard_bytes=100_000)


def _copy(src: Path, dest: Path) -> Path:
    """A full copy (no hard links: some tests rewrite a shard in place)."""
    return Path(shutil.copytree(src, dest))


@pytest.fixture
def ref(tmp_path):
    return _copy(REF, tmp_path / "kimi-linear-ref")


@pytest.fixture
def tiny(tiny_ckpt, tmp_path):
    return _copy(tiny_ckpt, tmp_path / "ckpt")


def _edit_json(file: Path, fn) -> None:
    d = json.loads(file.read_text())
    fn(d)
    file.write_text(json.dumps(d))


def _shard_of(path: Path, name: str) -> str:
    return json.loads((path / INDEX_FILE).read_text())["weight_map"][name]


def _rewrite(path: Path, shard: str, fn) -> None:
    """Replace shard `shard`'s tensors by fn(tensors)."""
    file = path / shard
    save_file(fn(load_file(file)), file, metadata={"format": "pt"})


def _refused(error, fn, *args) -> str:
    with pytest.raises(error) as e:
        fn(*args)
    assert type(e.value) is error
    message = str(e.value)
    assert "\n" not in message
    return message


# ---- the untouched checkpoints load ---------------------------------------------------------------------------

def test_the_untouched_reference_checkpoint_loads():
    cfg, sd = load_checkpoint(REF)
    assert (cfg.num_experts, cfg.num_hidden_layers, cfg.vocab_size) == (32, 8, 4352)
    assert json.loads((REF / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(torch.isfinite(t).all() for t in sd.values())


def test_the_untouched_tiny_checkpoint_loads(tiny_ckpt):
    assert check_checkpoint(tiny_ckpt).to_dict() == TINY.to_dict()
    _, sd = load_checkpoint(tiny_ckpt)
    assert sd.keys() == synthetic_weights(TINY, seed=1, dtype=torch.bfloat16).keys()


# ---- 1. config.json's torch_dtype / dtype --------------------------------------------------------------------

@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("value", ["bf17", "BFloat16", "torch.bfloat16", "bf16", "float64", "", 16, ["bfloat16"]])
def test_an_unknown_dtype_in_config_json_is_refused(ref, key, value):
    _edit_json(ref / "config.json", lambda d: d.__setitem__(key, value))
    message = _refused(ConfigError, check_checkpoint, ref)
    assert message.startswith(f"{ref / 'config.json'}: config.{key} is ")
    assert json.dumps(value) in message or repr(value) in message
    assert "expected one of 'bfloat16', 'float16', 'float32'" in message
    assert len(message) < 300


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("value", ["bfloat16", "float16", "float32", None])
def test_a_known_dtype_in_config_json_loads_even_if_it_differs_from_the_shards(tiny, key, value):
    """A declared dtype other than the shards' stored one is not refused: the stored dtypes are checked per tensor."""
    _edit_json(tiny / "config.json", lambda d: d.__setitem__(key, value))
    assert check_checkpoint(tiny).num_experts == TINY.num_experts
    load_checkpoint(tiny)


def test_a_declared_dtype_does_not_change_the_stored_dtype_check(tiny):
    name = "model.layers.1.self_attn.q_proj.weight"
    _edit_json(tiny / "config.json", lambda d: d.__setitem__("torch_dtype", "float32"))
    _rewrite(tiny, _shard_of(tiny, name), lambda t: t | {name: t[name].float()})
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert f"{name} (" in message and "expected dtype BF16, got F32" in message


def test_the_readme_says_what_the_dtype_is_checked_against():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if "before any weight is read" in line]
    assert len(lines) == 1 and len(lines[0]) <= 120
    assert "dtype checked against the config" not in lines[0] and "dtype to the format" in lines[0]


# ---- 2. a tensor the index does not list but a shard holds -----------------------------------------------------

@pytest.mark.parametrize("load", [load_checkpoint, check_checkpoint])
def test_a_tensor_held_by_a_shard_but_not_listed_in_the_index(ref, load):
    name = "model.layers.3.block_sparse_moe.experts.0.w1.weight"
    shard = _shard_of(ref, name)
    _edit_json(ref / INDEX_FILE, lambda d: d["weight_map"].pop(name))
    message = _refused(CheckpointError, load, ref)
    assert message == f"checkpoint {ref}: {shard} holds 1 tensor that {INDEX_FILE} does not list: {name}"


def test_a_stray_tensor_a_shard_holds_is_reported_in_the_same_words(tiny):
    """A shard holding a tensor that the index lacks: the same wording whether or not the model expects it."""
    shard = _shard_of(tiny, "model.norm.weight")
    _rewrite(tiny, shard, lambda t: t | {"model.layers.0.surprise.weight": torch.zeros(2, dtype=torch.bfloat16)})
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert message == f"{shard} holds 1 tensor that {INDEX_FILE} does not list: model.layers.0.surprise.weight"


def test_a_tensor_no_shard_holds_is_missing(tiny):
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(tiny, _shard_of(tiny, name), lambda t: {n: v for n, v in t.items() if n != name})
    _edit_json(tiny / INDEX_FILE, lambda d: d["weight_map"].pop(name))
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert message == f"checkpoint {tiny}: 1 tensor missing: {name}"


def test_unlisted_and_missing_tensors_are_told_apart(tiny):
    held, lost = "model.layers.2.self_attn.o_proj.weight", "model.layers.0.mlp.up_proj.weight"
    _rewrite(tiny, _shard_of(tiny, lost), lambda t: {n: v for n, v in t.items() if n != lost})
    shard = _shard_of(tiny, held)
    _edit_json(tiny / INDEX_FILE, lambda d: [d["weight_map"].pop(n) for n in (held, lost)])
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert f"{shard} holds 1 tensor that {INDEX_FILE} does not list: {held}" in message
    assert f"1 tensor missing: {lost}" in message


# ---- 3. counts in the right number -----------------------------------------------------------------------------

def _no_wrong_plural(message: str) -> None:
    assert not re.search(r"\b1 (unexpected )?tensors\b", message), message


def test_counts_of_one_are_singular_and_of_more_plural(tiny):
    orig = {n: torch.zeros(s, dtype=dt) for n, (s, dt) in original_names(TINY).items()}
    one, two = list(orig)[5], list(orig)[6]
    message = _refused(CheckpointError, to_internal, {n: t for n, t in orig.items() if n != one}, TINY)
    assert f"1 tensor missing: {one}" in message
    _no_wrong_plural(message)
    message = _refused(CheckpointError, to_internal, {n: t for n, t in orig.items() if n not in (one, two)}, TINY)
    assert f"2 tensors missing: {one}, {two}" in message
    message = _refused(CheckpointError, to_internal, orig | {"model.layers.9.foo": torch.zeros(1)}, TINY)
    assert "1 unexpected tensor: model.layers.9.foo" in message
    _no_wrong_plural(message)


def test_a_shard_lacking_a_tensor_its_index_maps_to_it(tiny):
    name = "model.layers.3.self_attn.o_norm.weight"
    shard = _shard_of(tiny, name)
    _rewrite(tiny, shard, lambda t: {n: v for n, v in t.items() if n != name})
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert message == f"{INDEX_FILE} maps 1 tensor to {shard}, which does not hold it: {name}"


def test_one_nan_tensor_is_singular(tiny):
    name = "model.layers.1.block_sparse_moe.experts.6.w3.weight"

    def poison(t):
        t[name] = t[name].clone()
        t[name][0, 0] = float("nan")
        return t
    _rewrite(tiny, _shard_of(tiny, name), poison)
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert message.startswith(f"1 tensor holds NaN or inf in {tiny}: {name} (model-")


def test_a_tensor_wrong_in_both_shape_and_dtype_counts_once(tiny):
    name = "model.layers.3.self_attn.A_log"
    _rewrite(tiny, _shard_of(tiny, name), lambda t: t | {name: torch.zeros(1, 1, 3, 1, dtype=torch.bfloat16)})
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert message.startswith(f"1 tensor with the wrong shape or dtype in {tiny}: {name} (")
    assert "expected shape [1, 1, 4, 1], got [1, 1, 3, 1], expected dtype F32, got BF16" in message


# ---- 4. config.json named once ---------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, words", [
    (lambda d: d.pop("num_experts"), "required field missing: num_experts"),
    (lambda d: [d.pop(k) for k in ("num_experts", "v_head_dim")], "required fields missing: v_head_dim, num_experts"),
    (lambda d: d.__setitem__("model_type", "llama"), "config.model_type is 'llama', expected 'kimi_linear'"),
    (lambda d: d.pop("linear_attn_config"), "config.linear_attn_config must be an object with kda_layers"),
])
def test_config_json_is_named_once(ref, edit, words):
    _edit_json(ref / "config.json", edit)
    for fn, arg in ((check_checkpoint, ref), (KimiConfig.from_json, ref / "config.json")):
        message = _refused(ConfigError, fn, arg)
        assert message.startswith(f"{ref / 'config.json'}: {words}")
        assert message.count("config.json") == 1


# ---- 5. unexpected tensors name their shard --------------------------------------------------------------------

def test_an_unexpected_tensor_names_the_shard_holding_it(ref):
    extra = "model.layers.9.block_sparse_moe.experts.0.w1.weight"  # the reference has 8 layers
    shard = "model-00002-of-00002.safetensors"
    _rewrite(ref, shard, lambda t: t | {extra: torch.zeros(2, dtype=torch.bfloat16)})
    _edit_json(ref / INDEX_FILE, lambda d: d["weight_map"].__setitem__(extra, shard))
    message = _refused(CheckpointError, check_checkpoint, ref)
    assert message == f"checkpoint {ref}: {shard} holds 1 unexpected tensor: {extra}"


def test_an_unexpected_index_entry_names_the_shard_it_points_at(tiny):
    extra = "model.layers.1.block_sparse_moe.experts.8.w1.weight"  # tiny has experts 0..7
    shard = _shard_of(tiny, "model.norm.weight")
    _edit_json(tiny / INDEX_FILE, lambda d: d["weight_map"].__setitem__(extra, shard))
    message = _refused(CheckpointError, check_checkpoint, tiny)
    assert message == (f"checkpoint {tiny}: {INDEX_FILE} maps 1 unexpected tensor to {shard}, which does not hold it: "
                       f"{extra}")


def test_an_unexpected_tensor_of_a_single_file_checkpoint_names_it(tmp_path):
    path = tmp_path / "single"
    path.mkdir()
    tensors = {n: torch.zeros(s, dtype=dt) for n, (s, dt) in original_names(TINY).items()}
    save_file(tensors | {"model.layers.0.surprise.weight": torch.zeros(2, dtype=torch.bfloat16)},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(TINY.to_dict()))
    message = _refused(CheckpointError, check_checkpoint, path)
    assert message == f"checkpoint {path}: model.safetensors holds 1 unexpected tensor: model.layers.0.surprise.weight"


# ---- 6. a missing shard: one short line ------------------------------------------------------------------------

def test_a_missing_shard_is_one_short_line(ref):
    shard = "model-00002-of-00002.safetensors"
    held = [n for n in original_names(KimiConfig.from_json(REF)) if _shard_of(ref, n) == shard]
    (ref / shard).unlink()
    message = _refused(CheckpointError, check_checkpoint, ref)
    assert message == (f"missing shard file(s) in {ref}: model-00002-of-00002.safetensors (should hold "
                       f"{len(held)} tensors: {held[0]}, {held[1]} and {len(held) - 2} more)")
    assert len(message) < 400


def test_many_missing_shards_stay_one_short_line(tiny):
    shards = sorted({_shard_of(tiny, n) for n in original_names(TINY)})
    assert len(shards) == 7
    for s in shards[1:]:
        (tiny / s).unlink()
    message = _refused(CheckpointError, load_checkpoint, tiny)
    assert message.startswith(f"missing shard file(s) in {tiny}: {shards[1]} (should hold ")
    assert f"; {shards[2]} (should hold " in message and f"; {shards[3]} (should hold " in message
    assert shards[4] not in message and message.endswith("; and 3 more shards")
    assert len(message) < 400

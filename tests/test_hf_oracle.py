"""HF transformers 5.17 as the independent oracle: a tiny checkpoint written by our writer, loaded by both."""
import pytest
import torch

from model.build import load_model
from model.checkpoint import save_checkpoint
from model.config import PRESETS
from model.generate import generate_incremental, generate_recompute
from model.hf import hf_from_checkpoint, hf_greedy
from model.weights import synthetic_weights
from tests.conftest import rel_err

CFG = PRESETS["tiny"]
PROMPTS = [[500, 1, 2, 3, 4], [500, 77, 301, 12, 9, 9, 9, 120, 44, 410, 3, 2, 1, 0, 255, 256, 257] * 3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-ckpt")
    save_checkpoint(synthetic_weights(CFG, seed=0, dtype=torch.float32), CFG, path)
    return path


@pytest.fixture(scope="module")
def ours(ckpt):
    return load_model(checkpoint=str(ckpt), dtype=torch.float32).model


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_from_checkpoint(ckpt, dtype=torch.float32)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_full_sequence_logits_agree(ours, hf, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert rel_err(ours(ids), ref) <= 1e-5


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_identical(ours, hf, prompt):
    theirs, _, _ = hf_greedy(hf, prompt, 16)
    assert generate_recompute(ours, prompt, 16).tokens == theirs
    assert generate_incremental(ours, prompt, 16).tokens == theirs


def test_loaded_checkpoint_equals_synthetic(ckpt):
    a = load_model(checkpoint=str(ckpt), dtype=torch.float32)
    b = load_model("tiny", dtype=torch.float32)
    assert a.weights == b.weights

"""The model with its Triton kernels (interpreter on the CPU, compiled on CUDA) against the PyTorch path."""
import pytest
import torch

from model import ops
from model.build import load_model
from model.generate import generate_incremental, generate_recompute
from tests.conftest import rel_err

# The first two prompts take the same paths (a prefill inside one chunk and the decode-sized MoE kernels, then the
# decode step); the second's longer prefills run the most interpreted programs of the three, so it is in the slow tier.
PROMPTS = [[500, 7, 8, 9], pytest.param([500, 300, 1, 44, 45, 46, 47, 200, 19, 91, 3], marks=pytest.mark.slow),
           [500] + list(range(60, 140))]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float32, device=DEV).model


@pytest.mark.parametrize("prompt", PROMPTS)
def test_triton_incremental_equals_torch_recompute(tiny, prompt):
    with ops.use("torch"):
        ref = generate_recompute(tiny, prompt, 6, keep_logits=True)
    with ops.use("triton"):
        inc = generate_incremental(tiny, prompt, 6, keep_logits=True)
        # one step: only the first recompute step's logits are compared, and each later step is a whole prefill
        rec = generate_recompute(tiny, prompt, 1, keep_logits=True)
    assert inc.tokens == ref.tokens
    for a, b in zip(inc.logits, ref.logits):
        assert rel_err(a, b) < 1e-4
    assert rel_err(rec.logits[0], ref.logits[0]) < 1e-4


def test_kernel_selection_is_explicit():
    with ops.use("torch"):
        assert ops.kernels_setting() == "torch"
    with pytest.raises(ValueError, match="kernel mode"):
        with ops.use("fast"):
            pass

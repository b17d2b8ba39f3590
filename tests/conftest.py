import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# No GPU (CI): Triton kernels run through Triton's interpreter. Triton reads this when a kernel module is
# first imported, so it is set here, before any test module imports model.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# Small, deterministic hypothesis runs: CI has 2 cores and the whole suite must stay under 10 minutes.
settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")


def rel_err(x, ref) -> float:
    """Relative RMS error ||ref - x|| / ||ref|| in fp64 (fla's metric)."""
    x, ref = x.double(), ref.double()
    return float((ref - x).norm() / ref.norm().clamp_min(1e-300))

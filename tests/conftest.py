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


def _patch_interpreter_lang_once():
    """Triton 3.6's interpreter re-patches all of triton.language on every call of a @triton.jit helper inside a
    kernel (about a third of the interpreted kernels' time here), although the launch around the call has already
    patched those modules and keeps them patched until it returns. Skip a helper's re-patch when the running launch
    has patched every language module the helper sees; anything else takes Triton's own path."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "once_per_launch", False):
        return
    patched = []  # the language modules patched by the running launch (at most one launch runs at a time)

    class _Nothing:
        def restore(self):
            pass

    seen = {}  # helper -> the language modules among its globals

    def langs(fn):
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}
        return seen[fn]

    def patch_lang(fn):
        mine = langs(fn)
        if patched and mine <= patched[-1]:
            return _Nothing()  # a helper inside a launch: its modules are patched already
        scope = original(fn)
        if patched:  # a helper that sees another module: patched as Triton does, for the rest of the launch
            patched[-1] |= mine
            return scope
        patched.append(set(mine))  # a launch: its scope is restored when the grid is done
        restore = scope.restore

        def restore_and_pop():
            patched.pop()
            restore()
        scope.restore = restore_and_pop
        return scope

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_lang_once()

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Small, deterministic hypothesis runs: CI has 2 cores and the whole suite must stay under 10 minutes.
settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")


def rel_err(x, ref) -> float:
    """Relative RMS error ||ref - x|| / ||ref|| in fp64 (fla's metric)."""
    x, ref = x.double(), ref.double()
    return float((ref - x).norm() / ref.norm().clamp_min(1e-300))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny's ops
    are too small to gain from threads, and ranks forked from the process inherit the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

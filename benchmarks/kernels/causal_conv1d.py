"""causal_conv1d: the prefill conv (batch 1, T tokens, 3*H*D channels, 4 taps, from carried taps) against the torch
form it replaces (peer `torch`): ours must give torch's bits. Both sides by do_bench. `--conv-sweep` times every
tile config of CONV_SWEEP at each --prefill-T."""
from __future__ import annotations

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import D, DTYPE, H, PEER, PEER_TOL, PREFILL_T, W, rel_err
from benchmarks.kernels.spec import Bench, Sweep


def conv_inputs(T: int, device: str = "cuda"):
    """x [1, T, 3*H*D], the conv weight and carried taps at the 48B's shapes, in DTYPE."""
    gen = torch.Generator().manual_seed(T)
    C = 3 * H * D
    x = torch.randn(1, T, C, generator=gen).to(device, DTYPE)
    w = (0.5 * torch.randn(C, W, generator=gen)).to(device, DTYPE)
    taps = torch.randn(1, W - 1, C, generator=gen).to(device, DTYPE)
    return x, w, taps


def conv_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    from model import kda
    from model.triton.conv import CONFIG, causal_conv1d
    x, w, taps = conv_inputs(T)
    y, ref = causal_conv1d(x, w, taps)[0], kda.causal_conv1d(x, w, taps)[0]
    res = {"ours_ms": common.gpu_ms(lambda: causal_conv1d(x, w, taps), rep_ms),
           "peer_ms": common.gpu_ms(lambda: kda.causal_conv1d(x, w, taps), rep_ms), "rel_err_vs_peer": rel_err(y, ref),
           "bits_differing": int((y != ref).sum()), "peer": f"torch-{torch.__version__}", "cfg": dict(CONFIG)}
    return res, [] if res["bits_differing"] == 0 else [f"{res['bits_differing']} output elements differ from torch's"]


# model.triton.conv's tiles (tokens x channels per program, warps) around the default; each must give the default's
# bits (which are torch's, conv_case checks), so the tolerance is 0
CONV_SWEEP = [dict(BT=32, BC=512, STEP=4, num_warps=4), dict(BT=32, BC=512, STEP=2, num_warps=4),
              dict(BT=32, BC=512, STEP=8, num_warps=4), dict(BT=16, BC=512, STEP=4, num_warps=4),
              dict(BT=64, BC=512, STEP=4, num_warps=4), dict(BT=128, BC=512, STEP=4, num_warps=4),
              dict(BT=32, BC=256, STEP=4, num_warps=2), dict(BT=32, BC=1024, STEP=4, num_warps=4),
              dict(BT=32, BC=1024, STEP=4, num_warps=8), dict(BT=64, BC=1024, STEP=4, num_warps=8)]
CONV_SWEEP_TOL = 0.0


def conv_sweep(T: int, rep_ms: int, device: str = "cuda", keys: set[str] | None = None) -> list[dict]:
    """The prefill conv at each tile config of CONV_SWEEP (do_bench). One record per config."""
    from model.triton import conv
    x, w, taps = conv_inputs(T, device)

    def run(cfg):
        return conv.causal_conv1d(x, w, taps, cfg)[:1]

    params = {"op": "causal_conv1d", "B": 1, "T": T, "H": H, "d": D, "dtype": "bfloat16"}
    return common.sweep(f"causal_conv1d T={T}", CONV_SWEEP, conv.CONFIG, run,
                        lambda cfg: {"ours_ms": common.gpu_ms(lambda: run(cfg), rep_ms), "timing": "do_bench"},
                        CONV_SWEEP_TOL, params, device, keys)


BENCH = Bench(
    op="causal_conv1d", inputs=conv_inputs, ours="model.triton.conv:causal_conv1d", peer=f"torch-{torch.__version__}",
    peer_fn="model.kda:causal_conv1d",
    check="torch's bits (bits_differing == 0); relative RMS error <= PEER_TOL", tol=PEER_TOL, sizes=PREFILL_T,
    case=conv_case, params=lambda: dict(peer_scope="the torch form this replaces"), default=True,
    # a case that raises before naming its peer is recorded with the fla label, as every failed non-MLA case is
    peer_if_failed=PEER,
    sweep=Sweep(lambda: CONV_SWEEP, CONV_SWEEP_TOL, "--conv-sweep",
                "causal_conv1d: also time every tile config of CONV_SWEEP at each --prefill-T",
                lambda T, rep_ms, keys: conv_sweep(T, rep_ms, keys=keys)))

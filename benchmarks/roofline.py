"""Rooflines for Kimi-Linear decode and prefill, from the config and two ceilings measured in the same run.

Decode reads every active weight once per step (batch 1: one token), plus the per-sequence state:
    bytes/token(context) = weights (non-expert + top-k experts + shared expert + router + lm_head)
                         + MLA latent cache read (7 layers x 576 values x context)
                         + KDA recurrent state and conv taps, read and written back
    decode roofline tok/s = HBM read bandwidth / bytes per token
Prefill is bound by matmul arithmetic:
    FLOPs/token(T) = 2 x (active params - lm_head) + 2 x lm_head / T  (logits of the last position only)
                   + MLA attention over the (T+1)/2 earlier positions a token sees on average (causal)
                   + KDA chunked-recurrence arithmetic
    prefill roofline tok/s = bf16 matmul rate / FLOPs per token
The ceilings are measured, never taken from a datasheet: a large reduction for read bandwidth, an 8192^3 bf16
matmul for the arithmetic rate (SPEC.md §4: 4.25 TB/s and ~790 TFLOP/s on the H200). Beside them the host's cost
of one eager launch (`measure_launch_us`) and of one launch of our own Triton kernels (`measure_kernel_launch_us`):
no roofline uses them, but launch-bound code (HF's eager decode, an eager prefill of a short prompt) moves with them
from run to run, so each record keeps them.

`python -m benchmarks.roofline [--preset 48b-a3b]` prints the per-token figures and, on a GPU, the ceilings.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.timing import sync, time_calls
from model.config import KimiConfig, get_config
from model.params import param_counts
from records.exits import run_main

GB = 1e9
KDA_CHUNK = 64  # chunk length of the chunked KDA form as fla runs it (the work counted, not our launch choice)


# ---- bytes and FLOPs from the config ----------------------------------------------------------

def weight_bytes_per_token(cfg: KimiConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of weights one decode step reads: every active parameter once. The fp32 parameters (A_log,
    dt_bias, the router's correction bias) are all active, so they are counted at 4 bytes."""
    c = param_counts(cfg)
    return (c.active_per_token - c.fp32) * dtype.itemsize + c.fp32 * 4


def state_bytes_per_token(cfg: KimiConfig, context: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of per-sequence state one decode step moves at `context` cached tokens: the MLA latent cache
    (c and k_pe, read), the KDA fp32 recurrent state and the conv taps (each read and written back)."""
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    mla = len(cfg.mla_layer_ids) * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype.itemsize
    kda_state = len(cfg.kda_layer_ids) * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4
    taps = len(cfg.kda_layer_ids) * (cfg.conv_kernel_size - 1) * 3 * cfg.kda_dim * dtype.itemsize
    return mla + 2 * (kda_state + taps)


def decode_bytes_per_token(cfg: KimiConfig, context: int, dtype: torch.dtype = torch.bfloat16) -> int:
    return weight_bytes_per_token(cfg, dtype) + state_bytes_per_token(cfg, context, dtype)


def decode_roofline_tok_s(cfg: KimiConfig, context: int, hbm_gbps: float, dtype: torch.dtype = torch.bfloat16) -> float:
    """Batch-1 decode tokens/s if every step only moved its bytes at the measured read bandwidth."""
    if hbm_gbps <= 0:
        raise ValueError(f"hbm_gbps must be > 0, got {hbm_gbps}")
    return hbm_gbps * GB / decode_bytes_per_token(cfg, context, dtype)


def mla_attention_flops_per_token(cfg: KimiConfig, T: int) -> float:
    """Scores (q.k over qk_head_dim) and weighted values (over v_head_dim) per head, against the (T+1)/2
    positions a token of a causal T-token prompt attends to on average, in every MLA layer."""
    per_key = 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return len(cfg.mla_layer_ids) * per_key * (T + 1) / 2


def kda_flops_per_token(cfg: KimiConfig) -> float:
    """Chunked KDA per token and head (d = head dim, C = chunk): 6 d^2 for the state (q S, k S, the k^T v
    update), 10 C d for the intra-chunk products (k k^T, A k, A v, q k^T, P v), C^2 for the triangular solve."""
    d, C = cfg.kda_head_dim, KDA_CHUNK
    return len(cfg.kda_layer_ids) * cfg.kda_num_heads * (6 * d * d + 10 * C * d + C * C)


def prefill_flops_per_token(cfg: KimiConfig, T: int) -> float:
    """FLOPs per token of a T-token prefill from an empty cache that keeps the last position's logits."""
    if T < 1:
        raise ValueError(f"prefill length must be >= 1, got {T}")
    lm_head = cfg.vocab_size * cfg.hidden_size
    dense = 2 * (param_counts(cfg).active_per_token - lm_head) + 2 * lm_head / T
    return dense + mla_attention_flops_per_token(cfg, T) + kda_flops_per_token(cfg)


def prefill_roofline_tok_s(cfg: KimiConfig, T: int, matmul_tflops: float) -> float:
    if matmul_tflops <= 0:
        raise ValueError(f"matmul_tflops must be > 0, got {matmul_tflops}")
    return matmul_tflops * 1e12 / prefill_flops_per_token(cfg, T)


# ---- the two ceilings, measured -----------------------------------------------------------------

@dataclass(frozen=True)
class Ceilings:
    hbm_gbps: float  # read bandwidth of a large reduction, GB/s (1e9)
    matmul_tflops: float  # bf16 matmul rate, TFLOP/s
    launch_us: float  # host wall time of one eager launch of a trivial op (measure_launch_us)
    kernel_launch_us: float  # host wall time of one call of the model's RMSNorm op (measure_kernel_launch_us)
    read_bytes: int
    matmul_n: int
    reps: int


def measure_read_gbps(device, nbytes: int, reps: int) -> float:
    """Median read bandwidth of `x.sum()` over a bf16 tensor of `nbytes` (random values: never time zeros)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    x.sum()  # warm-up: kernel selection, allocator
    ms = time_calls(lambda: x.sum(), reps, device).summary()["median_ms"]
    del x
    return nbytes / (ms / 1e3) / GB


def measure_matmul_tflops(device, n: int, reps: int) -> float:
    """Median rate of an n x n x n bf16 matmul on random operands."""
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    a @ b  # warm-up: cuBLAS handle and heuristics
    ms = time_calls(lambda: a @ b, reps, device).summary()["median_ms"]
    del a, b
    return 2 * n ** 3 / (ms / 1e3) / 1e12


def measure_launch_us(device, n: int = 2000, reps: int = 5, op: Callable[[], object] | None = None) -> float:
    """The host's cost of one eager op: the median over `reps` of the wall time of n back-to-back calls of `op`
    (default: an in-place add on a one-element tensor, whose device work is nil, so on CUDA this is the launch path:
    Python, the dispatcher, the driver), the device drained before and after, divided by n; microseconds."""
    if n < 1 or reps < 1:
        raise ValueError(f"n and reps must be >= 1, got {n}, {reps}")
    if op is None:
        x = torch.zeros(1, device=device)
        op = lambda: x.add_(1.0)  # noqa: E731
    op()  # warm-up
    us = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        for _ in range(n):
            op()
        sync(device)
        us.append(1e6 * (time.perf_counter() - t) / n)
    return statistics.median(us)


def measure_kernel_launch_us(device, n: int = 500, reps: int = 5) -> float:
    """The host's cost of one call of one of the model's own ops, `model.ops.rmsnorm` on a single row (device work
    nil): on CUDA a Triton launch through its wrapper (argument checks, the output's allocation, Triton's binder and
    launcher), the path every Triton kernel of our eager prefill takes; on a CPU the torch form. Beside
    `measure_launch_us` (an eager torch op) it says what a launch of our own kernels costs this host. Microseconds."""
    from model import ops
    x = torch.ones(1, 8, device=device, dtype=torch.bfloat16)
    w = torch.ones(8, device=device, dtype=torch.bfloat16)
    return measure_launch_us(device, n, reps, op=lambda: ops.rmsnorm(x, w, 1e-6))


def measure_ceilings(device, read_bytes: int = 4 << 30, matmul_n: int = 8192, reps: int = 20) -> Ceilings:
    c = Ceilings(measure_read_gbps(device, read_bytes, reps), measure_matmul_tflops(device, matmul_n, reps),
                 measure_launch_us(device), measure_kernel_launch_us(device), read_bytes, matmul_n, reps)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return c


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="48b-a3b")
    ap.add_argument("--contexts", default="0,1024,8192,32768,131072")
    a = ap.parse_args(argv)
    cfg = get_config(a.preset)
    contexts = [int(x) for x in a.contexts.split(",")]
    print(f"{cfg.name}: weights read per decoded token {weight_bytes_per_token(cfg) / GB:.3f} GB (bf16)")
    ceil = measure_ceilings("cuda") if torch.cuda.is_available() else None
    if ceil:
        print(f"measured: read bandwidth {ceil.hbm_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s, "
              f"one eager launch {ceil.launch_us:.1f} us")
    for ctx in contexts:
        line = (f"context {ctx:>7}: decode {decode_bytes_per_token(cfg, ctx) / GB:.3f} GB/token, "
                f"prefill {prefill_flops_per_token(cfg, max(ctx, 1)) / 1e9:.2f} GFLOP/token")
        if ceil:
            line += (f"; roofline decode {decode_roofline_tok_s(cfg, ctx, ceil.hbm_gbps):.0f} tok/s, "
                     f"prefill {prefill_roofline_tok_s(cfg, max(ctx, 1), ceil.matmul_tflops):.0f} tok/s")
        print(line)


if __name__ == "__main__":
    sys.exit(run_main(main))

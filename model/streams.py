"""The side stream: prefill work forked off the caller's CUDA stream, to run beside what follows on it, and joined
back before its results are read.

Used where a kernel leaves most of the GPU idle and independent work exists: the chunked KDA scan beside the next
segment's prep kernel (`model.triton.kda_chunk`, "Segments"), the MoE's shared expert beside the routing and the
routed experts (`model.ops.moe`).

Memory: tensors made on the caller's stream and read on the side stream stay safe to free once `join` has been
called (any later work on the caller's stream runs after the side stream's); tensors made on the side stream belong
to its pool, which only work forked after them can reuse. So: fork, launch, join before the results are read or the
inputs are freed.
"""
from __future__ import annotations

import torch

_side: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream, made once, at the highest priority: its kernels' programs take SM slots first as
    those of the caller's stream free them (a latency-bound kernel of few programs should not queue behind a wave
    of many)."""
    device = torch.device(device)
    if device not in _side:
        _side[device] = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1])
    return _side[device]


def fork(device: torch.device) -> torch.cuda.Stream:
    """The side stream, after everything launched so far on the current stream."""
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(side.device))
    return side


def join(side: torch.cuda.Stream) -> None:
    """The current stream waits for everything launched so far on `side`."""
    torch.cuda.current_stream(side.device).wait_stream(side)

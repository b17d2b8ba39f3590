"""A kernel that lets the launch after it start at once (PDL) and writes its output only later: the GPU tests of
the early (PDL) launches put it just before one, to show that the launch reads that output only after its wait."""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer


@triton.jit
def _late_copy_kernel(src, dst, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr):
    """dst <- src, stored DELAY_NS after the program starts, which first lets a launch made after it with PDL start."""
    gdc_launch_dependents()
    t0 = globaltimer()
    while globaltimer() - t0 < DELAY_NS:
        pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def late_copy(src: torch.Tensor, dst: torch.Tensor, delay_us: int = 50) -> None:
    """dst <- src (CUDA), stored delay_us after the copy starts; a launch made after it with PDL may start at once."""
    _late_copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), DELAY_NS=delay_us * 1000, BLOCK=1024)

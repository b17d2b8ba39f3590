"""Expert parallelism over the ranks of one host: the routed experts split across ranks, the rest replicated.

The split: rank r of `world` holds the routed experts [r*E/world, (r+1)*E/world) of every MoE layer as the rows of
its own, smaller expert stacks. Everything else (embeddings, attention, KDA, the dense layer, the routers, the shared
experts, lm_head) is held whole by every rank. Every rank runs the whole model on the same tokens, so every router
picks the same experts on every rank. A rank weighs its own experts' outputs as routed and the others' by zero
(`ExpertParallel.localize`), and one all_reduce (SUM) per MoE layer adds the ranks' partial outputs
(`ExpertParallel.reduce`). A rank still computes every slot of its tokens, the others' weighted zero: the experts'
memory is divided over the ranks, their FLOPs are not yet (docs/PARALLEL.md).

The shared expert is added on rank 0 alone, inside its partial output (on the decode kernels in the same launches as
its routed experts). The sum then holds each term of the one-process sum exactly once, so it equals the one-process
output up to the order of the fp32 additions. Every rank gets the same bits from the reduction, so the replicated
state and the chosen tokens stay identical across ranks. Partials are summed in fp32 (fp64 in an fp64 model). In
bf16 the kernels round each rank's partial to bf16 before the sum, and the sum is rounded once more: a bf16 model
rounds world + 1 times where one process rounds once.

Ranks come from torchrun (`init`: env://, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or from `spawn`,
which starts its own. On CUDA rank r computes on cuda:LOCAL_RANK over NCCL; on a CPU over gloo.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint
from .checkpoint import ROUTED_EXPERTS, layout
from .config import KimiConfig
from .weights import bit_patterns, bit_sum, sample_positions, tensor_digest

RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
DEFAULT_TIMEOUT_S = 600
_skip_collective = False  # set only inside `collective_skipped`


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Rank `rank` of `world`, holding the contiguous range `experts` of the `num_experts` routed experts of each MoE
    layer. `group`: the process group of the ranks (None: the default group)."""
    world: int
    rank: int
    num_experts: int
    group: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("world", "rank", "num_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"ExpertParallel.{name} must be an int, got {v!r}")
        if self.world < 1 or self.num_experts < 1:
            raise ValueError(f"expert parallelism needs world >= 1 and num_experts >= 1, got {self.world} and "
                             f"{self.num_experts}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} lies outside 0..{self.world - 1}")
        if self.num_experts % self.world:
            fits = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ValueError(f"expert parallelism over {self.world} ranks: the {self.num_experts} routed experts do "
                             f"not split evenly; use a number of ranks that divides {self.num_experts} "
                             f"({', '.join(map(str, fits))})")

    @classmethod
    def of(cls, num_experts: int, group=None) -> "ExpertParallel":
        """This process's share in the initialised process group (`init`)."""
        if not dist.is_initialized():
            raise RuntimeError("no process group: call model.parallel.init() first (under torchrun or spawn)")
        return cls(dist.get_world_size(group), dist.get_rank(group), num_experts, group)

    @property
    def num_local(self) -> int:
        return self.num_experts // self.world

    @property
    def start(self) -> int:
        return self.rank * self.num_local

    @property
    def stop(self) -> int:
        return self.start + self.num_local

    @property
    def experts(self) -> range:
        return range(self.start, self.stop)

    def check(self, cfg: KimiConfig) -> None:
        if cfg.num_experts != self.num_experts:
            raise ValueError(f"expert parallelism set up for {self.num_experts} routed experts; config {cfg.name!r} "
                             f"has {cfg.num_experts}")

    def layout(self, cfg: KimiConfig):
        """`model.checkpoint.layout` for this rank: the routed experts' slots of its own experts alone, placed in
        stacks of `num_local` experts; every other slot as it is."""
        self.check(cfg)
        slots, internal = layout(cfg)
        mine = {}
        for name, s in slots.items():
            if s.internal.endswith(ROUTED_EXPERTS):
                e = s.index[0]
                if e not in self.experts:
                    continue
                s = dataclasses.replace(s, index=(e - self.start, *s.index[1:]))
            mine[name] = s
        stacks = {n: ((self.num_local, *shape[1:]), dt) if n.endswith(ROUTED_EXPERTS) else (shape, dt)
                  for n, (shape, dt) in internal.items()}
        return mine, stacks

    def localize(self, idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing (idx [N, k] global expert ids, w [N, k]) -> (ids into this rank's stacks, weights): a slot routed
        to another rank's expert keeps its place with weight 0, so it adds exactly zero. It is pointed at an expert
        its token reads anyway (its first own slot's; local expert 0 when the token has none here), so the decode
        kernels stream no rows for it beyond those. No host sync: the decode step stays capturable."""
        owned = (idx >= self.start) & (idx < self.stop)
        local = idx - self.start
        first = owned.to(torch.uint8).argmax(-1, keepdim=True)
        fill = torch.where(owned.any(-1, keepdim=True), local.gather(-1, first), 0)
        return torch.where(owned, local, fill), torch.where(owned, w, 0.0)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of the partial outputs y: one all_reduce (SUM) in fp32 (fp64 for an fp64 y),
        rounded once to y's dtype. Every rank gets the same bits."""
        acc = y if y.dtype in (torch.float32, torch.float64) else y.float()
        if not _skip_collective:
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.group)
        return acc.to(y.dtype)

    def digest(self, name: str, t: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """`model.weights.tensor_digest` of the whole tensor, for a routed expert stack of which t is this rank's
        slice: the bit-pattern sums and the sampled elements are added across ranks (each sampled element lies in
        exactly one rank's slice; the others add 0), so `weights_id` is the one-process model's. Collective: every
        rank must call it for the same names in the same order."""
        if not name.endswith(ROUTED_EXPERTS):
            return tensor_digest(name, t)
        bits = bit_patterns(t)
        n = bits.numel()
        lo = self.rank * n
        pos = sample_positions(n * self.world).to(bits.device)
        mine = (pos >= lo) & (pos < lo + n)
        sample = torch.zeros(pos.shape, dtype=torch.int64, device=bits.device)
        sample[mine] = bits[pos[mine] - lo].to(torch.int64)
        total = bit_sum(bits)
        for x in (total, sample):
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return [self.num_experts, *t.shape[1:]], torch.cat([total.view(torch.uint8),
                                                            sample.to(bits.dtype).view(torch.uint8)])


@contextlib.contextmanager
def collective_skipped():
    """Inside the block `ExpertParallel.reduce` skips its all_reduce, each rank keeping its own partial output (wrong
    outputs, and a CUDA graph captured inside holds no collective), so that a benchmark can time a step without it."""
    global _skip_collective
    before, _skip_collective = _skip_collective, True
    try:
        yield
    finally:
        _skip_collective = before


def shard_(model: torch.nn.Module, ep: ExpertParallel) -> torch.nn.Module:
    """Make every MoE layer of `model` hold only `ep`'s experts and sum the ranks' partial outputs (`MoE.shard_`)."""
    from .layers import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.shard_(ep)
    return model


def weights_id(state, cfg: KimiConfig, ep: ExpertParallel) -> str:
    """`model.weights.weights_id` of the whole model, from a rank's state dict (collective)."""
    from .weights import weights_id as whole_id

    return whole_id(state, cfg, ep.digest)


# ---- loading a rank's share of a checkpoint ---------------------------------------------------------------------

def load_checkpoint_shard(path: str | Path, ep: ExpertParallel, device: str | torch.device = "cpu",
                          dtype: torch.dtype = torch.bfloat16,
                          expert_dtype: torch.dtype | None = None) -> tuple[KimiConfig, dict[str, torch.Tensor]]:
    """`model.checkpoint.load_checkpoint` for one rank: every check of the whole checkpoint's config, index, names,
    shapes and dtypes (headers only), then only this rank's tensors read: the replicated ones and its own experts'
    w1/w2/w3, into stacks of `ep.num_local` experts. A shard that holds none of them is not opened again."""
    return checkpoint.load_checkpoint(path, device, dtype, expert_dtype, layout_of=ep.layout)


# ---- processes ---------------------------------------------------------------------------------------------------

def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    if v is None:
        raise RuntimeError(f"{name} is not set: start the ranks with torchrun --nproc-per-node <n> (or "
                           f"model.parallel.spawn)")
    try:
        return int(v)
    except ValueError:
        raise RuntimeError(f"{name}={v!r} is not an integer") from None


def init(device: str | None = None, init_method: str = "env://", timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the process group of this host's ranks (RANK, WORLD_SIZE, LOCAL_RANK from the environment, as torchrun
    sets them) and return the device this rank computes on: cuda:LOCAL_RANK over NCCL on CUDA (the default when torch
    sees a GPU; its communicator is made here, before any graph capture), the CPU over gloo otherwise."""
    world, rank, local = (_env_int(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} needs CUDA device {local}; torch sees "
                               f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"device {device!r}: expected 'cuda' or 'cpu'")
    dist.init_process_group(backend_for(dev), init_method=init_method, world_size=world, rank=rank,
                            timeout=timedelta(seconds=timeout_s), device_id=dev if dev.type == "cuda" else None)
    return dev


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(rank: int, fn, world: int, store: str, device: str, args: tuple, results, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init(device, init_method=f"file://{store}", timeout_s=timeout_s)
    try:
        results.put((rank, pickle.dumps(fn(*args))))
    finally:
        destroy()


class RanksWithoutResult(RuntimeError):
    """Ranks of `spawn` that exited cleanly yet left no result."""


def spawn(fn, world: int, args: tuple = (), device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
          start_method: str = "spawn") -> list:
    """Run fn(*args) in `world` new processes, the ranks 0..world-1 of one process group (`init` with `device`), and
    return their results in rank order. With the default start method the ranks start fresh: fn and args must
    pickle (fn a module-level function). "fork" (CPU only: CUDA cannot be forked) skips each rank's imports. A rank
    that raises stops the others and the first error seen is raised here (a rank waiting on the failed one in a
    collective may report the broken connection first); ranks still running after `timeout_s` are stopped and
    TimeoutError is raised."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if start_method not in ("spawn", "fork"):
        raise ValueError(f"start_method {start_method!r}: expected 'spawn' or 'fork'")
    if start_method == "fork" and device != "cpu":
        raise ValueError("start_method 'fork' runs CPU ranks only: a forked process cannot use CUDA")
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="kimi-ranks-")
    results = mp.get_context(start_method).SimpleQueue()
    got: dict[int, bytes] = {}
    try:
        ctx = mp.start_processes(_rank_main, args=(fn, world, os.path.join(tmp, "store"), device, args, results,
                                                   timeout_s), nprocs=world, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        done = False
        while not done:
            while not results.empty():  # read as they come: a rank's put waits for room in the pipe
                rank, blob = results.get()
                got[rank] = blob
            done = ctx.join(timeout=0.05)
            if not done and time.monotonic() > deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]  # process r is rank r
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s:g} s; still running: rank"
                                   f"{'s' if len(alive) > 1 else ''} {', '.join(map(str, alive))}")
        while not results.empty():
            rank, blob = results.get()
            got[rank] = blob
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    missing = sorted(set(range(world)) - set(got))
    if missing:
        raise RanksWithoutResult(f"ranks {missing} exited without a result")
    return [pickle.loads(got[r]) for r in range(world)]

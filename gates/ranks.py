"""A gate run over several ranks (`--world N`): the command starts the N processes itself, the ranks of one process
group (`model.parallel.spawn`: gloo on a CPU, NCCL on CUDA with rank r on cuda:r). Each rank loads its share of the
routed experts (`gates.run.load_subject`) and runs the whole gate, since each MoE layer is a collective; rank 0
alone prints and keeps the record, and the run's exit code is rank 0's. A rank that crashes, or ranks still
running at the timeout, stop the run: `RankFailed`, naming the rank, which the CLI turns into exit 2 and an
INVALID record.
"""
from __future__ import annotations

import math
import sys

from model import parallel

from .memory import describe_links, gpu_links
from .run import Options, group_rank, limit_cpu_threads

TITLES = {"gate-a": "Gate A", "gate-b": "Gate B", "gate-memory": "Memory gate"}
# How long the ranks of a gate run may take, and the longest one collective may wait for a rank that does not come
# (the process group's timeout): the 48B gates load and run in minutes.
DEFAULT_RANK_TIMEOUT_S = 3600.0
MAX_RANK_TIMEOUT_S = 7 * 86400.0


class RankFailed(RuntimeError):
    """A rank of the run crashed, died or hung; the message names it, `detail` holds its traceback if it left one."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def check_rank_timeout(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 < x <= MAX_RANK_TIMEOUT_S):
        raise ValueError(f"--rank-timeout-s must be a number of seconds in (0, {MAX_RANK_TIMEOUT_S:g}], got {x!r}")
    return float(x)


def first_line(command: str, opts: Options, links: dict | None = None) -> str:
    """What a run over several ranks says before anything else: how many, the experts each holds, where they run
    (each GPU and the links between them, as NVML reports them) and, for a default, why that many."""
    where = "cpu, gloo" if opts.device == "cpu" else f"cuda, NCCL; {describe_links(links)}"
    line = (f"{TITLES[command]} over {opts.world} ranks, {opts.experts_per_rank} experts each: {opts.label} "
            f"{opts.precision} ({where})")
    return line + (f"; default world: {opts.world_choice}" if opts.world_choice else "")


def _quiet(*args, **kwargs) -> None:
    pass


def _rank_main(command: str, opts: Options) -> int:
    """One rank: run the gate; rank 0 prints, the others are silent (their gate records nothing: `record`)."""
    from .gate_a import run_gate_a
    from .gate_b import run_gate_b
    from .gate_memory import run_memory_gate

    limit_cpu_threads(opts)
    run = {"gate-a": run_gate_a, "gate-b": run_gate_b, "gate-memory": run_memory_gate}[command]
    return run(opts, log=print if group_rank() == 0 else _quiet)


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "(no message)"


def spawn_ranks(fn, world: int, args: tuple, device: str, timeout_s: float) -> list:
    """`fn(*args)` on `world` ranks started here (forked on a CPU, where it saves each rank the imports; started fresh
    on CUDA, which cannot be forked): each rank's return value, or RankFailed naming the rank that crashed, died or
    hung. Output the parent still buffers is flushed first, or a forked rank would write it out once more."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return parallel.spawn(fn, world, args, device=device, timeout_s=timeout_s,
                              start_method="fork" if device == "cpu" else "spawn")
    except ProcessRaisedException as e:
        raise RankFailed(f"rank {e.error_index} crashed: {_last_line(e.msg)}", e.msg) from None
    except ProcessExitedException as e:
        how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        raise RankFailed(f"rank {e.error_index} died ({how}) without a result") from None
    except (TimeoutError, parallel.RanksWithoutResult) as e:
        raise RankFailed(str(e)) from None


def run_ranks(command: str, opts: Options, timeout_s: float = DEFAULT_RANK_TIMEOUT_S, log=print) -> int:
    """Run `command` over `opts.world` ranks started here and return rank 0's exit code."""
    if opts.world < 2 or not math.isfinite(timeout_s):
        raise ValueError(f"run_ranks needs world >= 2 and a finite timeout, got {opts.world} and {timeout_s}")
    log(first_line(command, opts, gpu_links(range(opts.world)) if opts.device == "cuda" else None))
    codes = spawn_ranks(_rank_main, opts.world, (command, opts), opts.device, timeout_s)
    if len(set(codes)) > 1:
        print(f"warning: the ranks' exit codes differ ({', '.join(map(str, codes))}); the run's is rank 0's",
              file=sys.stderr)
    return codes[0]

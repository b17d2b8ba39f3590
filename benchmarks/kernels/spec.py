"""What a kernel benchmark declares: `Bench` (one op of `--ops`), its sizes (`Size`, a command-line option) and its
launch-config sweep (`Sweep`). The benchmark modules build one `Bench` each; `benchmarks.kernels.registry` lists
them, and the runner (`python -m benchmarks.kernels`) reads nothing else to know the ops, their options and order.
Kernel and peer functions are named as "module:function" (`resolve` imports one): the cases import their kernels
when they run, so that a test that patches a kernel module's function reaches the bench."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Sequence


def resolve(ref: str) -> Callable:
    """The function a "module:function" reference names, imported now."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Size:
    """The sizes a bench runs at: a comma-separated list of positive integers on the command line (`flag`), or
    fixed shapes (flag None: no option, `default` empty)."""
    flag: str | None
    default: tuple[int, ...] = ()
    help: str | None = None

    @property
    def dest(self) -> str | None:
        """The attribute of the parsed arguments that holds the sizes."""
        return None if self.flag is None else self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Sweep:
    """Launch configs timed one by one, each config's output held against the default config's (or the peer's)
    within `tol`. `configs()` gives the grid as the module holds it when called. With a `flag`, the sweep runs only
    when the flag is given: for a bench with a case, `run(size, rep_ms, keys)` at each size after its cases; a study
    is told (`swept`) and runs it itself. Without a flag the bench runs it every time, inside its case or study."""
    configs: Callable[[], Sequence]
    tol: float
    flag: str | None = None
    help: str | None = None
    run: Callable[[int, int, set | None], list] | None = None

    @property
    def dest(self) -> str | None:
        return None if self.flag is None else self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Bench:
    """One op of `--ops`.

    - `inputs`: the seeded inputs builder at one size.
    - `ours`: the kernel timed ("module:function"); `peer`: the peer's name as the records carry it; `peer_fn`: the
      peer ("module:function"), None where it is fla's (loaded once per run, `fla`) or built inside the case.
    - `check`: what ours is held against, in words; `tol`: the bound (for a case: on `rel_err_vs_peer`).
    - `sizes`: the command-line sizes; `size_key`: the record param a size fills ("T", or "B" for batch).
    - `case(n, [fla,] rep_ms) -> (results, reasons)`: one summarised vs-peer record per size, made by the runner;
      `study(sizes, rep_ms, swept) -> records`: a bench that writes its own records, after the summary.
    - `params()`: the record params beside op, B, T, H, d and dtype, read when a case runs (launch configs in force).
    - `targets`: (param, value, "<=" or "<") pairs the summary states as MET or MISSED.
    - `peer_if_failed`: results.peer of a case that raised before naming its peer.
    """
    op: str
    inputs: Callable
    ours: str
    peer: str
    peer_fn: str | None
    check: str
    tol: float
    sizes: Size
    size_key: str = "T"
    case: Callable | None = None
    study: Callable | None = None
    params: Callable[[], dict] = dict
    sweep: Sweep | None = None
    targets: tuple[tuple[str, int, str], ...] = ()
    default: bool = False
    fla: bool = False
    peer_if_failed: str | None = None

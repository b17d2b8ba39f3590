"""python -m gates {gate-a,gate-b,gate-memory,golden} [flags]

Flags only: this CLI reads no environment variables (the Makefile maps PRESET, MODEL, DTYPE, EXPERT_DTYPE,
DEVICE, NEW_TOKENS, FLOOR_GIB, SOURCE, GOLDEN, WORLD to the flags of the same meaning). Defaults: see gates/run.py.
Records go to records/<kind>.jsonl (records/store.py decides where; KIMI_RECORDS_DIR moves them).

--world N (gate-a, gate-b, gate-memory): split the routed experts over N ranks, which the command starts itself,
one process (on CUDA one GPU) each; rank 0 prints and records, and its exit code is the run's (gates/ranks.py).
Without it: one process on a CPU; on CUDA as few ranks as hold the model with the floor (gates/run.py).

Exit codes (docs/EXIT_CODES.md): 0 the gate holds (or the memory gate SKIPs: no GPU; or the golden is written);
1 it fails on valid inputs; 2 it could not judge (bad arguments or input, refused by the memory floor, a golden
for other weights/prompts, records that cannot be written, or a crash, its traceback printed; a gate's crash is
still recorded, INVALID, with the exception, where the records folder can be written; over several ranks, a rank
that crashes or outlives --rank-timeout-s, named).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from model import ops
from model.checkpoint import check_checkpoint
from model.config import PRESETS
from records import store

from .golden import (GOLDEN_DIR, GoldenError, check_golden_file, check_golden_writable, find_golden, golden_name,
                     make_golden, write_golden)
from .memory import MemoryFloorError
from .prompts import DEFAULT_NEW_TOKENS
from .ranks import DEFAULT_RANK_TIMEOUT_S, RankFailed, check_rank_timeout, first_line, run_ranks
from .run import (DEFAULT_FLOOR_GIB, DEVICES, DTYPES, EXIT_PASS, EXIT_REFUSED, KERNELS, RECORD_KINDS, SOURCES,
                  GateRefused, Options, battery_for, context_len, floor_guard, limit_cpu_threads, load_subject,
                  prompt_note, refused, resolve)

COMMANDS = {
    "gate-a": "Gate A: incremental decode must give exactly the recompute path's tokens",
    "gate-b": "Gate B: STRICT md5 match against a golden file",
    "gate-memory": "memory floor: project, refuse, watch, audit (SKIP without a GPU)",
    "golden": "make a golden file with HF transformers (--source hf) or our recompute path (--source self)",
}


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", choices=sorted(PRESETS), help="synthetic-weights model (default: see gates/run.py)")
    common.add_argument("--model", metavar="DIR", help="original-format checkpoint directory (instead of --preset)")
    common.add_argument("--dtype", choices=list(DTYPES),
                        help="default fp32 on a CPU; bf16 on CUDA, but fp32 with bf16 experts for gate-a, gate-b and "
                             "golden --source self (gates/run.py)")
    common.add_argument("--expert-dtype", choices=list(DTYPES),
                        help="hold the routed experts in this dtype (default: the model's; on CUDA bf16 for gate-a, "
                             "gate-b and golden --source self)")
    common.add_argument("--device", choices=DEVICES, help="default cuda when available")
    common.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, help="greedy tokens per prompt (16)")
    common.add_argument("--floor-gib", type=float, default=DEFAULT_FLOOR_GIB, help="free device memory to keep (15)")
    common.add_argument("--seed", type=int, default=0, help="synthetic weights seed (0)")
    common.add_argument("--kernels", choices=KERNELS, default="auto", help="model ops: auto (Triton on CUDA), torch, triton")
    # flags only some commands read: elsewhere argparse refuses them rather than let them be silently ignored
    use_golden = argparse.ArgumentParser(add_help=False)
    use_golden.add_argument("--golden", metavar="PATH", help="the golden to use (default: lookup in gates/goldens)")
    make_golden_ = argparse.ArgumentParser(add_help=False)
    make_golden_.add_argument("--golden", metavar="PATH", help="where to write it (default: gates/goldens/<name>)")
    make_golden_.add_argument("--source", choices=SOURCES, default="hf", help="who generates it (hf)")
    ranks = argparse.ArgumentParser(add_help=False)
    ranks.add_argument("--world", type=int, metavar="N",
                       help="split the routed experts over N ranks, one process (on CUDA one GPU) each (default: 1 "
                            "on a CPU; on CUDA as few as hold the model with the floor, see gates/run.py)")
    ranks.add_argument("--rank-timeout-s", type=float, default=DEFAULT_RANK_TIMEOUT_S, metavar="S",
                       help=f"with N > 1: seconds the ranks may run, and one collective may wait, before they are "
                            f"stopped ({DEFAULT_RANK_TIMEOUT_S:g})")
    own = {"gate-a": [ranks], "gate-b": [use_golden, ranks], "gate-memory": [ranks], "golden": [make_golden_]}
    ap = argparse.ArgumentParser(prog="python -m gates", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help_ in COMMANDS.items():
        sub.add_parser(name, parents=[common, *own.get(name, [])], help=help_, description=help_)
    return ap


def check_no_outside_links(folder: str) -> None:
    """HF reads more of a checkpoint folder than our loader does (generation_config.json, ...): refuse a link in it
    that leads outside the folder, which our loader would never follow."""
    root = os.path.realpath(folder)
    for entry in sorted(Path(folder).iterdir()):
        if entry.is_symlink() and os.path.commonpath([root, os.path.realpath(entry)]) != root:
            raise ValueError(f"{entry}: a link out of the checkpoint folder; copy the checkpoint with its links "
                             f"resolved (cp -rL)")


def golden_command(opts: Options) -> int:
    path = Path(opts.golden) if opts.golden else GOLDEN_DIR / golden_name(opts.label, opts.dtype, opts.device, opts.source)
    check_golden_writable(path)       # before the generation, not after it
    if opts.source == "hf" and opts.expert_dtype is not None:
        raise ValueError(f"--expert-dtype {opts.expert_dtype}: HF transformers holds the whole model in one dtype; "
                         f"make the golden with --dtype alone")
    b = battery_for(opts)
    with floor_guard(opts, context_len(b, opts.new_tokens)), ops.use(opts.kernels):
        # HF on a CPU loads a checkpoint directory itself; a second copy of a real model is not needed there
        hf_alone = opts.source == "hf" and opts.device == "cpu" and opts.model is not None
        if hf_alone:
            check_checkpoint(opts.model)   # held to our loader's checks all the same (HF's let more through)
            check_no_outside_links(opts.model)
        g = make_golden(opts, None if hf_alone else load_subject(opts))
    shadowed = None if opts.golden else found_golden(opts)
    out = write_golden(g, path)
    print(f"golden {store.shown_path(out)}: {len(g['prompts'])} prompts x {g['new_tokens']} tokens, md5 {g['md5']}, "
          f"{g['provenance']['implementation']} {g['dtype']} {g['device']}, weights {g['weights']}")
    if shadowed is not None and found_golden(opts) == out:
        print(f"note: Gate B on {opts.label} {opts.dtype} {opts.device} now reads this golden in place of "
              f"{store.shown_path(shadowed)}, which it read before (lookup order: gates/golden.py); delete "
              f"{store.shown_path(out)} to go back")
    return EXIT_PASS


def found_golden(opts: Options) -> Path | None:
    """The golden Gate B's lookup finds for `opts` (with no --golden) now, or None."""
    try:
        return find_golden(opts, GOLDEN_DIR)
    except GoldenError:
        return None


# The commands whose CUDA default is fp32 with bf16 experts (`gates.run.resolve`'s `exact`): the token-exact gates.
# `golden --source self` follows them, since it makes what Gate B's default looks up on CUDA (HF cannot make that
# golden: it holds one dtype, and the 48B model in fp32 needs two H200s); HF goldens stay bf16.
EXACT_COMMANDS = ("gate-a", "gate-b")


def exact_precision(command: str, source: str) -> bool:
    return command in EXACT_COMMANDS or (command == "golden" and source == "self")


CRASH_MESSAGE_CHARS = 600


def run_command(command: str, opts: Options) -> int:
    if command == "gate-a":
        from .gate_a import run_gate_a
        return run_gate_a(opts)
    if command == "gate-b":
        from .gate_b import run_gate_b
        return run_gate_b(opts)
    if command == "gate-memory":
        from .gate_memory import run_memory_gate
        return run_memory_gate(opts)
    return golden_command(opts)


def main(argv: list[str] | None = None) -> int:
    """The exit-code contract (docs/EXIT_CODES.md): 0 the gate holds, 1 it fails on valid inputs, 2 it could not
    judge. Anything that is not a verdict reached on valid inputs -- bad input, a refusal, a crash of any kind
    (a Rust panic in a library is a BaseException), records that cannot be written -- is 2."""
    args = parser().parse_args(argv)
    opts = None
    kind = RECORD_KINDS.get(args.command)
    try:
        source = getattr(args, "source", "hf")
        timeout_s = check_rank_timeout(getattr(args, "rank_timeout_s", DEFAULT_RANK_TIMEOUT_S))
        # the gates spread over ranks, the world following the box unless --world says; a golden runs in one process
        opts = resolve(preset=args.preset, model=args.model, dtype=args.dtype, device=args.device,
                       new_tokens=args.new_tokens, floor_gib=args.floor_gib, source=source,
                       golden=getattr(args, "golden", None), seed=args.seed, kernels=args.kernels,
                       expert_dtype=args.expert_dtype, exact=exact_precision(args.command, source),
                       world=getattr(args, "world", 1),
                       log=lambda line: None)  # a default world is said in the ranks' first line and recorded
        if args.command == "gate-b" and opts.golden is not None:
            check_golden_file(opts.golden)   # a mistyped path is an option error: refused before any record
        note = prompt_note(opts)
        if kind is not None:
            store.ensure_writable(kind)   # a run whose record cannot be kept is refused before it starts
        if note:
            print(note)
        limit_cpu_threads(opts)
        if opts.world > 1 and not (args.command == "gate-memory" and opts.device == "cpu"):
            return run_ranks(args.command, opts, timeout_s)
        if opts.world > 1:  # the memory gate skips on a CPU: no ranks to start for that
            print(first_line(args.command, opts))
        return run_command(args.command, opts)
    except store.RecordsUnwritable as e:
        print(f"error: {e}: the run cannot be recorded, so it gives no verdict", file=sys.stderr)
        return EXIT_REFUSED
    except RankFailed as e:  # a rank crashed, died or hung: its traceback, then the one line naming it, recorded
        if e.detail:
            print(e.detail.strip(), file=sys.stderr)
        try:
            return refused(kind, opts, str(e)[:CRASH_MESSAGE_CHARS])
        except store.RecordsUnwritable as unwritable:
            print(f"error: {e}; it could not be recorded: {unwritable}", file=sys.stderr)
            return EXIT_REFUSED
    except (ValueError, GateRefused, MemoryFloorError) as e:  # config, checkpoint, tokenizer, golden errors are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        traceback.print_exc()
        if opts is not None and kind is not None:   # the golden command makes no record to leave
            why = f"crashed: {type(e).__name__}: {e}"
            try:
                refused(kind, opts, why[:CRASH_MESSAGE_CHARS])
            except store.RecordsUnwritable as unwritable:
                print(f"error: the crash could not be recorded: {unwritable}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())

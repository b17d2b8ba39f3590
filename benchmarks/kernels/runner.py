"""The command line of the kernel benchmarks (`python -m benchmarks.kernels`): the ops, sizes and sweeps from the
registry; the vs-peer cases (one `kernel` record per op and size, then the summary), then the benches that write
their own records."""
from __future__ import annotations

import argparse
import traceback

import torch

import benchmarks.kernels as package
from benchmarks.cli import ints
from benchmarks.kernels.common import D, H, fmt_ms, judge_peer, kernel_record, load_fla
from benchmarks.kernels.registry import REGISTRY, DEFAULT_OPS, cases, size_options, studies, sweep_options
from benchmarks.kernels.spec import Bench
from benchmarks.timing import log

PROG = "python -m benchmarks.kernels"


def run_case(bench: Bench, n: int, peer, peer_missing: str | None, rep_ms: int, device: str = "cuda") -> dict:
    """One vs-peer record of `bench` at size n (batch n where its size_key is "B", else n tokens): its case's
    results, the peer's name where the case gave none, fla's version or why fla is missing (fla benches), the
    speedup and the check against `bench.tol` where the peer was timed. A case that raises is an INVALID record."""
    B, T = (n, 1) if bench.size_key == "B" else (1, n)
    params = {"op": bench.op, "B": B, "T": T, "H": H, "d": D, "dtype": "bfloat16"}
    params.update(bench.params())
    log(f"{bench.op} B={B} T={T} ...")
    try:
        results, reasons = bench.case(n, peer, rep_ms) if bench.fla else bench.case(n, rep_ms)
    except Exception as e:  # one failing shape must not end the run
        traceback.print_exc()
        results, reasons = {}, [f"{bench.op} failed: {type(e).__name__}: {e}"]
    results.setdefault("peer", bench.peer if bench.peer_if_failed is None else bench.peer_if_failed)
    if bench.fla:
        if peer is not None:
            results["peer_version"] = peer[2]
        if peer_missing:
            reasons.append(peer_missing)
    if "peer_ms" in results:
        judge_peer(results, reasons, bench.tol)
    elif not reasons:
        reasons.append("no peer time")
    rec = kernel_record(params, results, reasons, device)
    log(f"  {results}  {rec['verdict']} {reasons}")
    return rec


def summarize(recs: list[dict]) -> None:
    """A line per vs-peer record, then each bench's targets met or missed by every measure both sides have."""
    log("summary (GPU ms, do_bench median):")
    for r in recs:
        p, x = r["params"], r["results"]
        ours, theirs = x.get("ours_ms"), x.get("peer_ms")
        line = f"  {p['op']:16s} B={p['B']:<3d} T={p['T']:<6d} ours={fmt_ms(ours)}  {x.get('peer')}={fmt_ms(theirs)}"
        if "speedup" in x:
            line += f"  speedup={x['speedup']:.2f}x  rel_err={x['rel_err_vs_peer']:.2e}"
        log(line + f"  {r['verdict']}")
    for op, bench in REGISTRY.items():
        for key, n, cmp in bench.targets:
            x = next((r["results"] for r in recs
                      if r["params"]["op"] == op and r["params"][key] == n and "speedup" in r["results"]), None)
            if x is not None:
                for how, o, t in (("do_bench", "ours_ms", "peer_ms"), ("graph", "ours_graph_ms", "peer_graph_ms"),
                                  ("kernels", "ours_kernel_ms", "peer_kernel_ms")):
                    if o in x and t in x:
                        met = x[o] <= x[t] if cmp == "<=" else x[o] < x[t]
                        log(f"  target {op} {key}={n} ({how}): ours {x[o]:.4f} {cmp} {x['peer']} {x[t]:.4f} ms: "
                            f"{'MET' if met else 'MISSED'}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=package.__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS), help="comma-separated: " + ", ".join(REGISTRY))
    for size in size_options():
        ap.add_argument(size.flag, type=ints, default=size.default, help=size.help)
    for _, sweep in sweep_options():
        ap.add_argument(sweep.flag, action="store_true", help=sweep.help)
    ap.add_argument("--sweep-keys", type=lambda s: set(s.split(",")), default=None,
                    help="comma-separated config keys: the sweeps run only the configs that change nothing else")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - set(REGISTRY)
    if unknown or not ops:
        ap.error(f"--ops: {'unknown ' + str(sorted(unknown)) if unknown else 'names no op'}; the ops: "
                 f"{', '.join(sorted(REGISTRY))}")
    if args.rep_ms < 1:
        ap.error(f"--rep-ms must be >= 1, got {args.rep_ms}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{PROG} needs a CUDA device")
    peer, peer_missing = None, None
    if any(REGISTRY[op].fla for op in ops):
        peer, peer_missing = load_fla()
        log(f"peer: {f'fla {peer[2]}' if peer else peer_missing}")

    def swept(bench: Bench) -> bool:
        return bench.sweep is not None and bench.sweep.flag is not None and getattr(args, bench.sweep.dest)

    recs = []
    for group in cases():
        chosen = [b for b in group if b.op in ops]
        sizes = getattr(args, group[0].sizes.dest)
        recs += [run_case(b, n, peer, peer_missing, args.rep_ms) for n in sizes for b in chosen]
        for b in chosen:
            if swept(b):
                for n in sizes:
                    b.sweep.run(n, args.rep_ms, args.sweep_keys)
    summarize(recs)
    for b in studies():
        if b.op in ops:
            b.study(() if b.sizes.dest is None else getattr(args, b.sizes.dest), args.rep_ms, swept(b))

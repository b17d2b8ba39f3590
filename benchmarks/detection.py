"""Gate A's detection curve: which planted decode-path errors the gate catches, and that clean runs never trip it.

For each site of `gates.plant.SITES` (KDA step, MLA attention, MoE experts, norms) and each relative error, Gate A
runs with the error planted in the incremental path's decode steps; `--clean N` clean runs come first. Each run
appends one `detection` record (site, relative error, both criteria's verdicts, the largest logit difference, the
bound and the floor) and the curve is printed as a markdown table (docs/GATE_A.md keeps the measured ones).

    python -m benchmarks.detection                                 # tiny, CPU, PyTorch kernels
    python -m benchmarks.detection --kernels triton                # tiny, CPU, Triton's interpreter
    python -m benchmarks.detection --slice 4 --device cuda         # 4 layers of the 48B config at full width

`--slice N` keeps the first N layers of the 48B-A3B config (its 3:1 KDA:MLA pattern, the dense first layer, 256
experts) with synthetic weights, in fp32 with bf16 experts on CUDA, as the gates run the full model.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gates.gate_a import run_gate_a
from gates.plant import SITES, planted
from gates.run import Options, limit_cpu_threads, load_subject, resolve
from model.build import Loaded, from_state_dict, is_small
from model.config import KimiConfig, get_config
from model.weights import synthetic_weights, weights_id
from records import store
from records.exits import run_main

DEFAULT_RELS = (1e-1, 1e-2, 1e-3, 1e-4)


@dataclass(frozen=True)
class SliceOptions(Options):
    """Gate options for a model that is no preset: its config travels with the options."""
    cfg: KimiConfig | None = None

    @property
    def config(self) -> KimiConfig:
        return self.cfg

    @property
    def label(self) -> str:
        return self.cfg.name


def slice_config(layers: int) -> KimiConfig:
    """The first `layers` layers of the 48B-A3B config, full width."""
    big = get_config("48b-a3b")
    kda = tuple(i for i in big.kda_layers if i <= layers)
    mla = tuple(i for i in big.full_attn_layers if i <= layers)
    return big.replace(num_hidden_layers=layers, kda_layers=kda, full_attn_layers=mla, name=f"48b-a3b-slice{layers}")


def load_slice(opts: SliceOptions) -> Loaded:
    cfg, t0 = opts.cfg, time.perf_counter()
    state = synthetic_weights(cfg, seed=opts.seed, device="cpu" if is_small(cfg) else opts.device,
                              dtype=opts.torch_dtype, expert_dtype=opts.torch_expert_dtype)
    model = from_state_dict(cfg, {n: t.to(opts.device) for n, t in state.items()})
    del state
    if opts.device == "cuda":
        torch.cuda.empty_cache()
    return Loaded(model, cfg, f"synthetic:{cfg.name}:seed={opts.seed}", weights_id(model.state_dict(), cfg),
                  time.perf_counter() - t0)


def gate_once(opts: Options, subject: Loaded, site: str | None, rel: float | None) -> dict:
    """One Gate A run (planted or clean); its gate_a record goes to a scratch folder, the facts come back."""
    with tempfile.TemporaryDirectory(prefix="detection-") as tmp:
        lines: list[str] = []
        t0 = time.perf_counter()
        if site is None:
            code = run_gate_a(opts, subject=subject, records_root=tmp, log=lines.append)
        else:
            with planted(site, rel):
                code = run_gate_a(opts, subject=subject, records_root=tmp, log=lines.append)
        (rec,) = store.load("gate_a", root=tmp).records
    r = rec["results"]
    b = r["logit_bound"]
    return {"exit_code": code, "passed": r["passed"], "tokens_passed": r["tokens_passed"],
            "logits_passed": r["logits_passed"], "score": r["score"], "total": r["total"],
            "max_abs_logit_diff": r["max_abs_logit_diff_overall"], "bound": b["bound"], "floor": b["floor"],
            "enforced": b["enforced"], "summary": lines[-1].split(" [")[0], "seconds": time.perf_counter() - t0}


def verdict_cell(r: dict) -> str:
    if r["passed"]:
        return "missed"
    caught = [c for c, ok in (("tokens", r["tokens_passed"]), ("logits", r["logits_passed"])) if not ok]
    return f"caught ({' + '.join(caught)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.detection", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="synthetic-weights preset (tiny); ignored with --slice")
    ap.add_argument("--slice", type=int, metavar="N", help="the first N layers of the 48B-A3B config instead")
    ap.add_argument("--device", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", choices=("fp32", "fp64", "bf16"))
    ap.add_argument("--expert-dtype", choices=("fp32", "fp64", "bf16"))
    ap.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto")
    ap.add_argument("--sites", default=",".join(SITES), help=f"comma-separated subset of {', '.join(SITES)}")
    ap.add_argument("--rels", default=",".join(f"{r:g}" for r in DEFAULT_RELS), help="relative errors to plant")
    ap.add_argument("--clean", type=int, default=2, help="clean runs before the planted ones (2)")
    args = ap.parse_args(argv)
    sites = [s for s in args.sites.split(",") if s]
    unknown = sorted(set(sites) - set(SITES))
    try:
        rels = [float(r) for r in args.rels.split(",") if r]
    except ValueError:
        rels = []
    if unknown or not sites or not rels or not all(0 < r < 1 for r in rels) or not 0 <= args.clean <= 100 or (
            args.slice is not None and not 1 <= args.slice <= 27):
        print(f"error: --sites must name some of {', '.join(SITES)}{f' (unknown: {unknown})' if unknown else ''}; "
              f"--rels numbers in (0, 1); --clean in 0..100; --slice in 1..27", file=sys.stderr)
        return 2
    exact = args.dtype is None
    try:
        base = resolve(preset="48b-a3b" if args.slice else args.preset, device=args.device, dtype=args.dtype,
                       expert_dtype=args.expert_dtype, kernels=args.kernels, exact=exact,
                       reader=lambda: None, log=lambda m: None)
        store.ensure_writable("detection")
    except (ValueError, store.RecordsUnwritable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.slice:
        cfg = slice_config(args.slice)
        opts = SliceOptions(**{**base.__dict__, "preset": None}, cfg=cfg)
        subject = load_slice(opts)
    else:
        opts, subject = base, None
        limit_cpu_threads(opts)
        subject = load_subject(opts)
    if opts.kernels == "triton" and opts.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("error: --kernels triton on a CPU needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    model = {"label": opts.label, "config": subject.cfg.to_dict(), "weights": subject.weights}
    print(f"detection curve on {opts.label} ({subject.weights}) {opts.precision} {opts.device}, kernels {opts.kernels}")
    runs = [(None, None)] * args.clean + [(s, r) for s in sites for r in rels]
    rows: dict[str, dict[float, dict]] = {}
    cleans: list[dict] = []
    for site, rel in runs:
        r = gate_once(opts, subject, site, rel)
        if site is None:
            cleans.append(r)
        else:
            rows.setdefault(site, {})[rel] = r
        rec = store.make_record(
            "detection", preset=opts.label, dtype=str(opts.torch_dtype).removeprefix("torch."), device=opts.device,
            weights=subject.weights,
            params={"site": site, "rel": rel, "kernels": opts.kernels, "precision": opts.precision,
                    "new_tokens": opts.new_tokens, "model": model},
            results=r, verdict="VALID")
        path = store.append(rec)
        print(f"{site or 'clean':>13} {'' if rel is None else f'{rel:g}':>6}: {verdict_cell(r):<26} "
              f"max|dlogit| {r['max_abs_logit_diff']:.3g} ({r['max_abs_logit_diff'] / r['floor']:.3g}x floor), "
              f"bound {r['bound']:.3g} [record {rec['id']} in {Path(path).name}]", flush=True)
    print("\n| site | " + " | ".join(f"{r:g}" for r in rels) + " |")
    print("|---|" + "---|" * len(rels))
    for site in sites:
        cells = [f"{verdict_cell(rows[site][r])}, {rows[site][r]['max_abs_logit_diff'] / rows[site][r]['floor']:.3g}x"
                 for r in rels]
        print(f"| {site} | " + " | ".join(cells) + " |")
    if cleans:
        worst = max(c["max_abs_logit_diff"] / c["floor"] for c in cleans)
        print(f"\nclean runs: {sum(c['passed'] for c in cleans)} of {len(cleans)} passed; the largest logit difference "
              f"{worst:.3g}x the floor (the bound is {cleans[0]['bound'] / cleans[0]['floor']:.3g}x)")
    return 0 if all(c["passed"] for c in cleans) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, kinds=("detection",)))

"""How much of a narrow dtype's logit noise comes from expert choices that its rounding flips.

For each prompt of the battery: the greedy continuation in fp32 (the recompute path), then one teacher-forced
forward over the prompt and that continuation in fp32 and two in the narrow dtype: one whose routers choose as
they will, and one with every MoE layer's experts pinned to the fp32 forward's choices (their weights from the
narrow run's own scores). What pinning removes from the narrow run's difference to fp32 is what the flipped
choices put there. Also measured: how often a choice flips, and the fp32 gap at each router's top-k boundary (the
k-th biased score less the (k+1)-th), which rounding must cross to flip it. One `routing_noise` record a run.

    python -m benchmarks.routing_noise                          # the reference checkpoint, bf16, on the CPU
    python -m benchmarks.routing_noise --preset tiny --device cuda

docs/REFERENCE.md#where-the-bf16-noise-comes-from keeps the measured results.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from gates.prompts import battery
from gates.run import default_cpu_model
from model import ops
from model.build import load_model
from model.generate import generate_recompute
from model.layers import Router
from records import store
from records.exits import run_main

NARROW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GAP_QUANTILES = (0.1, 0.5, 0.9)
GAP_THRESHOLD = 0.01  # a boundary gap counted as crowded


class RoutingTap:
    """Forward hooks on every router of a model. In `record` mode each call's chosen experts are kept, by router
    name, in call order; in `pin` mode each call's choice is replaced by the one recorded for the same router and
    call (weights from this call's own scores), and the rows whose chosen set differed are counted."""

    def __init__(self, model: torch.nn.Module):
        self.mode, self.chosen, self.calls = None, {}, {}
        self.rows = self.flips = 0
        self.gaps: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()
                        if isinstance(m, Router)]

    def start(self, mode: str | None, chosen: dict | None = None) -> None:
        """Begin a forward in `mode`; `chosen`: the recorded choices to compare with or pin to (another tap's)."""
        self.mode, self.calls, self.rows, self.flips = mode, {}, 0, 0
        if mode == "record":
            self.chosen = {}
        elif chosen is not None:
            self.chosen = chosen

    def stop(self) -> None:
        """Let the router calls that follow pass untouched; the counts of the last forward stay."""
        self.mode = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, name: str):
        def hook(router: Router, args, out):
            if self.mode is None:
                return None
            idx, w = out
            if self.mode == "record":
                self.chosen.setdefault(name, []).append(idx)
                self.gaps.append(boundary_gaps(router, args[0]))
                return None
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            ref = self.chosen[name][call]
            self.rows += idx.shape[0]
            self.flips += int((idx.sort(-1).values != ref.sort(-1).values).any(-1).sum())
            if self.mode == "pin":
                scores = torch.sigmoid(F.linear(args[0].float(), router.weight.float()))
                return ref, ops.route_weights(scores, ref, router.scaling, router.renorm)
            return None
        return hook


def boundary_gaps(router: Router, x: torch.Tensor) -> torch.Tensor:
    """Per token, the k-th largest biased score less the (k+1)-th: how far rounding must move the scores to swap
    an expert in or out."""
    scores = torch.sigmoid(F.linear(x.float(), router.weight.float())) + router.e_score_correction_bias.float()
    top = scores.topk(router.top_k + 1, dim=-1).values
    return (top[:, -2] - top[:, -1]).cpu()


def margin_change(test: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per step, how far `test` moves the gap between the reference's top two logits (nats)."""
    top2 = ref.topk(2, dim=-1).indices
    gap = lambda l: l.gather(-1, top2[:, :1]) - l.gather(-1, top2[:, 1:])  # noqa: E731
    return (gap(test) - gap(ref)).abs().squeeze(-1)


def measure(wide, narrow, ids: list[int], new_tokens: int, tap_wide: RoutingTap, tap_narrow: RoutingTap) -> dict:
    """One prompt: the fp32 greedy continuation, then the three teacher-forced forwards over it."""
    gen = generate_recompute(wide, ids, new_tokens)
    seq = torch.tensor(ids + gen.tokens[:-1], device=wide.device)[None]
    steps = slice(len(ids) - 1, None)  # the positions whose logits chose the continuation
    with torch.no_grad():
        tap_wide.start("record")
        ref = wide.forward(seq)[0, steps].float()
        tap_wide.stop()
        out = {}
        for mode in ("free", "pin"):
            tap_narrow.start(mode, tap_wide.chosen)
            logits = narrow.forward(seq)[0, steps].float()
            tap_narrow.stop()
            out[mode] = dict(max_abs_logit_diff=float((logits - ref).abs().max()),
                             max_margin_change=float(margin_change(logits, ref).max()),
                             agree=int((logits.argmax(-1) == ref.argmax(-1)).sum()),
                             rows=tap_narrow.rows, flips=tap_narrow.flips)
    return {"steps": new_tokens, "decisions": out["free"]["rows"], "flips": out["free"]["flips"],
            **{f"{k}_{mode}": out[mode][k] for mode in out for k in ("max_abs_logit_diff", "max_margin_change",
                                                                       "agree")}}


def summarise(rows: list[dict], gaps: torch.Tensor) -> dict:
    tot = lambda k: sum(r[k] for r in rows)  # noqa: E731
    worst = lambda k: max(r[k] for r in rows)  # noqa: E731
    return {
        "prompts": rows, "steps": tot("steps"), "decisions": tot("decisions"), "flips": tot("flips"),
        "flip_fraction": tot("flips") / max(tot("decisions"), 1),
        **{k: worst(k) for k in ("max_abs_logit_diff_free", "max_abs_logit_diff_pin", "max_margin_change_free",
                                 "max_margin_change_pin")},
        "agree_free": tot("agree_free"), "agree_pin": tot("agree_pin"),
        "gap_quantiles": {f"p{int(q * 100)}": float(gaps.quantile(q)) for q in GAP_QUANTILES},
        "gap_threshold": GAP_THRESHOLD, "frac_gap_below": float((gaps < GAP_THRESHOLD).float().mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.routing_noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="original-format checkpoint directory (default: the reference checkpoint)")
    ap.add_argument("--preset", help="synthetic-weights preset instead of a checkpoint")
    ap.add_argument("--dtype", choices=tuple(NARROW), default="bf16", help="the narrow dtype (bf16)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    model_dir = None if args.preset else (args.model or default_cpu_model())
    if (args.preset and args.model) or (args.preset is None and model_dir is None) or args.new_tokens < 1:
        print("error: give --preset or --model, not both (the default model is missing from this checkout), and "
              "--new-tokens >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    src = dict(preset=args.preset) if args.preset else dict(checkpoint=model_dir)
    wide = load_model(**src, device=args.device, dtype=torch.float32)
    narrow = load_model(**src, device=args.device, dtype=NARROW[args.dtype])
    if wide.cfg.num_experts < 2:
        print(f"error: {wide.cfg.name} has no routed experts to flip", file=sys.stderr)
        return 2
    bat = battery(wide.cfg, model_dir)
    label = Path(model_dir).name if model_dir else args.preset
    print(f"routing noise on {label} ({wide.weights}): {args.dtype} against fp32 on {args.device}, "
          f"{len(bat.ids)} prompts x {args.new_tokens} steps")
    tap_wide, tap_narrow = RoutingTap(wide.model), RoutingTap(narrow.model)
    try:
        rows = [measure(wide.model, narrow.model, ids, args.new_tokens, tap_wide, tap_narrow) for ids in bat.ids]
    finally:
        tap_wide.close(), tap_narrow.close()
    res = summarise(rows, torch.cat(tap_wide.gaps))
    print("prompt  flips/decisions  max|dlogit| free  pinned  max|dmargin| free  pinned  argmax agree free  pinned")
    for i, r in enumerate(rows):
        print(f"{i:>6}  {r['flips']:>6}/{r['decisions']:<8} {r['max_abs_logit_diff_free']:>16.3g}  "
              f"{r['max_abs_logit_diff_pin']:>6.3g}  {r['max_margin_change_free']:>17.3g}  "
              f"{r['max_margin_change_pin']:>6.3g}  {r['agree_free']:>11}/{r['steps']:<6} {r['agree_pin']}/{r['steps']}")
    q = res["gap_quantiles"]
    print(f"flipped: {res['flips']} of {res['decisions']} expert choices ({res['flip_fraction']:.1%}); pinning them "
          f"takes max|dlogit| from {res['max_abs_logit_diff_free']:.3g} to {res['max_abs_logit_diff_pin']:.3g} nats; "
          f"fp32 top-k boundary gap p10/p50/p90 {q['p10']:.3g}/{q['p50']:.3g}/{q['p90']:.3g}, "
          f"{res['frac_gap_below']:.0%} below {GAP_THRESHOLD:g}")
    rec = store.make_record(
        "routing_noise", preset=label, dtype=args.dtype, device=args.device, weights=wide.weights,
        params={"model": model_dir, "preset": args.preset, "new_tokens": args.new_tokens, "prompts": len(bat.ids),
                "prompt_ids_source": bat.source, "reference_dtype": "fp32", "kernels": ops.kernels_setting()},
        results=res)
    path = store.append(rec)
    print(f"[record {rec['id']} in {Path(path).name}]")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, kinds=("routing_noise",)))

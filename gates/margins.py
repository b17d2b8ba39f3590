"""The greedy margins of a golden: at every prompt and step, the top-1 minus the top-2 log-probability (nats) of the
distribution the golden's greedy token was chosen from.

    python -m gates.margins GOLDEN...

A margin under the near-tie epsilon of a precision (`gates.compare.NEAR_TIE_EPS`: 2^-3 nats in bf16, 1e-4 in fp32
and fp64; a golden keeps no logits, so the gates' wider bf16 epsilon above a top logit of 16 is not applied here) is
a step where two correct implementations in that precision may choose different tokens; how many steps
of the battery lie under it says whether a model can agree with a golden token for token in that precision at all.
Each golden is read and validated (`gates.golden.load_golden`) and gives one `margins` record: the margins per prompt
and step, their median, minimum, maximum and exact ties, and the fraction under each epsilon. Every golden is read
before any record is appended, so a bad one leaves none. Exit status: 0 recorded, 2 a golden or the records file
that cannot be used (one line naming it).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from records import store
from records.exits import EXIT_OK, run_main

from .compare import NEAR_TIE_EPS
from .golden import GoldenError, load_golden
from .run import DTYPES

KIND = "margins"
BF16_EPS, FP32_EPS = NEAR_TIE_EPS[torch.bfloat16], NEAR_TIE_EPS[torch.float32]


def step_margins(g: dict) -> list[list[float]]:
    """[prompt][step]: top-1 minus top-2 log-probability of a validated golden (its log-probs are in descending
    order, so every margin is >= 0; an exact tie is 0)."""
    return [[lp[0] - lp[1] for lp in p["topk_logprobs"]] for p in g["prompts"]]


def summary(margins: list[list[float]]) -> dict:
    flat = [m for row in margins for m in row]
    below = lambda eps: sum(m < eps for m in flat) / len(flat)
    return {"n": len(flat), "median": statistics.median(flat), "min": min(flat), "max": max(flat),
            "zeros": sum(m == 0 for m in flat), "bf16_eps": BF16_EPS, "frac_below_bf16_eps": below(BF16_EPS),
            "fp32_eps": FP32_EPS, "frac_below_fp32_eps": below(FP32_EPS)}


def margins_record(g: dict, path: Path) -> dict:
    """The `margins` record of golden `g` (validated), read from `path`."""
    prov = g["provenance"]
    margins = step_margins(g)
    params = {"golden": store.shown_path(path), "golden_md5": g["md5"], "label": g.get("label") or g.get("preset"),
              "source": g["source"], "implementation": prov["implementation"], "golden_dtype": g["dtype"],
              "golden_device": g["device"], "device_name": prov["device_name"], "golden_time": prov["time"],
              "golden_commit": prov.get("git_commit"), "prompt_ids_source": g.get("prompt_ids_source"),
              "prompts": len(g["prompts"]), "new_tokens": g["new_tokens"],
              "topk": min(len(t) for p in g["prompts"] for t in p["topk_ids"])}
    return store.make_record(KIND, preset=params["label"], dtype=str(DTYPES[g["dtype"]]).removeprefix("torch."),
                             device=g["device"], weights=g["weights"], params=params,
                             results={"margins": margins, **summary(margins)})


def record_goldens(paths: list[Path], root=None, log=print) -> list[dict]:
    """Read and validate every golden, then append one record each; nothing is appended where any is refused."""
    records = [margins_record(load_golden(p), p) for p in paths]
    for rec in records:
        store.line_of(rec)
    for rec in records:
        where = store.append(rec, root)
        s, p = rec["results"], rec["params"]
        log(f"{p['label']} {p['golden_dtype']} {p['golden_device']} {p['source']}: {s['n']} margins, median "
            f"{s['median']:.3g} nats, {s['zeros']} exact ties, {s['frac_below_bf16_eps']:.1%} under the bf16 eps "
            f"{BF16_EPS:g}, {s['frac_below_fp32_eps']:.1%} under {FP32_EPS:g} [record {rec['id'][:8]} in {where}]")
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gates.margins", description=__doc__.split("\n\n")[0])
    ap.add_argument("goldens", nargs="+", type=Path, metavar="GOLDEN", help="golden files (gates/goldens/*.json)")
    a = ap.parse_args(argv)

    def go() -> int:
        try:
            record_goldens(a.goldens)
        except (GoldenError, store.RecordError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return EXIT_OK
    return run_main(go, kinds=(KIND,))


if __name__ == "__main__":
    sys.exit(main())

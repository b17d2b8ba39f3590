"""Argument types shared by the benchmark command lines."""
from __future__ import annotations

import argparse


def ints(text: str) -> tuple[int, ...]:
    """'1,8,64' -> (1, 8, 64): comma-separated positive integers (lengths, batches, token counts), or a clear
    argparse error."""
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return vals

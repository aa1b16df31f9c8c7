"""The benchmarks' argument types: each flag a bounded, finite number (or a checked list), so a
hostile value is one line from argparse (exit 2), never a traceback deep in a run, a hang (a NaN
duration) or a run far beyond the machine (a million processes or partitions)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi] (ASCII digits only: int() refuses what str.isdigit() takes, '²')."""

    def parse(text: str) -> int:
        t = text.strip()
        if not (t.lstrip("+-").isascii() and t.lstrip("+-").isdigit()):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        v = int(t)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer in [{lo}, {hi}]")
        return v

    return parse


def number(lo: float, hi: float, step: float | None = None) -> Callable[[str], float]:
    """A finite number in (lo, hi] (NaN and inf refused); with ``step``, a whole multiple of it."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(v) and lo < v <= hi):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number in ({lo:g}, {hi:g}]")
        if step is not None and abs(v / step - round(v / step)) > 1e-9:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole multiple of {step:g}")
        return v

    return parse


def counts(lo: int, hi: int, most: int) -> Callable[[str], list[int]]:
    """Distinct integers in [lo, hi] separated by commas, at most ``most`` of them."""
    one = count(lo, hi)

    def parse(text: str) -> list[int]:
        parts = text.split(",")
        if len(parts) > most:
            raise argparse.ArgumentTypeError(f"at most {most} values (got {len(parts)})")
        out = [one(p) for p in parts]
        if len(set(out)) != len(out):
            raise argparse.ArgumentTypeError(f"distinct counts separated by commas (got {text!r})")
        return out

    return parse


def policies(text: str) -> list[str]:
    """What-if policies separated by commas, each parsed (rules/whatif_model.py parse_policy),
    or ``recorded`` (bench whatif's replay of its record)."""
    from gpuslo.rules.whatif import PolicyError, parse_policy

    out = [p.strip() for p in text.split(",")]
    if len(out) > 32:
        raise argparse.ArgumentTypeError(f"at most 32 policies (got {len(out)})")
    for p in out:
        if p == "recorded":
            continue
        try:
            parse_policy(p)
        except PolicyError as exc:
            raise argparse.ArgumentTypeError(str(exc)[:300]) from None
    return out

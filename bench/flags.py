"""argparse types of ``loraplex bench``'s flags (light: cli.py imports this for every command)."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (each >= 1)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1, e.g. 1,2,4,8")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: percentiles lie in (0, 100]")
    return values


def length_range(text: str) -> tuple[int, int]:
    """``"32"`` -> (32, 32); ``"16:64"`` -> (16, 64), uniform in between."""
    lo, _, hi = text.partition(":")
    try:
        span = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or LO:HI tokens") from None
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return span

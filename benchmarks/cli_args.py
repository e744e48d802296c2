"""argparse types and checks the benchmarks' command lines share: a bad value is one
line from argparse (exit 2), not a traceback or a silently changed run."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def positive_int(text: str) -> int:
    """An int of 1 or more (a size, a count of steps or cases)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An int of 0 or more (a seed, warm-up steps)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is below {low}")
    return value


def check_names(parser: argparse.ArgumentParser, flag: str, given: Iterable[str],
                accepted: Iterable[str]) -> None:
    """Exit through ``parser.error`` naming the first of ``given`` not ``accepted``."""
    accepted = list(accepted)
    unknown = [name for name in given if name not in accepted]
    if unknown:
        parser.error(f"{flag}: unknown {unknown[0]!r}; accepted: {', '.join(accepted)}")

"""argparse types and checks the benchmarks' command lines share: a bad value is one
line from argparse (exit 2), not a traceback or a silently changed run."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def positive_int(text: str) -> int:
    """An int of 1 or more (a size, a count of steps or cases)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An int of 0 or more (a seed, warm-up steps)."""
    return _int_at_least(text, 0)


def int_at_least(low: int) -> Callable[[str], int]:
    """The type of an int of ``low`` or more, for a bound other than 0 or 1."""
    def parse(text: str) -> int:
        return _int_at_least(text, low)
    return parse


def comma_names(text: str) -> str:
    """A comma-separated list naming at least one thing, kept as written: ``,`` would
    run nothing and then rewrite the results without their sections."""
    if not any(name.strip() for name in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} names nothing")
    return text


def split_names(text: str) -> list[str]:
    """The names of a ``comma_names`` list, blanks dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


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


def check_out_dir(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """Exit through ``parser.error`` when ``path`` cannot be made a directory (it or a
    folder above it is a file) or written (the nearest folder that exists takes no new
    file): found up front, not by a ``mkdir`` after the whole run."""
    blocking = blocking_file(path)
    if blocking == path:
        parser.error(f"{flag} {path} exists and is not a directory")
    if blocking is not None:
        parser.error(f"{flag} {path}: {blocking} exists and is not a directory")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    try:  # a file made and dropped: access() says yes to root on a read-only mount
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as problem:
        parser.error(f"{flag} {path}: {existing} is not writable ({problem.strerror})")


def check_out_file(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """Exit through ``parser.error`` when ``path`` cannot be written as a file (it is a
    directory, or a folder above it is a file), before the run rather than after it."""
    if path.is_dir():
        parser.error(f"{flag} {path} is a directory, not a file")
    blocking = _not_a_directory(path.parents)
    if blocking is not None:
        parser.error(f"{flag} {path}: {blocking} exists and is not a directory")


def blocking_file(path: Path) -> Path | None:
    """The file that keeps ``path`` from being a directory: ``path`` itself or a folder
    above it that exists and is no directory; None where there is none."""
    return _not_a_directory([path, *path.parents])


def _not_a_directory(paths: Iterable[Path]) -> Path | None:
    """The first of ``paths`` that exists, when it is not a directory; else None."""
    for path in paths:
        if path.exists():  # False for a path under a file (ENOTDIR)
            return None if path.is_dir() else path
    return None

"""argparse types and environment defaults the commands share (argparse names the flag in its error)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ..emulator.cli import port_number

EXIT_CANNOT_START = 2  # argparse's own usage errors exit 2 as well


def env_port(name: str) -> int | None:
    """A port flag's default from the environment variable ``name`` (none if unset or empty)."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return port_number(text)
    except argparse.ArgumentTypeError as exc:
        print(f"binbatch: ${name}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CANNOT_START) from None


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (v > 0 and v < 86400):
        raise argparse.ArgumentTypeError(f"must be > 0 and < 86400, got {text}")
    return v


def load_fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of direct capacity, got {text!r}") from None
    if not (v > 0 and v <= 10):
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 10, got {text}")
    return v


def share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def cpu_list(text: str) -> frozenset[int]:
    """CPU numbers, comma-separated (``1`` or ``2,3``)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected CPU numbers separated by commas (e.g. 1 or 2,3), got {text!r}")
    return frozenset(int(p) for p in parts)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {v}")
        return v

    return parse


_UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2}


def byte_size(text: str) -> int:
    """A size in bytes: ``4194304``, ``4MiB``, ``256KiB`` (64 KiB to 64 MiB, as server.maxRequestBytes)."""
    number = text.rstrip("KMiB")
    unit = text[len(number):]
    if unit not in _UNITS or not number.isdigit():
        raise argparse.ArgumentTypeError(f"expected bytes, or a whole number with KiB or MiB, got {text!r}")
    v = int(number) * _UNITS[unit]
    if not 65_536 <= v <= 67_108_864:
        raise argparse.ArgumentTypeError(f"must be 64KiB to 64MiB (server.maxRequestBytes' range), got {text}")
    return v

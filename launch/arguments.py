"""argparse types shared by the subcommands: a bad value is argparse's one-line usage error, named after the flag."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (rank, worker and node counts, steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value

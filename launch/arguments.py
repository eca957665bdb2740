"""argparse pieces shared by the subcommands: the parser class whose mistakes are one line, and the types that
refuse a bad value (zero, negative, huge, not a number, a missing path, a directory for a file) naming the flag.

Every option of every subcommand uses one of these types or states why it needs none; tests/test_cli_sweep.py
runs each option with its bad values and holds every command to exit 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, `error: ...` like every other loom error (exit 2), pointing
    to --help instead of printing the usage block."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)  # for error's hint: what the user wrote
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        missing = re.fullmatch(r"argument (?:\S+/)?(\S+): expected one argument", message)
        given = getattr(self, "_given", [])
        if missing and any(
            flag == missing.group(1) and value.startswith("-") for flag, value in zip(given, given[1:], strict=False)
        ):  # argparse took the value for a flag: a file named -x, a negative number
            message += f"; a value that starts with '-' is written {missing.group(1)}=VALUE"
        told = []
        if message.startswith(("unrecognized arguments", "the following arguments are required")):
            told = self._answers_in_loom_terms(given)
        listed = len(told) > 2  # a pasted script: a line each, as for a config file
        if not listed:
            message += "".join(f"; {answer.clause()}" for answer in told)
        if message.startswith("unrecognized arguments") and self.get_default("takes_overrides"):
            message += "; config overrides look like --train.steps 50"
        message += f" (see {self.prog} --help)"
        if listed:
            message += "; loom's names for them:\n" + "\n".join(answer.line() for answer in told)
            engines = sorted({answer.engine for answer in told if answer.engine})
            if engines:  # a script names only what differs from its engine's defaults, some of which loom's do not
                message += f"\n  (where {' and '.join(engines)}'s defaults differ from loom's: docs/config.md, its end)"
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(2)

    def _answers_in_loom_terms(self, given: list[str]) -> list:
        """What the flags this parser does not take are called in loom, where they are another engine's names
        (Megatron-LM's, torchtitan's) or loom fields written without their section."""
        from loom.engine.config_io import names_a_field
        from loom.engine.names_elsewhere import TRAINING_NAMES, answers, flags_and_values

        takes_config = bool(self.get_default("takes_overrides"))
        names = self.get_default("names_elsewhere") or (TRAINING_NAMES if takes_config else ())
        foreign = [  # (a config override is this command's too: not restated as another engine's name)
            (f, v)
            for f, v in flags_and_values(given)
            if f not in self._option_string_actions and not (takes_config and names_a_field(f))
        ]
        return answers(foreign, names, loom_fields=takes_config) if names else []


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high]: counts of ranks, workers, steps, samples. `high` bounds what would otherwise
    start a million processes or fill the disk before failing."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,}, got {value:,}")
        return value

    parse.__name__ = "int"
    return parse


positive_int = int_in(1)
"""An integer >= 1 with no upper bound of its own (the config's validation bounds what follows from it)."""

non_negative_int = int_in(0)


def float_in(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """A finite number in the interval (low or [low, high] or high), e.g. a probability (0, 1]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if not math.isfinite(value) or too_low or too_high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"must lie in {interval}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def existing_file(text: str) -> str:
    """A path to a file that exists (not a directory)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def existing_dir(text: str) -> str:
    """A path to a directory that exists."""
    path = Path(text)
    if path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def existing_path(text: str) -> str:
    """A file or directory that exists (a checkpoint may be named by its iteration, checkpoints/ or run folder)."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def _writable_place(path: Path, text: str) -> None:
    """Refuse a path below a file: it can never be created. (Permissions are the command's to report.)"""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{text} cannot be created: {parent} is a file")
            return


def output_file(text: str) -> str:
    """A file to write: not a directory, and not below a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    _writable_place(path, text)
    return text


def output_dir(text: str) -> str:
    """A directory to write into (created if missing): not a file, and not below a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory")
    _writable_place(path, text)
    return text


def output_prefix(text: str) -> str:
    """A prefix P of files P.bin, P.idx, ...: its folder may be created, but P itself must not be a folder."""
    path = Path(text)
    if path.is_dir() or text.endswith(("/", "\\")):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a prefix such as {path / 'data'}")
    _writable_place(path, text)
    return text


OLDER = " (the spelling after the comma is the older one, still accepted)"
"""Said in the help of an option that keeps an older spelling as its second name."""


def add_parallel_size(parser: argparse.ArgumentParser, size: str, help: str, older: bool = True, **kwargs) -> None:
    """--parallel.<size> (tp, pp, vp: the config's spelling, one per idea across commands), stored as `size`;
    `older` keeps the command's earlier --<size> working, said in the help."""
    names = [f"--parallel.{size}"] + ([f"--{size}"] if older else [])
    parser.add_argument(*names, dest=size, type=int_in(1, 1024), help=help + (OLDER if older else ""), **kwargs)


IMAGE_SUFFIXES = (".png", ".pdf", ".svg")


def image_file(text: str) -> str:
    """A chart to write: a file name ending in .png, .pdf or .svg (matplotlib picks the format from it)."""
    if Path(text).suffix.lower() not in IMAGE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text}: give a file name ending in {', '.join(IMAGE_SUFFIXES)}")
    return output_file(text)


def dataset_prefix(text: str) -> str:
    """The prefix P of an indexed dataset P.bin + P.idx that exists."""
    for suffix in (".idx", ".bin"):
        path = Path(text + suffix)
        if not path.is_file():
            hint = " (give the prefix, without .bin/.idx)" if text.endswith((".bin", ".idx")) else ""
            from loom.engine.data.indexed import other_naming_hint

            hint = hint or other_naming_hint(text)
            raise argparse.ArgumentTypeError(f"{path} does not exist{hint}")
    return text


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63)."""
    return int_in(0, 2**63 - 1)(text)


def text_value(text: str) -> str:
    """A name or key that must not be empty (a JSON key, a special token)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text

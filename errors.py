"""The one base class for mistakes a user can fix, shared by every subpackage.

A `LoomError` is about the user's input, data, config or environment, and its message says what is
wrong and what to do: the CLI prints it as one line (exit 2), and a launcher reporting a failed rank
prints just that line. Anything else raised in a rank is a bug in loom (or in a library under it)
and is reported with its traceback, rank and host, so it is never mistaken for the user's mistake.
Each layer subclasses it where it owns the failure (ConfigError, CheckpointError, InputError, ...).
"""

from __future__ import annotations


class LoomError(Exception):
    """A problem the user can fix, described in one line: what is wrong and what to do."""


class TrainingDiverged(LoomError):
    """The loss or gradient norm became NaN/Inf and train.nan_policy says to stop."""


def is_user_error(error: BaseException) -> bool:
    """Whether `error` is the user's to fix (reported in one line) rather than a bug (reported with a traceback)."""
    return isinstance(error, (LoomError, FileNotFoundError, PermissionError))

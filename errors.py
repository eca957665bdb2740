"""The one base class for mistakes a user can fix, shared by every subpackage.

A `LoomError` is about the user's input, data, config or environment, and its message says what is
wrong and what to do: the CLI prints it as one line (exit 2), and a launcher reporting a failed rank
prints just that line. Anything else raised in a rank is a bug in loom (or in a library under it)
and is reported with its traceback, rank and host, so it is never mistaken for the user's mistake.
Each layer subclasses it where it owns the failure (ConfigError, CheckpointError, InputError, ...).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class LoomError(Exception):
    """A problem the user can fix, described in one line: what is wrong and what to do."""


class Interrupted(Exception):
    """A signal asked the process to stop (the launchers' `Stopped`): never a failure to report and go on from,
    as a benchmark does with a row that raises."""


class TrainingDiverged(LoomError):
    """The loss or gradient norm became NaN/Inf and train.nan_policy says to stop."""


# What the file system says about the user's paths and disks: a missing or unwritable place, a file where a
# folder was meant (or the other way round), a full or read-only disk. Other OSErrors stay bugs.
_USER_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENOTEMPTY,
    errno.EROFS,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.ENAMETOOLONG,
    errno.ELOOP,
}


def is_user_error(error: BaseException) -> bool:
    """Whether `error` is the user's to fix (reported in one line) rather than a bug (reported with a traceback)."""
    if isinstance(error, (LoomError, FileNotFoundError, PermissionError)):
        return True
    return isinstance(error, OSError) and error.errno in _USER_ERRNOS


def user_message(error: BaseException) -> str:
    """The one line a user error is reported as: its own message, or for the file system's errors the path
    and what is wrong with it."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        hint = {
            errno.ENOSPC: "; free some space, or write elsewhere",
            errno.EDQUOT: "; free some space, or write elsewhere",
            errno.EROFS: "; write elsewhere",
        }.get(error.errno, "")
        return f"{error.filename}: {error.strerror}{hint}"
    return str(error)


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError raised inside without a file name (a write or flush of a file opened earlier: metrics.jsonl, the
    run's lock, TensorBoard's event file) gets `path`, so that it is reported as `path: No space left on device;
    free some space, or write elsewhere` instead of `[Errno 28] No space left on device`."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or not error.strerror:
            raise
        raise type(error)(error.errno, error.strerror, str(path)) from error

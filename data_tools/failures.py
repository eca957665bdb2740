"""One-line reports for the ways a data command fails on its output side: a full disk, a read-only
or forbidden output, a dead worker.

A command wraps its work in `reported_failures(output, needed_bytes)`. Its own cleanup (staging
folder, temporary files, outputs it already moved into place) runs inside, first; what escapes is
turned into one LoomError line that says what happened, how much room the output needs and that
nothing was written. Without this, Python prints two or three chained tracebacks (the write fails,
then the close that flushes, then the cleanup). This module must not know what any command writes.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from loom.data_tools.parallel import WorkerDied
from loom.errors import LoomError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_PERMITTED = (errno.EACCES, errno.EPERM)


class OutputError(LoomError):
    """The output cannot be written (no space left, read-only, not permitted); the message says where."""


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system that holds (or would hold) `path`."""
    path = _existing_ancestor(Path(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _megabytes(nbytes: int) -> str:
    """Whole MB, one decimal below 10 MB, two below 0.1 MB (a tiny free space should not read as 0)."""
    if nbytes >= 10e6:
        return str(math.ceil(nbytes / 1e6))
    return f"{nbytes / 1e6:.2f}" if nbytes < 1e5 else f"{nbytes / 1e6:.1f}"


def _is_under(filename: str | bytes | None, output: Path) -> bool:
    """Whether an error's file is the output, inside it, or beside it (temporary siblings of a file output)."""
    if not filename:
        return False
    where = Path(os.fsdecode(filename)).absolute()
    output = output.absolute()
    return where == output or output in where.parents or where.parent == output.parent


def no_space_message(output: Path, needed_bytes: int) -> str:
    mount = mount_point(output)
    free = shutil.disk_usage(_existing_ancestor(output)).free
    return (
        f"no space left on {mount} for {output}: about {_megabytes(needed_bytes)} MB needed, "
        f"{_megabytes(free)} MB free; nothing was written (free some space or write the output elsewhere)"
    )


def _reported(error: BaseException, output: Path, needed_bytes: int | Callable[[], int]) -> LoomError | None:
    """The one-line error that replaces `error`, or None when it is not about the output."""
    if isinstance(error, WorkerDied):
        return WorkerDied(f"{error}; nothing was written to {output}")
    if not isinstance(error, OSError):
        return None
    if error.errno in _NO_SPACE:
        return OutputError(no_space_message(output, needed_bytes() if callable(needed_bytes) else needed_bytes))
    if error.errno == errno.EROFS:
        return OutputError(
            f"{output} is read-only ({mount_point(output)} is mounted read-only); write the output elsewhere"
        )
    if error.errno in _NOT_PERMITTED and _is_under(error.filename, output):
        return OutputError(
            f"{output} is not writable (permission denied on {os.fsdecode(error.filename)}); "
            f"write the output elsewhere or fix its permissions"
        )
    return None


@contextmanager
def reported_failures(output: str | Path, needed_bytes: int | Callable[[], int]) -> Iterator[None]:
    """Turn a full disk, a read-only or forbidden output and a dead worker into one-line errors about `output`.

    needed_bytes: the command's estimate of what the output (and its staging) takes, for the message; a
    callable is asked only when the disk is full (an estimate from what was measured so far)."""
    output = Path(output)
    created = not output.exists()
    try:
        yield
    except BaseException as error:
        if created:
            with suppress(OSError):
                output.rmdir()  # a folder output this run created, if the command's cleanup left it empty
        reported = _reported(error, output, needed_bytes)
        if reported is None:
            raise
        raise reported from error  # the cause stays visible under LOOM_DEBUG=1

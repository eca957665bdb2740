"""One training run at a time per run directory, one writer at a time per data or checkpoint command's output.

Two runs in one directory write over each other's metrics and checkpoints (a job submitted twice, a
`loom train` started while its Slurm job still runs). Rank 0 of a training run holds an exclusive
`flock` on RUN_DIR/.loom-run.lock for as long as it lives, with who holds it written inside; the kernel
drops the lock when the process ends however it ends, so there is never a stale lock to clean up.
Launchers probe the lock before they change anything in the directory.

Two data commands writing one output (two builds of one prefix, a clean --overwrite beside a running clean), or
two checkpoint tools writing one folder, would rename their temporary files over each other's and clean up each
other's staging; each holds a lock beside its output (`.NAME.loom-lock`) while it writes, removed when it is done.

On a filesystem without file locks (Lustre mounted without `flock`) nothing is detected, and rank 0 says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from loom.engine.config import ConfigError
from loom.errors import naming

LOCK_FILE = ".loom-run.lock"
_HELD = (errno.EAGAIN, errno.EACCES)  # what flock's non-blocking refusal raises (EWOULDBLOCK is EAGAIN)


class RunDirectoryInUse(ConfigError):
    """Another live process holds the run directory's lock."""


def _holder(lock: Path) -> str:
    for _ in range(20):  # a holder writes who it is just after it takes the lock
        with contextlib.suppress(OSError):
            if lock.stat().st_size:
                break
        time.sleep(0.05)
    try:
        record = json.loads(lock.read_text())
        job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
        who = f"pid {record['pid']} on {record['host']} since {record['started']}{job}"
        command = record.get("command") or "train"  # records from before the command was written: training's
        holder = {"train": "a running loom run", "submit": "`loom submit` submitting a job"}.get(
            command, f"`loom {command}`"
        )
        return f"{holder} ({who})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a running loom run (a process that has not said who it is)"


def _write_holder(fd: int, command: str) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "command": command,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _refusal(run_dir: Path, holder: str | None = None) -> RunDirectoryInUse:
    return RunDirectoryInUse(
        f"run directory {run_dir} is in use by {holder or _holder(run_dir / LOCK_FILE)}; wait for it "
        f"or stop it, or give this run its own --train.name or --train.run_dir"
    )


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another holds it; None: this filesystem has no file locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as error:
        return False if error.errno in _HELD else None


def _held_by(lock: Path) -> str | None:
    """Who holds `lock`, or None when no live process does (a read-only descriptor can still ask)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None  # no lock file: nothing has taken it here
    try:
        return _holder(lock) if _try_lock(fd) is False else None
    finally:
        os.close(fd)  # closing drops a lock taken only to probe


def holder_of(run_dir: Path) -> str | None:
    """Who holds the run directory's lock (a live run, `loom submit`), or None when no live process does."""
    return _held_by(run_dir / LOCK_FILE)


def check_not_in_use(run_dir: Path) -> None:
    """Refuse a run directory whose lock a live run holds (the launcher's check, before it writes anything)."""
    holder = holder_of(run_dir)
    if holder is not None:
        raise _refusal(run_dir, holder)


def remove_lock_if_free(run_dir: Path) -> bool:
    """Remove the run directory's lock file unless a live process holds it (then False: the directory is that
    run's). Two launchers started together into a new directory both see it created by themselves, and the one
    refused must not take the lock file from under the one running."""
    lock = run_dir / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if _try_lock(fd) is False:
            return False
        lock.unlink(missing_ok=True)  # while locked: a launcher opening it now finds another inode and relocks
        return True
    finally:
        os.close(fd)


class RunLock:
    """Rank 0's hold on its run directory, released by close() or by the process's end. `loom submit` holds it
    too (command "submit") from its last check of the queue until its job is recorded, so that two submissions
    racing into one directory cannot both pass that check."""

    def __init__(self, run_dir: Path, command: str = "train"):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self.created = not self.path.exists()
        while True:
            self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            locked = _try_lock(self.fd)
            if locked is False:
                self.close()
                raise _refusal(run_dir)
            if locked is None or _is_current(self.path, self.fd):
                break
            os.close(self.fd)  # removed between our open and our lock (a failed launch's cleanup): lock the new one
        self.supported = locked is True
        if self.supported:
            try:
                with naming(self.path):
                    _write_holder(self.fd, command)
            except OSError:  # a full disk: the lock file this made goes, as does its descriptor
                self.close(remove_if_created=True)
                raise

    def close(self, remove_if_created: bool = False) -> None:
        """remove_if_created: the holder wrote nothing else, so the directory is left as it was found."""
        if self.fd is not None:
            if remove_if_created and self.created:
                with contextlib.suppress(OSError):  # not in place of an error on its way out, nor keeping the fd
                    self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


class OutputInUse(ConfigError):
    """Another live data or checkpoint command is writing the same output."""


OUTPUT_LOCK_SUFFIX = ".loom-lock"


@contextmanager
def writing_output(output: Path, command: str, named: str | None = None) -> Iterator[None]:
    """Hold the lock on a data or checkpoint command's output (a folder, or a prefix's files, named by the manifest
    every command writing that prefix writes) while the block runs; another command holding it is refused in one line
    (`named`: the output as the user gave it). Folders made for the lock that the command leaves empty (it failed
    before writing) are removed with it. Where no lock can be taken (a read-only or forbidden place, whose own
    write then fails and says so; a filesystem without file locks) the block runs unlocked."""
    output = Path(os.path.realpath(output))  # one lock per place, however the path is spelled
    lock = output.with_name(f".{output.name}{OUTPUT_LOCK_SUFFIX}")
    made = [folder for folder in (lock.parent, *lock.parent.parents) if not folder.exists()]
    fd = _take_output_lock(lock, named or str(output), command)
    try:
        yield
    finally:
        if fd is not None:
            lock.unlink(missing_ok=True)
            os.close(fd)
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break


def _take_output_lock(lock: Path, named: str, command: str) -> int | None:
    """The locked file's descriptor, or None where there is nothing to lock with."""
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None  # the command's own write meets the same refusal and names its output
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # a failing holder removed the folder it had made: make it again
        except PermissionError:  # another user's lock file, which this one cannot take over
            _refuse_if_held(lock, named)
            return None
        except OSError:
            return None  # a read-only or full file system: the command's own write fails and names its output
        locked = _try_lock(fd)
        if locked is False:
            os.close(fd)
            raise _in_use(named, lock)
        if locked is None:
            os.close(fd)
            lock.unlink(missing_ok=True)
            return None
        if _is_current(lock, fd):
            try:
                _write_holder(fd, command)
            except OSError:  # a full disk: the command's own write fails next and names its output
                lock.unlink(missing_ok=True)
                os.close(fd)
                return None
            return fd
        os.close(fd)  # its last holder removed it between our open and our lock: lock the one there now


def _is_current(lock: Path, fd: int) -> bool:
    """Whether the open descriptor `fd` is still the file at `lock` (not one unlinked since it was opened)."""
    try:
        return os.stat(lock).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _refuse_if_held(lock: Path, named: str) -> None:
    holder = _held_by(lock)
    if holder is not None:
        raise _in_use(named, lock, holder)


def _in_use(named: str, lock: Path, holder: str | None = None) -> OutputInUse:
    return OutputInUse(
        f"{named} is being written by {holder or _holder(lock)}; wait for it to finish, or write elsewhere"
    )

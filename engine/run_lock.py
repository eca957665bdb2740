"""One training run at a time per run directory.

Two runs in one directory write over each other's metrics and checkpoints (a job submitted twice, a
`loom train` started while its Slurm job still runs). Rank 0 of a training run holds an exclusive
`flock` on RUN_DIR/.loom-run.lock for as long as it lives, with who holds it written inside; the kernel
drops the lock when the process ends however it ends, so there is never a stale lock to clean up.
Launchers probe the lock before they change anything in the directory.

On a filesystem without file locks (Lustre mounted without `flock`) nothing is detected, and rank 0 says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from loom.engine.config import ConfigError

LOCK_FILE = ".loom-run.lock"
_HELD = (errno.EAGAIN, errno.EACCES)  # what flock's non-blocking refusal raises (EWOULDBLOCK is EAGAIN)


class RunDirectoryInUse(ConfigError):
    """Another live process holds the run directory's lock."""


def _holder(lock: Path) -> str:
    try:
        record = json.loads(lock.read_text())
        job = f", Slurm job {record['slurm_job']}" if record.get("slurm_job") else ""
        who = f"pid {record['pid']} on {record['host']} since {record['started']}{job}"
        holder = "`loom submit` submitting a job" if record.get("command") == "submit" else "a running loom run"
        return f"{holder} ({who})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a running loom run (a process that has not said who it is)"


def _refusal(run_dir: Path) -> RunDirectoryInUse:
    return RunDirectoryInUse(
        f"run directory {run_dir} is in use by {_holder(run_dir / LOCK_FILE)}; wait for it "
        f"or stop it, or give this run its own --train.name or --train.run_dir"
    )


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another holds it; None: this filesystem has no file locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as error:
        return False if error.errno in _HELD else None


def check_not_in_use(run_dir: Path) -> None:
    """Refuse a run directory whose lock a live run holds (the launcher's check, before it writes anything)."""
    lock = run_dir / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return  # no lock file: no run has started here
    try:
        if _try_lock(fd) is False:
            raise _refusal(run_dir)
    finally:
        os.close(fd)  # closing drops a lock taken only to probe


class RunLock:
    """Rank 0's hold on its run directory, released by close() or by the process's end. `loom submit` holds it
    too (command "submit") from its last check of the queue until its job is recorded, so that two submissions
    racing into one directory cannot both pass that check."""

    def __init__(self, run_dir: Path, command: str = "train"):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        self.created = not self.path.exists()
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        locked = _try_lock(self.fd)
        if locked is False:
            self.close()
            raise _refusal(run_dir)
        self.supported = locked is True
        if self.supported:
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "slurm_job": os.environ.get("SLURM_JOB_ID"),
                "command": command,
            }
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(record).encode(), 0)

    def close(self, remove_if_created: bool = False) -> None:
        """remove_if_created: the holder wrote nothing else, so the directory is left as it was found."""
        if self.fd is not None:
            if remove_if_created and self.created:
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None

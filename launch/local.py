"""`loom train --nproc N`: spawn N ranks on this machine and supervise them.

Each rank is a spawned process with torchrun-style environment variables. The parent waits on
all of them; the first one to fail makes the others stop (SIGTERM, then SIGKILL) and its error,
with its rank, is what the user sees. CPU threads are divided among the ranks so N ranks on a
few cores do not oversubscribe them.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import time
import traceback

from engine.config import LoomConfig
from engine.config_io import config_from_dict, config_to_dict

# Errors whose message is the whole story; anything else is reported with its type.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError)


class RankFailed(RuntimeError):
    def __init__(self, rank: int, message: str, details: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.details = rank, details


def free_port() -> int:
    """A TCP port on the loopback that is free now (for a rendezvous on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, raw_config: dict, threads: int, errors, mode: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    from launch.env import run_rank

    torch.set_num_threads(threads)
    try:
        run_rank(config_from_dict(raw_config), mode)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if not isinstance(error, USER_ERRORS):
            message = f"{type(error).__name__}: {message}"
        errors.put((time.time(), rank, message, traceback.format_exc()))
        raise SystemExit(1) from None


def launch_local(config: LoomConfig, nproc: int, grace_s: float = 5.0, mode: str = "train") -> None:
    """Run training (or evaluation, mode "eval") on `nproc` local ranks; raises RankFailed with the
    first failing rank's error."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    raw = config_to_dict(config)
    procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, raw, threads, errors, mode), daemon=False)
             for r in range(nproc)]
    for p in procs:
        p.start()
    running = {p.sentinel: (r, p) for r, p in enumerate(procs)}
    failed: tuple[int, int] | None = None
    while running and failed is None:
        for sentinel in multiprocessing.connection.wait(list(running)):
            rank, proc = running.pop(sentinel)
            proc.join()
            if proc.exitcode != 0:
                failed = (rank, proc.exitcode)
                break
    if failed is None:
        return
    for _, proc in running.values():
        proc.terminate()
    for _, proc in running.values():
        proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
    raise _first_error(errors, *failed)


def _first_error(errors, rank: int, exitcode: int) -> RankFailed:
    """The root cause: the earliest report. Peers of a failed rank fail too, but only after it
    has reported and exited (their collectives break when its sockets close)."""
    reports = []
    while True:
        try:
            reports.append(errors.get(timeout=0.5))
        except Exception:  # queue.Empty
            break
    if not reports:
        return RankFailed(rank, f"exited with code {exitcode} without a Python error (killed?)", "")
    _, first_rank, message, details = min(reports)
    return RankFailed(first_rank, message, details)

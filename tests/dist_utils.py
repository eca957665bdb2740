"""Run a function on N real gloo ranks in spawned processes and collect each rank's return value."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, queue, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 300) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the results in rank order, raises on any error."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]

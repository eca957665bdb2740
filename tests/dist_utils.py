"""Run a function on N real gloo ranks in separate processes and collect each rank's return value.

Ranks fork from a fork server that imported torch and loom once (as loom's own launcher does), instead of each
spawned rank importing them again: seconds of CPU per rank, over a hundred multi-rank runs in the suite."""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

from loom.engine.parallel.rendezvous import host_rendezvous, rank_context


def _portable(value, to_numpy: bool):
    """Tensors cross the queue as numpy arrays: torch would share them through file descriptors
    that die with the worker process before the parent reads them."""
    import numpy as np
    import torch

    if to_numpy and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if not to_numpy and isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v, to_numpy) for v in value)
    if isinstance(value, dict):
        return {k: _portable(v, to_numpy) for k, v in value.items()}
    return value


def _worker(fn, rank, world_size, environ, queue, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # the caller's environment, as loom's launcher gives its ranks: the fork server's is that of the test that
        # started it (a LOOM_INJECT_FAULT one test set stayed in every later test's ranks)
        os.environ.clear()
        os.environ.update(environ)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, True, _portable(fn(rank, world_size, *args), to_numpy=True)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT = rank_context()


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 300) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the results in rank order, raises on any error."""
    ctx = _CONTEXT
    queue = ctx.Queue()
    store, rendezvous = host_rendezvous()
    environ = {**os.environ, **rendezvous}
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, environ, queue, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = _portable(value, to_numpy=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return [results[r] for r in range(world_size)]

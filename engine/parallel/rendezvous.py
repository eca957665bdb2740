"""Where ranks on one machine meet: a free loopback port for a TCP rendezvous, and the fork server every local
rank (of training, evaluation, generation and the tests) starts from."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading

# Ranks fork from a server process that has imported these once (forkserver): a rank then starts in a fraction
# of a second instead of importing torch (and torch._dynamo, which torch.optim pulls in) itself, seconds of CPU
# per rank. The server must never touch CUDA, or every rank forked from it fails at its first CUDA call
# ("Cannot re-initialize CUDA in forked subprocess"): asking torch.cuda.is_available() is enough. Inductor is
# not preloaded for that reason: importing torch._inductor.compile_fx asks it (torch 2.11's runtime.benchmarking),
# which on the first GPU run of 2026-11-27 failed every local rank. tests/test_launch.py holds the list to
# this.
RANK_PRELOAD = [
    "loom.engine.parallel.rank_server_signals",  # first: a stop signal during the imports below must not kill it
    "torch",
    "torch._dynamo",
    "loom.launch.env",
    "loom.engine.train",
]


def rank_context():
    """The multiprocessing context local ranks start in: forked from the preloaded server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def start_rank_server() -> None:
    """Start the fork server now, in the background: its imports (seconds of CPU) then overlap the launcher's
    own checks instead of following them. The first rank started finds it running (or waits for it)."""
    from multiprocessing import forkserver

    rank_context()
    threading.Thread(target=forkserver.ensure_running, name="loom-rank-server", daemon=True).start()


def free_port() -> int:
    """A TCP port on the loopback that is free now (for a rendezvous on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

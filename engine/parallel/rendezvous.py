"""Where ranks on one machine meet: a free loopback port for a TCP rendezvous, and the fork server every local
rank (of training, evaluation, generation and the tests) starts from."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading

# Ranks fork from a server process that has imported these once (forkserver): a rank then starts in a fraction
# of a second instead of importing torch (and torch._dynamo, which torch.optim pulls in, and inductor, which
# compiles the blocks on a GPU by default) itself, seconds of CPU per rank. The server never runs torch code, so
# forking from it is as clean as a spawn.
RANK_PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "loom.launch.env", "loom.engine.train"]


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

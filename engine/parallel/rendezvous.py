"""Where ranks on one machine meet: a rendezvous store the launcher hosts, and the fork server every local rank (of
training, evaluation, generation and the tests) starts from."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

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


def host_rendezvous() -> tuple[TCPStore, dict[str, str]]:
    """The store local ranks meet at, hosted by the launcher on a port the system gives it, and the environment
    each rank sets before `init_process_group`: every rank is the store's client (torch's agent-store mode, as
    under torchrun). A port found free and bound later by rank 0 could be taken in between, failing the launch.
    Keep the store until the ranks have ended: they lose their rendezvous with it."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(hours=1))
    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return store, environment


def free_port() -> int:
    """A TCP port on the loopback that is free now, which another process may take before it is bound again
    (host_rendezvous has no such window)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_ranks(ranks: list, grace_s: float) -> None:
    """SIGTERM every rank process, and SIGKILL those still there after grace_s (one deadline for all). For ranks
    that cannot finish: a peer failed, so none can complete a collective, let alone a checkpoint. The SIGKILL also
    ends a rank whose SIGTERM was lost (one sent before Python's fork handling ran in it is dropped)."""
    for rank in ranks:
        rank.terminate()
    deadline = time.monotonic() + grace_s
    for rank in ranks:
        rank.join(max(0.0, deadline - time.monotonic()))
        if rank.is_alive():
            rank.kill()
            rank.join()

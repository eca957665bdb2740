"""Stop signals in the rank server: imported first by it (rendezvous.RANK_PRELOAD), and by nothing else.

The server that local ranks fork from (multiprocessing's forkserver) shares the launcher's process group, so a
Ctrl-C in the terminal, or SIGTERM to the group (`kill -- -PGID`, systemd, `docker stop`, a closed terminal),
reaches it as well as the launcher and the ranks. With the default actions it died: during its imports with a
screen of KeyboardInterrupt traceback, or later, and then the launcher could not learn how its ranks ended
(multiprocessing reports 255 for a rank whose server is gone), so a run whose ranks had saved a checkpoint was
reported as stopped before one. The launcher stops the ranks and the server leaves when the launcher does (its
pipe closes), so the server ignores both signals.

A process forked from the server inherits this handler until it sets its own (a training rank does so first);
there it takes the default action: it ends, quietly, and its launcher says how (a KeyboardInterrupt in a rank's
start-up printed a screen of traceback).
"""

from __future__ import annotations

import os
import signal

_SERVER_PID = os.getpid()


def _ignored_in_the_server(signum: int, frame) -> None:
    if os.getpid() == _SERVER_PID:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _ignored_in_the_server)

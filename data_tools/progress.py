"""Progress bars for data steps: documents per second (tqdm's rate) and input MB per second, or the time
spent in a step that reports no progress of its own.

Written to stderr so that the JSON a command prints on stdout stays machine-readable. This module
must not do any work itself.
"""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm


class Progress:
    """tqdm over documents with an MB/s postfix; use as a context manager.

    total: the expected document count, if known, for a percentage and the time left (an upper bound,
    such as the input's line count, is fine: the bar is completed when the work ends)."""

    def __init__(self, description: str, enabled: bool = True, total: int | None = None):
        self._bar = tqdm(
            desc=description, unit="doc", total=total, file=sys.stderr, disable=not enabled, mininterval=1.0
        )
        self._start = time.perf_counter()
        self.documents = 0
        self.bytes = 0

    def update(self, documents: int, nbytes: int, **postfix) -> None:
        self.documents += documents
        self.bytes += nbytes
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.update(documents)
        self._bar.set_postfix({"MB/s": f"{self.bytes / 1e6 / elapsed:.1f}", **postfix}, refresh=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None and self._bar.total is not None:
            self._bar.total = self._bar.n  # blank and bad lines were counted in the total but are no documents
            self._bar.refresh()
        self._bar.close()


class Elapsed:
    """A line that shows how long a step without progress reports of its own (SentencePiece training) has run.

    A thread refreshes it every second; the work runs in native code that releases the GIL."""

    def __init__(self, description: str, enabled: bool = True, delay_s: float = 0.0):
        """`delay_s`: shown only once the step has run this long (a quick one, or its one-line error, stays alone)."""
        self._bar = tqdm(
            desc=description,
            bar_format="{desc}: {elapsed}",
            file=sys.stderr,
            disable=not enabled,
            mininterval=1.0,
            delay=delay_s,
        )
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="progress-elapsed", daemon=True)

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            self._bar.refresh()

    def __enter__(self) -> Elapsed:
        if not self._bar.disable:
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._ticker.is_alive():
            self._ticker.join()
        self._bar.close()

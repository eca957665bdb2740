"""A progress bar for data steps that shows documents per second (tqdm's rate) and input MB per second.

Written to stderr so that the JSON a command prints on stdout stays machine-readable. This module
must not do any work itself.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """tqdm over documents with an MB/s postfix; use as a context manager."""

    def __init__(self, description: str, enabled: bool = True):
        self._bar = tqdm(desc=description, unit="doc", file=sys.stderr, disable=not enabled, mininterval=1.0)
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

    def __exit__(self, *exc) -> None:
        self._bar.close()

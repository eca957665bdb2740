"""Order-preserving parallel map for the data steps: a spawn pool with a bounded number of tasks in flight.

The parent reads input and writes output; workers only compute. Results come back in input
order, and at most `in_flight_per_worker * workers` tasks are queued, so memory stays flat in
the size of the corpus. With one worker everything runs in the calling process (no pickling).
This module must not know what the tasks do.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from typing import Any, Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")


def chunked(
    items: Iterable[Item], max_items: int, max_characters: int, characters: Callable[[Item], int] = len
) -> Iterator[list[Item]]:
    """Items in lists of at most `max_items`, each closed early once it holds `max_characters`, so a
    task's memory and time stay bounded whatever the document sizes."""
    chunk: list[Item] = []
    total = 0
    for item in items:
        chunk.append(item)
        total += characters(item)
        if len(chunk) >= max_items or total >= max_characters:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def imap_ordered(
    function: Callable[..., Any], tasks: Iterable[tuple], workers: int, in_flight_per_worker: int = 3
) -> Iterator[Any]:
    """function(*task) for every task, in order; `function` must be importable (spawn pickles it by name)."""
    if workers <= 1:
        for task in tasks:
            yield function(*task)
        return
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(function, task))
            if len(pending) >= in_flight_per_worker * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

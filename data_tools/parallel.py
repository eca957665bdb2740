"""Order-preserving parallel map for the data steps: a spawn process pool with a bounded number of tasks in flight.

The parent reads input and writes output; workers only compute. Results come back in input
order, and at most `in_flight_per_worker * workers` tasks are queued, so memory stays flat in
the size of the corpus. With one worker everything runs in the calling process (no pickling).

The pool is concurrent.futures' ProcessPoolExecutor, not multiprocessing.Pool: when a worker dies
(the OOM killer, SIGKILL, a crash in native code) multiprocessing.Pool silently starts a replacement
and the parent waits forever for the lost task, while the executor fails every pending task at
once; that becomes a WorkerDied naming the worker and its signal. This module must not know what
the tasks do.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator, TypeVar

from loom.errors import LoomError

Item = TypeVar("Item")
# Test-only fault switch (the training ones are in engine/faults.py, which data_tools may not import):
# the pool worker that runs task number N (counted from 0 in each map) SIGKILLs itself, as the OOM killer would.
KILL_TASK_VARIABLE = "LOOM_INJECT_DATA_KILL"
_SIGNAL_HINTS = {
    signal.SIGKILL: "out of memory?",
    signal.SIGBUS: "a memory-mapped file on a full disk?",
    signal.SIGSEGV: "a crash in native code",
}
# How long to wait for the dead worker's exit status to be readable (it is already gone when the pool notices).
_EXIT_STATUS_WAIT_SECONDS = 2.0


class WorkerDied(LoomError):
    """A pool worker ended without returning its task (killed by a signal or exited); the message names it."""


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


def describe_exit(exitcode: int) -> str:
    """How a process ended, from multiprocessing's exitcode (-N: killed by signal N)."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    number = -exitcode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "unknown signal"
    hint = _SIGNAL_HINTS.get(number)
    return f"killed by signal {number}, {name}" + (f": {hint}" if hint else "")


def _exit_with_the_parent(parent: int) -> None:
    """A worker's initializer: the worker exits once its parent is gone. A parent killed outright (SIGKILL, the OOM
    killer) cannot shut its pool down, and its workers slept on forever, holding its files open."""

    def watch() -> None:
        while os.getppid() == parent:  # a dead parent's children are handed to another process
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _run_task(function: Callable[..., Any], number: int, task: tuple) -> Any:
    """function(*task) in a worker, after the test-only fault switch."""
    if os.environ.get(KILL_TASK_VARIABLE) == str(number):
        os.kill(os.getpid(), signal.SIGKILL)
    return function(*task)


def _dead_worker(pool: ProcessPoolExecutor) -> str:
    """'data worker PID died (how)' for the worker whose death broke the pool."""
    # The executor keeps its workers only in this private dict (pid -> Process); there is no public view.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    deadline = time.monotonic() + _EXIT_STATUS_WAIT_SECONDS
    while True:
        exited = [p for p in processes if p.exitcode is not None]
        # Once one worker dies the pool SIGTERMs the others: those are consequences, not the cause, and a
        # terminated one can be seen exited before the cause is, so they only answer when nothing else will.
        dead = [p for p in exited if p.exitcode != -signal.SIGTERM]
        if dead or len(exited) == len(processes) or time.monotonic() > deadline:
            dead = dead or exited
            break
        time.sleep(0.05)
    if not dead:
        return "a data worker died"
    return f"data worker {dead[0].pid} died ({describe_exit(dead[0].exitcode)})"


def _ordered_results(
    pool: ProcessPoolExecutor, function: Callable[..., Any], tasks: Iterable[tuple], window: int
) -> Iterator[Any]:
    pending: deque[Future] = deque()
    for number, task in enumerate(tasks):
        pending.append(pool.submit(_run_task, function, number, task))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def imap_ordered(
    function: Callable[..., Any], tasks: Iterable[tuple], workers: int, in_flight_per_worker: int = 3
) -> Iterator[Any]:
    """function(*task) for every task, in order; `function` must be importable (spawn pickles it by name).

    A worker's exception is re-raised here; a worker's death raises WorkerDied. Closing the iterator
    early (contextlib.closing) cancels the queued tasks and waits only for the running ones."""
    if workers <= 1:
        for task in tasks:
            yield function(*task)
        return
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_exit_with_the_parent,
        initargs=(os.getpid(),),
    )
    try:
        yield from _ordered_results(pool, function, tasks, in_flight_per_worker * workers)
    except BrokenProcessPool:
        raise WorkerDied(_dead_worker(pool)) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

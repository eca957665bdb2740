"""The first step of a torch.compile'd model: it pays the compile, and a compiler that fails must not end the run.

Blocks compile on their first call, inside the first training step. `first_compiled_step` times that step and,
with dynamo's suppress_errors, lets a frame whose compile fails run eagerly instead of raising mid-step (where
pipeline and TP peers would be left waiting in a collective). Dynamo reports such a failure as a multi-line
warning with a traceback; it is collected here and said in one line after the step. A SIGTERM is held until the
step ends: where a command's handler raises it (`loom bench`, whose lease ends in a SIGTERM), dynamo took the stop
raised mid-compile for a compiler failure and went on eagerly, and the command ran past its limit.

The blocks compile with inductor unless LOOM_COMPILE_BACKEND names another of torch.compile's backends
(`block_backend`): `aot_eager` tells a loom bug from an inductor one, and the CPU test suite runs
`aot_eager_decomp_partition` (inductor's decompositions and its partitioner, so the same graphs and the same
tensors saved for backward, run by eager kernels instead of C++ ones it would spend most of its compile time on).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import torch

from loom.errors import LoomError

BACKEND_VARIABLE = "LOOM_COMPILE_BACKEND"
# Where dynamo logs a frame it could not compile and ran eagerly instead (suppress_errors).
_FALLBACK_LOGGERS = ("torch._dynamo.convert_frame", "torch._dynamo.output_graph")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _reason(message: str) -> str:
    """The line of dynamo's warning that names the error (`RuntimeError: ...`), else its first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception", "Failed"))]
    return (named[-1] if named else lines[0])[:300] if lines else "unknown error"


def block_backend() -> str:
    """torch.compile's backend for model.compile's blocks (module docstring)."""
    name = os.environ.get(BACKEND_VARIABLE) or "inductor"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        raise LoomError(
            f"{BACKEND_VARIABLE}={name} is not a torch.compile backend: unset it (inductor) or name one "
            "torch._dynamo.list_backends(exclude_tags=()) lists, such as aot_eager"
        )
    return name


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    """A SIGTERM that arrives inside is recorded, and raised again once the handler before it is back (masking the
    signal would hold it from this thread alone; another thread of the process would still take it). Nothing is
    held off the main thread (which alone handles signals) or where a handler set outside Python could not be put
    back."""
    held: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    holding = before is not None and threading.current_thread() is threading.main_thread()
    if holding:
        signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        if holding:
            signal.signal(signal.SIGTERM, before)
            if held:
                signal.raise_signal(signal.SIGTERM)


@contextlib.contextmanager
def first_compiled_step(
    log: Callable[[str], None] | None, warn: Callable[[str], None] | None = None, where: str = ""
) -> Iterator[None]:
    """Around the first training step (or evaluation: a new graph for no_grad) of a run whose blocks are compiled:
    afterwards `log` (None: nothing) gets the step's time, and `warn` (default `log`) why compiling failed and
    that the run goes on eagerly; `where` names the ranks that say it (" on pipeline stage 1"), as a compile that
    fails on one stage's blocks fails on that stage's ranks alone."""
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in _FALLBACK_LOGGERS]
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(collect)
        lg.propagate = False
    start = time.perf_counter()
    try:
        with torch._dynamo.config.patch(suppress_errors=True), _sigterm_held():
            yield
    finally:
        for lg, (propagate, level) in zip(loggers, saved, strict=True):
            lg.removeHandler(collect)
            lg.propagate, lg.level = propagate, level
    seconds = time.perf_counter() - start
    if collect.messages and (warn or log) is not None:
        (warn or log)(
            f"warning: model.compile{where}: compiling failed ({_reason(collect.messages[0])}); this run goes on "
            f"eagerly (--model.compile false skips the attempt)"
        )
    elif not collect.messages and log is not None:
        log(f"model.compile: the first step took {seconds:.1f} s, compiling each block's graph once for all")

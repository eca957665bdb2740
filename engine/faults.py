"""Failures injected on purpose, for the tests of failure handling: the one place that reads them.

Each switch is an environment variable, so a test can set it for the ranks a launcher spawns
(local, torchrun or Slurm) without a config field users would see:

    LOOM_INJECT_FAULT=RANK:STEP      that rank raises before that step
    LOOM_INJECT_HANG=RANK:STEP       that rank sleeps forever before that step (a hung peer)
    LOOM_INJECT_NAN=STEP             every rank sees a NaN loss at that step
    LOOM_KILL_DURING_SAVE=RANK:STEP  that rank SIGKILLs itself after writing its checkpoint file, before the seal
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Mapping


class InjectedFault(RuntimeError):
    """Raised by LOOM_INJECT_FAULT: deliberately not a LoomError, so it is reported as a bug would be."""


def _step_for_rank(spec: str | None, rank: int) -> int | None:
    if not spec:
        return None
    fault_rank, step = (int(x) for x in spec.split(":"))
    return step if fault_rank == rank else None


@dataclass(frozen=True)
class FaultPlan:
    """The faults this rank must inject; all None in a normal run."""

    raise_before_step: int | None = None
    hang_before_step: int | None = None
    nan_loss_at_step: int | None = None
    kill_during_save_at_step: int | None = None

    @classmethod
    def from_environment(cls, rank: int, environ: Mapping[str, str] = os.environ) -> FaultPlan:
        nan = environ.get("LOOM_INJECT_NAN")
        return cls(
            raise_before_step=_step_for_rank(environ.get("LOOM_INJECT_FAULT"), rank),
            hang_before_step=_step_for_rank(environ.get("LOOM_INJECT_HANG"), rank),
            nan_loss_at_step=int(nan) if nan else None,
            kill_during_save_at_step=_step_for_rank(environ.get("LOOM_KILL_DURING_SAVE"), rank),
        )

    def before_step(self, step: int) -> None:
        """Raise or hang here if this rank was told to before `step`."""
        if step == self.raise_before_step:
            raise InjectedFault(f"fault injected by LOOM_INJECT_FAULT at step {step}")
        if step == self.hang_before_step:
            time.sleep(10**6)

    def after_checkpoint_file(self, step: int) -> None:
        """Die like a killed node would: after this rank's file of `step`'s checkpoint, before the seal."""
        if step == self.kill_during_save_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

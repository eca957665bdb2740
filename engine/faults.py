"""Failures injected on purpose, for the tests of failure handling: the one place that reads them.

Each switch is an environment variable, so a test can set it for the ranks a launcher spawns
(local, torchrun or Slurm) without a config field users would see:

    LOOM_INJECT_FAULT=RANK:STEP      that rank raises before that step
    LOOM_INJECT_HANG=RANK:STEP       that rank sleeps forever before that step (a hung peer)
    LOOM_INJECT_KILL=RANK:STEP[:SIG] that rank sends itself SIG (default KILL, the OOM killer's way; ABRT is
                                     how NCCL's watchdog ends a rank) before that step
    LOOM_INJECT_NAN=STEP[,STEP...]   every rank sees a NaN loss and gradient norm at those steps (as a real NaN
                                     in the forward gives: its backward makes every gradient NaN)
    LOOM_KILL_DURING_SAVE=RANK:STEP  that rank SIGKILLs itself after writing its checkpoint file, before the seal
    LOOM_INJECT_PAUSE=STEP           every rank says so on stdout and waits before that step until a stop
                                     signal reaches it: a test that signals once it reads that line sees
                                     the run stop at step STEP + 1 however slow the machine (a signal
                                     sent after seeing step k in the metrics races the end of the run)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from loom.engine.train import StopRequest


class InjectedFault(RuntimeError):
    """Raised by LOOM_INJECT_FAULT: deliberately not a LoomError, so it is reported as a bug would be."""


def _step_for_rank(spec: str | None, rank: int) -> int | None:
    if not spec:
        return None
    fault_rank, step = (int(x) for x in spec.split(":")[:2])
    return step if fault_rank == rank else None


@dataclass(frozen=True)
class FaultPlan:
    """The faults this rank must inject; all None in a normal run."""

    raise_before_step: int | None = None
    hang_before_step: int | None = None
    kill_before_step: int | None = None
    kill_signal: str = "KILL"
    nan_loss_at_steps: tuple[int, ...] = ()
    kill_during_save_at_step: int | None = None
    pause_before_step: int | None = None

    @classmethod
    def from_environment(cls, rank: int, environ: Mapping[str, str] = os.environ) -> FaultPlan:
        nan, pause = environ.get("LOOM_INJECT_NAN"), environ.get("LOOM_INJECT_PAUSE")
        return cls(
            raise_before_step=_step_for_rank(environ.get("LOOM_INJECT_FAULT"), rank),
            hang_before_step=_step_for_rank(environ.get("LOOM_INJECT_HANG"), rank),
            kill_before_step=_step_for_rank(environ.get("LOOM_INJECT_KILL"), rank),
            kill_signal=(environ.get("LOOM_INJECT_KILL", "0:0") + ":KILL").split(":")[2],
            nan_loss_at_steps=tuple(int(step) for step in nan.split(",")) if nan else (),
            kill_during_save_at_step=_step_for_rank(environ.get("LOOM_KILL_DURING_SAVE"), rank),
            pause_before_step=int(pause) if pause else None,
        )

    def before_step(self, step: int, stop: StopRequest | None = None) -> None:
        """Raise, hang, die or pause here if this rank was told to before `step`; a pause needs the run's `stop`."""
        if step == self.raise_before_step:
            raise InjectedFault(f"fault injected by LOOM_INJECT_FAULT at step {step}")
        if step == self.hang_before_step:
            time.sleep(10**6)
        if step == self.kill_before_step:
            os.kill(os.getpid(), signal.Signals[f"SIG{self.kill_signal}"])
        if step == self.pause_before_step and stop is not None:
            print(f"paused before step {step} until a stop signal (LOOM_INJECT_PAUSE)", flush=True)
            while not stop.code:
                time.sleep(0.05)

    def after_checkpoint_file(self, step: int) -> None:
        """Die like a killed node would: after this rank's file of `step`'s checkpoint, before the seal."""
        if step == self.kill_during_save_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

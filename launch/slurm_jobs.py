"""A `loom submit` job's life after submission: whether one still holds a run directory, what each task runs
(TrainingJob: one rank, whose stop signals become checkpoints and a requeue), a failing rank's report in
RUN_DIR/slurm/failures/, and following the job's state and rank 0's log until it ends (launch/slurm.py submits).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from loom.engine.config import ConfigError


def slurm_dir(run_dir: str | Path) -> Path:
    """RUN/slurm: submitit's job files and logs, the jobs `loom submit` recorded (JOBS_FILE), ranks' failures."""
    return Path(run_dir) / "slurm"


JOBS_FILE = "jobs.jsonl"
JOBS_CHECKED = 5  # the newest submissions of a run directory that check_no_job_queued asks squeue about
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "SPECIAL_EXIT",
    "REVOKED",
}
REQUEUE_WAIT_S = 600


def check_no_job_queued(run_dir: Path) -> None:
    """Refuse a launch into a run directory whose Slurm job (one `loom submit` recorded there) is still queued or
    running: it would write the same metrics and checkpoints. The run lock finds a job only once it runs."""
    jobs = slurm_dir(run_dir) / JOBS_FILE
    if not jobs.is_file():
        return
    if shutil.which("squeue") is None:  # a copy of the run away from its cluster, most likely
        print(
            f"warning: {jobs} lists Slurm jobs and there is no squeue here to ask whether one is still queued; "
            "if one is, it will find this run's files changed",
            file=sys.stderr,
        )
        return
    recorded = []
    for line in jobs.read_text().splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            recorded.append(str(json.loads(line)["job_id"]))
    for job_id in reversed(recorded[-JOBS_CHECKED:]):
        state, no_answer = _squeue_state(job_id)
        if no_answer:
            raise ConfigError(
                f"run directory {run_dir} records Slurm job {job_id}, and squeue cannot say whether it is still "
                f"queued ({no_answer}); launch where Slurm answers (a login node), or give another --train.run_dir"
            )
        if state is not None and state not in TERMINAL_STATES:
            raise ConfigError(
                f"run directory {run_dir} belongs to Slurm job {job_id}, which is {state}: another launch would "
                f"write over its metrics and checkpoints; wait for it, `scancel {job_id}`, or give another "
                "--train.run_dir"
            )


def _squeue_state(job_id: str) -> tuple[str | None, str | None]:
    """(the job's state while slurmctld remembers it, else None; why squeue gave no answer, else None)."""
    listed, no_answer = _squeue(job_id, "%T")
    return (listed.split()[0] if listed else None), no_answer


def _squeue(job_id: str, field: str) -> tuple[str | None, str | None]:
    """(squeue's `field` of the job, e.g. %T its state, while slurmctld remembers it, else None; why squeue gave
    no answer, else None)."""
    try:
        listed = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-t", "all", "-o", field], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, str(error)
    if listed.returncode != 0:
        if "Invalid job id" in listed.stderr:  # one slurmctld has forgotten: it ended long ago
            return None, None
        return None, (listed.stderr.strip() or f"exit code {listed.returncode}").splitlines()[-1]
    return listed.stdout.strip() or None, None


# srun's words for a task a signal ended ("srun: error: HOST: task N: Killed"), as signal names.
SRUN_SIGNAL_WORDS = {"Killed": "SIGKILL", "Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS"}
SRUN_KILLED_TASK = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-\d+)?: (" + "|".join(SRUN_SIGNAL_WORDS) + ")")


# submitit's first line in each start of a task: a requeued job's log holds every attempt, one after another.
ATTEMPT_START = "- Starting with JobEnvironment("


def killed_task(log: Path) -> tuple[int, str, str] | None:
    """(rank, host, signal name) of the first task srun says a signal ended in the job's last attempt, from rank 0's
    log; None if none (an earlier attempt's killed task is not this ending's cause)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = SRUN_KILLED_TASK.search(text, max(text.rfind(ATTEMPT_START), 0))
    return (int(found.group(2)), found.group(1), SRUN_SIGNAL_WORDS[found.group(3)]) if found else None


def stopped_by_a_signal(job) -> bool:
    """Whether a completed job's ranks returned early on a stop signal (TrainingJob's "stopped"): Slurm says
    COMPLETED for a job whose SIGTERM came without a cancel (an admin, a drain script, scancel --signal=TERM)."""
    try:
        return any(result.get("stopped") for result in job.results() if isinstance(result, dict))
    except Exception:  # noqa: BLE001 - no readable results: nothing to add to Slurm's word
        return False


def newest_checkpoint(run_dir: Path):
    """The metadata of the run's newest checkpoint that looks intact (sizes, not hashes), or None."""
    from loom.engine.checkpoint.format import find_loadable
    from loom.engine.run_dir import checkpoints_of

    found = find_loadable(checkpoints_of(run_dir), verify_hashes=False, warn=lambda _: None)
    return found[1] if found else None


def unfinished_by_exit_after(run_dir: Path, config) -> str | None:
    """For a job that train.exit_after ended before train.steps (Slurm says COMPLETED): where the run stands and
    what continues it; None when the run is complete or stopped early on its validation loss."""
    t = config.train
    saved = newest_checkpoint(run_dir) if t.exit_after else None
    if saved is None or saved.step >= t.steps:
        return None
    patience = t.early_stop_patience
    if patience and (saved.validation or {}).get("evals_without_gain", 0) >= patience:
        return None
    return (
        f"at step {saved.step} of train.steps = {t.steps}: train.exit_after = {t.exit_after} ends each job "
        f"after that many steps; its checkpoint is saved: submit the same command to continue"
    )


def saved_so_far(run_dir: Path, config, again: str = "submit the same command") -> str:
    """ "; its newest checkpoint is step S of T: `again` to continue from it" for a job (or a launch) that ended
    before its run did, else ""."""
    saved = newest_checkpoint(run_dir)
    if saved is None or saved.step >= config.train.steps:
        return ""
    return f"; the run's newest checkpoint is step {saved.step} of {config.train.steps}: {again} to continue from it"


def rank0_log(run_dir: Path, job_id: str) -> Path:
    return slurm_dir(run_dir) / f"{job_id}_0_log.out"


class TrainingJob:
    """What each Slurm task runs (pickled by submitit; a class of the installed package, so it
    pickles by reference)."""

    def __init__(self, raw_config: dict):
        self.raw_config = raw_config

    def __call__(self) -> dict:
        import submitit
        import torch

        from loom.engine.config_io import config_from_dict
        from loom.launch.env import StopSignals, run_rank

        job = submitit.JobEnvironment()
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        torch.set_num_threads(int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
        # Installed after submitit's own handlers, so these win on every rank.
        stop = StopSignals({signal.SIGUSR2: StopSignals.REQUEUE, signal.SIGTERM: StopSignals.EXIT})
        config = config_from_dict(self.raw_config)
        try:
            rows = run_rank(config, "train", stop)
        except BaseException as error:
            record_failure(
                Path(config.train.run_dir), job.job_id, job.global_rank, error, config.parallel.timeout_minutes
            )
            raise
        if stop.agreed == StopSignals.REQUEUE:  # not stop.code: the requeue's own SIGTERM may have raised it
            # Slurm now ends this allocation with SIGTERM; returning would let the job complete instead. The
            # checkpoint is saved, so that SIGTERM ends the rank at once: caught, the rank would sleep until
            # SIGKILL, holding the nodes KillWait seconds longer (30 by default) before the job can restart.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            terminated = stop.code > stop.agreed  # a SIGTERM came after the agreement (an exit request wins)
            if job.global_rank == 0 and not terminated:
                subprocess.run(["scontrol", "requeue", job.job_id], check=True)
                print(f"checkpoint saved; job {job.job_id} requeued, it resumes from the checkpoint", flush=True)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            if terminated:
                signal.raise_signal(signal.SIGTERM)
            time.sleep(REQUEUE_WAIT_S)
            raise RuntimeError(f"job {job.job_id} was not requeued within {REQUEUE_WAIT_S} s")
        return {"rank": job.global_rank, "steps_logged": len(rows), "stopped": bool(stop.code)}


def _attempt() -> str:
    return os.environ.get("SLURM_RESTART_COUNT", "0")


def record_failure(run_dir: Path, job_id: str, rank: int, error: BaseException, timeout_minutes: float) -> None:
    import traceback

    from loom.engine.atomic import write_text_atomically
    from loom.launch.local import describe_rank_error

    folder = slurm_dir(run_dir) / "failures"
    folder.mkdir(parents=True, exist_ok=True)
    report = {
        "time": time.time(),
        "job_id": job_id,
        "attempt": int(_attempt()),
        "rank": rank,
        "host": socket.gethostname(),
        "traceback": traceback.format_exc(),
    }
    report["message"], report["user_error"] = describe_rank_error(error, timeout_minutes)
    write_text_atomically(folder / f"{job_id}.{_attempt()}.rank{rank}.json", json.dumps(report))


def first_failure(run_dir: Path, job_id: str) -> dict | None:
    """The earliest error of the job's latest attempt: the root cause (peers fail after it)."""
    reports = [json.loads(p.read_text()) for p in (slurm_dir(run_dir) / "failures").glob(f"{job_id}.*.rank*.json")]
    if not reports:
        return None
    last_attempt = max(r["attempt"] for r in reports)
    return min((r for r in reports if r["attempt"] == last_attempt), key=lambda r: r["time"])


HELD_REASONS = ("JobHeldUser", "JobHeldAdmin")


def _pending_reason(job_id: str) -> str | None:
    """squeue's reason a pending job waits (Priority, Resources, JobHeldUser, ...), or None."""
    reason, _ = _squeue(job_id, "%r")
    return reason if reason != "None" else None


def job_state(job_id: str) -> str:
    """Slurm's state of the job: squeue while slurmctld remembers it, then sacct."""
    state, _ = _squeue_state(job_id)
    if state is not None:
        return state
    try:
        result = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    states = result.stdout.split()
    return states[0] if result.returncode == 0 and states else "UNKNOWN"  # sacct prints e.g. "CANCELLED by 0"


def follow(job_id: str, run_dir: Path, poll_s: float = 1.0, out=sys.stdout) -> str:
    """Print rank 0's log as it grows and each change of the job's state; returns the final state."""
    log, offset, last_state = rank0_log(run_dir, job_id), 0, None
    unknown_since, ran = None, False
    while True:
        state = job_state(job_id)
        if state != last_state:
            requeued = ran and state in ("PENDING", "REQUEUED")
            note = " (requeued: it resumes from its last checkpoint when it starts again)" if requeued else ""
            if state == "PENDING" and not requeued:  # why it waits: its priority, resources, or a hold of its own
                reason = _pending_reason(job_id)
                held = f"; `scontrol release {job_id}` starts it" if reason in HELD_REASONS else ""
                note = f" ({reason}{held})" if reason else ""
            print(f"[loom submit] job {job_id}: {state}{note}", file=out, flush=True)
            last_state, ran = state, ran or state == "RUNNING"
        if log.exists():
            with open(log, "rb") as f:
                if f.seek(0, os.SEEK_END) < offset:  # a requeued job's log started again
                    offset = 0
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            out.write(chunk.decode(errors="replace"))
            out.flush()
        if state in TERMINAL_STATES:
            return state
        if state == "UNKNOWN":  # neither squeue nor sacct knows it (any more)
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since > 30:
                return state
        else:
            unknown_since = None
        time.sleep(poll_s)

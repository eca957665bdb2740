"""`loom submit`: the training of `loom train`, as one Slurm job through submitit.

Submission (login node): every check that can fail is made before anything is submitted (the
config, the world size against nodes x tasks, the run directory, the partition), then a submitit
SlurmExecutor is built from structured options (nothing is pasted into a shell line) and the job
is submitted with its logs in RUN_DIR/slurm/. `--wait` then follows rank 0's log until the job ends.

In the job (launch/slurm_jobs.py), each Slurm task is one rank: submitit's job environment gives the rendezvous
(MASTER_ADDR/PORT from the node list and job id, RANK, LOCAL_RANK, WORLD_SIZE), launch.env picks
NCCL and the GPU of the local rank (gloo on CPU). Stop signals become checkpoints at the next
step boundary, agreed by all ranks (a sharded checkpoint is a collective, so submitit's own
rank-0-only requeue handler cannot take it):
  SIGUSR2 (Slurm's warning `--signal-delay-s` before the time limit, or a preemption signal):
      checkpoint, then rank 0 requeues the job; the requeued job resumes from `latest`.
  SIGTERM (scancel, `scontrol requeue`, preemption): checkpoint and stop.
A rank that fails writes its error, rank and host to RUN_DIR/slurm/failures/, and srun's
--kill-on-bad-exit ends the other ranks at once; `--wait` prints the earliest failure.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.run_dir import checkpoints_of
from loom.launch.slurm_jobs import JOBS_FILE, TrainingJob, check_no_job_queued, newest_checkpoint, slurm_dir

SBATCH_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")
# The options loom sets itself; --sbatch may not override them (it would break rendezvous, logs, the requeue that
# chains long runs, or a loom submit flag whose value would be silently replaced or ignored): the flag for each.
RESERVED_SBATCH_KEYS = {
    **dict.fromkeys(("output", "error", "open-mode", "array", "wrap", "ntasks", "export", "requeue", "no-requeue")),
    **{
        key: f"--{key}"
        for key in ("nodes", "cpus-per-task", "gpus-per-node", "time", "job-name", "exclusive")
        + ("partition", "account", "qos", "constraint")
    },
    "ntasks-per-node": "--tasks-per-node",
    "signal": "--signal-delay-s",
    "mem": "--mem-gb",
}
# Options that change what sbatch prints (or make it print something else and submit nothing), which submitit reads
# for the job's id: with --parsable it failed with a traceback after the job was queued, unrecorded.
SBATCH_REPLY_KEYS = ("parsable", "test-only", "wait", "quiet", "help", "usage", "version")
MAX_TIME_MINUTES = 366 * 1440  # past a year is a typo; partitions cap it far lower


@dataclass
class SlurmOptions:
    """What the job asks Slurm for (the `loom submit` flags)."""

    nodes: int = 1
    tasks_per_node: int = 1
    """One rank per task; on GPU clusters one task per GPU."""
    gpus_per_node: int | None = None
    """None: tasks_per_node when the partition has GPUs (or train.device = cuda), else none."""
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    time_minutes: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None
    """Defaults to train.name."""
    signal_delay_s: int = 120
    """SIGUSR2 arrives this long before the time limit: checkpoint and requeue (chains long runs)."""
    sbatch: dict[str, str] = field(default_factory=dict)
    """Further sbatch options as key -> value, e.g. {"mail-type": "END"}; "true" gives a bare flag."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def parse_time_minutes(text: str) -> int:
    """Slurm's time formats: MINUTES, HH:MM:SS, MM:SS, D-HH[:MM[:SS]]."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise ConfigError(f"--time {text!r} is not a Slurm time (MINUTES, HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = match.groups()
    if days is None and b is None:
        minutes = int(a)
    elif days is None and c is None:
        minutes = int(a) + (int(b) > 0)  # MM:SS, seconds rounded up
    else:
        hours, mins, secs = int(a), int(b or 0), int(c or 0)
        minutes = int(days or 0) * 1440 + hours * 60 + mins + (secs > 0)
    if minutes <= 0:
        raise ConfigError(f"--time {text!r} must be positive")
    if minutes > MAX_TIME_MINUTES:
        raise ConfigError(f"--time {text!r} is {minutes / 1440:,.0f} days; give at most 366-00:00:00 (a typo?)")
    return minutes


def _has_control_character(value: str) -> bool:
    """A newline or other control character would end the script's #SBATCH line early."""
    return any(ord(ch) < 32 for ch in value)


def parse_sbatch_options(pairs: list[str]) -> dict[str, str | bool]:
    """KEY=VALUE pairs for sbatch, checked so that none can add a line or a command to the script."""
    options: dict[str, str | bool] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not SBATCH_KEY.match(key):
            raise ConfigError(
                f"--sbatch {pair!r}: give KEY=VALUE with a lower-case sbatch option name, e.g. --sbatch mail-type=END"
            )
        if key.replace("_", "-") in SBATCH_REPLY_KEYS:
            raise ConfigError(
                f"--sbatch {key}: it changes what sbatch replies, which loom reads to learn the job's id; drop it"
            )
        if key.replace("_", "-") in RESERVED_SBATCH_KEYS:
            flag = RESERVED_SBATCH_KEYS[key.replace("_", "-")]
            instead = f"use loom submit's {flag}" if flag else "a job needs loom's value"
            raise ConfigError(f"--sbatch {key}: loom sets this option itself; {instead}")
        if _has_control_character(value):
            raise ConfigError(f"--sbatch {key}: the value contains a control character (newline?)")
        options[key] = True if value.lower() == "true" else value
    return options


def _slurm_command(args: list[str], timeout_s: float = 60) -> str:
    if shutil.which(args[0]) is None:
        raise ConfigError(
            f"`{args[0]}` is not on PATH: loom submit runs where Slurm's commands do "
            f"(a login node); use `loom train --nproc N` on a single machine"
        )
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"`{' '.join(args)}` did not answer within {timeout_s:g} s (is slurmctld running?)") from None
    if result.returncode != 0:
        lines = (result.stderr.strip() or result.stdout.strip() or f"exit code {result.returncode}").splitlines()
        advice = ""
        if "configuration source" in lines[-1] or "Unable to contact slurm controller" in lines[-1]:
            advice = (
                ": no Slurm cluster answers here (no slurm.conf, or slurmctld is down); run loom submit on a "
                "login node, or `loom train --nproc N` on this machine"
            )
        raise ConfigError(f"`{' '.join(args)}` failed: {lines[-1]}{advice}")
    return result.stdout


def slurm_unavailable() -> str | None:
    """Why this machine cannot submit to a Slurm cluster now, or None when it can."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no sbatch/sinfo on PATH"
    try:
        _slurm_command(["sinfo", "-h", "-o", "%P"], timeout_s=15)
    except ConfigError as error:
        return str(error)
    return None


def partition_gpus(partition: str | None) -> int:
    """GPUs per node the partition advertises (its GRES), checking that the partition exists."""
    listing = _slurm_command(["sinfo", "-h", "-o", "%P|%G"])  # %P marks the default partition with '*'
    partitions: dict[str, int] = {}
    default = None
    for line in listing.splitlines():
        name, _, gres = line.partition("|")
        if name.endswith("*"):
            name = default = name.rstrip("*")
        found = re.search(r"gpu(?::[^:,(]+)?:(\d+)", gres)
        partitions[name] = max(partitions.get(name, 0), int(found.group(1)) if found else 0)
    if partition is None:
        partition = default
        if partition is None:
            raise ConfigError(
                "this cluster has no default partition; pass --partition (sinfo lists: "
                f"{', '.join(sorted(partitions))})"
            )
    if partition not in partitions:
        raise ConfigError(f"partition {partition!r} does not exist; sinfo lists: {', '.join(sorted(partitions))}")
    return partitions[partition]


def job_gpus_per_node(options: SlurmOptions, config: LoomConfig, gpus_on_partition: int) -> int:
    """GPUs the job asks for on each node: --gpus-per-node, else one per task when it trains on CUDA."""
    if options.gpus_per_node is not None:
        return options.gpus_per_node
    wants_gpu = config.train.device == "cuda" or (config.train.device == "auto" and gpus_on_partition > 0)
    return options.tasks_per_node if wants_gpu else 0


def executor_parameters(options: SlurmOptions, config: LoomConfig, gpus_on_partition: int) -> dict:
    """The keyword arguments of submitit.SlurmExecutor.update_parameters for this job."""
    gpus = job_gpus_per_node(options, config, gpus_on_partition)
    if config.train.device == "cuda" and gpus < options.tasks_per_node:
        raise ConfigError(
            f"train.device = cuda needs one GPU per task: --gpus-per-node {gpus} < "
            f"--tasks-per-node {options.tasks_per_node}"
        )
    parameters = {
        "nodes": options.nodes,
        "ntasks_per_node": options.tasks_per_node,
        "time": options.time_minutes,
        "job_name": options.job_name or config.train.name,
        "signal_delay_s": options.signal_delay_s,
        "stderr_to_stdout": True,
        # One failed rank ends the job step at once instead of leaving its peers in a collective.
        "srun_args": ["--kill-on-bad-exit=1"],
        # The job requeues itself on SIGUSR2; clusters may default to non-requeueable jobs.
        "additional_parameters": {"requeue": True, **options.sbatch},
    }
    optional = {
        "gpus_per_node": gpus or None,
        "cpus_per_task": options.cpus_per_task,
        "partition": options.partition,
        "account": options.account,
        "qos": options.qos,
        "constraint": options.constraint,
        "exclusive": options.exclusive or None,
        "mem": f"{int(options.mem_gb * 1024)}MB" if options.mem_gb else None,
    }
    parameters.update({k: v for k, v in optional.items() if v is not None})
    return parameters


def _check_time_limit(options: SlurmOptions) -> None:
    """A time limit that leaves the checkpoint signal (sent --signal-delay-s before it) room to be seen."""
    if options.time_minutes * 60 < options.signal_delay_s + 60:
        raise ConfigError(
            f"--time gives {options.time_minutes} min (Slurm counts whole minutes), which leaves no room before the "
            "checkpoint signal "
            f"(--signal-delay-s {options.signal_delay_s}); Slurm checks the signal only every 30 s, "
            f"so keep the limit above delay + 60 s"
        )


def _absolute_paths(config: LoomConfig) -> None:
    """Pin relative paths to the submission directory (the job may start elsewhere)."""
    config.train.run_dir = str(Path(config.train.run_dir).resolve())
    config.data.paths = [str(Path(p).resolve()) for p in config.data.paths]
    if config.data.tokenizer:
        config.data.tokenizer = str(Path(config.data.tokenizer).resolve())
    if config.checkpoint.load:
        config.checkpoint.load = str(Path(config.checkpoint.load).resolve())


def _warn_if_it_does_not_fit(config: LoomConfig, partition: str | None) -> None:
    """The planner's view before the job waits in the queue: a warning (not a refusal: the planner has blind
    spots) when the layout needs more memory than the GPU kind the partition's name suggests, or an H100's."""
    from loom.tools.plan import gpu_kind, predicted_line

    line, estimate = predicted_line(config, gpu_kind(partition or "") or "h100-sxm")
    if config.train.device != "cpu" and not estimate.fits:
        print(f"warning: {line}", flush=True)


def submit(config: LoomConfig, options: SlurmOptions):
    """Check everything, then submit; returns the submitit job."""
    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.preflight import preflight, removed_if_left_empty
    from loom.engine.run_lock import RunLock

    if options.nodes < 1 or options.tasks_per_node < 1:
        raise ConfigError("--nodes and --tasks-per-node must be >= 1")
    try:
        config.resolve_world(options.world_size)
    except ConfigError as error:
        raise ConfigError(
            f"the allocation has {options.nodes} node(s) x {options.tasks_per_node} task(s) = "
            f"{options.world_size} ranks, but {error} (--nodes x --tasks-per-node ranks)"
        ) from None
    for flag, value in (
        ("job-name", options.job_name),
        ("partition", options.partition),
        ("account", options.account),
        ("qos", options.qos),
        ("constraint", options.constraint),
    ):
        if value is not None and _has_control_character(value):
            raise ConfigError(f"--{flag}: the value contains a control character (newline?)")
    _check_time_limit(options)  # the submission's own settings before asking the cluster
    gpus = partition_gpus(options.partition)  # then: without a reachable cluster nothing else matters
    run_dir = Path(config.train.run_dir)
    check_no_job_queued(run_dir)  # before preflight, which may move a run aside (--train.overwrite)
    with removed_if_left_empty(run_dir):
        job_gpus = job_gpus_per_node(options, config, gpus)
        preflight(config, options.world_size, ranks_have_cuda=job_gpus > 0 and config.train.device != "cpu")
        _check_something_to_train(config)
        check_same_tokenizer(config.data.paths, config.data.tokenizer)  # the dataset's manifest knows
        _warn_if_it_does_not_fit(config, options.partition)
        parameters = executor_parameters(options, config, gpus)
        _absolute_paths(config)
        _warn_what_the_job_changes(config)
        lock = RunLock(run_dir, command="submit")  # a rival submit or train is refused until the job is recorded
        job = None
        try:
            check_no_job_queued(run_dir)  # again, under the lock: a rival may have recorded its job since
            job = _submit_and_record(config, options, parameters)
        finally:
            lock.close(remove_if_created=job is None)  # before the job's rank 0 needs it
    return job


def _submit_and_record(config: LoomConfig, options: SlurmOptions, parameters: dict):
    import submitit

    from loom.engine.config_io import config_to_dict

    folder = slurm_dir(config.train.run_dir)
    earlier = set(folder.rglob("*")) if folder.is_dir() else None
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**parameters)
    try:  # submitit prints sbatch's stderr on failure; the error below says it in one line instead
        with contextlib.redirect_stderr(io.StringIO()):
            job = executor.submit(TrainingJob(config_to_dict(config)))
    except submitit.core.utils.FailedJobError as error:  # sbatch's own refusal, e.g. too much memory
        _remove_new_files(folder, earlier)  # the batch script and pickled job of a job that never was
        lines = [line.removeprefix("sbatch: error: ") for line in str(error).strip().splitlines()]
        raise ConfigError(f"sbatch refused the job: {'; '.join(lines)}") from None
    except submitit.core.utils.FailedSubmissionError as error:  # a reply without the job's id (a wrapped sbatch?)
        _remove_new_files(folder, earlier)
        quoted = re.search(r'sbatch output "(.*)"', str(error), re.DOTALL)
        reply = " ".join((quoted.group(1) if quoted else str(error)).split())
        raise ConfigError(
            f"sbatch's reply {reply!r} names no job; if a job was queued (squeue --me), scancel it: nothing records "
            "it in the run directory"
        ) from None
    record = {"job_id": job.job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "options": asdict(options)}
    with open(folder / JOBS_FILE, "a") as jobs:
        jobs.write(json.dumps(record) + "\n")
    return job


def _check_something_to_train(config: LoomConfig) -> None:
    """A run complete at train.steps would take an allocation (and its wait in the queue) to say so."""
    from loom.engine.preflight import run_is_complete

    run_dir = Path(config.train.run_dir)
    own = newest_checkpoint(run_dir)
    if own is not None and own.step >= config.train.steps:
        raise ConfigError(run_is_complete(run_dir, own.step, config.train.steps, ", so nothing was submitted"))


def _warn_what_the_job_changes(config: LoomConfig) -> None:
    """The resume's warnings (another schedule, data order, training settings, model), said where the user submits:
    they were only in the job's log, read by no one who submitted without --wait. A job trains on from the step of
    the checkpoint it loads, its run's own or checkpoint.load's, unless it fine-tunes from the latter."""
    from loom.engine.checkpoint.format import checkpoint_to_resume
    from loom.engine.checkpoint.load import fine_tunes_from
    from loom.engine.checkpoint.saved_settings import resume_warnings

    own = checkpoints_of(config.train.run_dir)
    found = checkpoint_to_resume(own, config.checkpoint.load, verify_hashes=False, warn=lambda _: None)
    if found is not None:
        for warning in resume_warnings(*found, config, continues_run=not fine_tunes_from(config, found[0])):
            print(f"warning: {warning}", file=sys.stderr, flush=True)


def _remove_new_files(folder: Path, earlier: set[Path] | None) -> None:
    """Remove what appeared under `folder` since `earlier` was listed (None: the folder itself is new)."""
    appeared = sorted(set(folder.rglob("*")) - (earlier or set()), reverse=True) if folder.is_dir() else []
    for path in appeared + ([folder] if earlier is None else []):
        with contextlib.suppress(OSError):
            path.rmdir() if path.is_dir() else path.unlink()

"""`loom submit`'s command line: its options (structured Slurm options, then config overrides as in `loom train`),
and what it prints while it follows the job. The submission itself is launch/slurm.py."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from loom.engine.names_elsewhere import SUBMIT_LAUNCH_NAMES, TRAINING_NAMES
from loom.engine.run_dir import metrics_of
from loom.launch.arguments import float_in, int_in
from loom.launch.local import SIGNAL_CAUSES, rank_failure
from loom.launch.slurm import SlurmOptions, parse_sbatch_options, parse_time_minutes, submit
from loom.launch.slurm_jobs import (
    first_failure,
    follow,
    killed_task,
    rank0_log,
    saved_so_far,
    stopped_by_a_signal,
    unfinished_by_exit_after,
)


def add_parser(commands) -> None:
    submit_parser = commands.add_parser(
        "submit",
        help="submit the training to Slurm (submitit); requeues on preemption, resumes itself",
        description="Submit `loom train` as one Slurm job: nodes x tasks-per-node ranks, one per task. "
        "Logs go to RUN_DIR/slurm/. Before the time limit (and on SIGUSR2 preemption) the job "
        "checkpoints and requeues itself, and every (re)start resumes from the run's latest "
        "checkpoint, so long runs chain jobs. Config overrides work as in `loom train`.",
        epilog="Example:\n  loom submit --config configs/llama-8b.toml --nodes 4 --tasks-per-node 8 "
        "--partition gpu --time 24:00:00 --parallel.tp 8 --wait",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    submit_parser.add_argument("--config", required=True, help="TOML config, e.g. configs/tiny.toml")
    defaults = SlurmOptions()
    submit_parser.add_argument(
        "--nodes", type=int_in(1, 100_000), default=defaults.nodes, help="nodes (default %(default)s)"
    )
    submit_parser.add_argument(
        "--tasks-per-node",
        type=int_in(1, 1024),
        default=defaults.tasks_per_node,
        help="ranks per node; the world size nodes x tasks must match the config's layout",
    )
    submit_parser.add_argument(
        "--gpus-per-node", type=int_in(0, 64), help="default: tasks-per-node where the partition has GPUs, else none"
    )
    submit_parser.add_argument(
        "--cpus-per-task", type=int_in(1, 4096), help="CPU cores per rank (also torch's thread count)"
    )
    submit_parser.add_argument("--mem-gb", type=float_in(0, 1e7, low_open=True), help="memory per node in GB")
    submit_parser.add_argument(
        "--time",
        default=str(defaults.time_minutes),
        help="time limit: MINUTES, HH:MM:SS or D-HH:MM:SS (default %(default)s)",
    )
    submit_parser.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    submit_parser.add_argument("--account", help="account to charge")
    submit_parser.add_argument("--qos", help="quality of service")
    submit_parser.add_argument("--constraint", help="node features, e.g. h100")
    submit_parser.add_argument("--exclusive", action="store_true", help="whole nodes, not shared with other jobs")
    submit_parser.add_argument("--job-name", help="default: train.name")
    submit_parser.add_argument(
        "--signal-delay-s",
        type=int_in(0, 86_400),
        default=defaults.signal_delay_s,
        help="seconds before the time limit at which the job checkpoints and requeues",
    )
    submit_parser.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option, repeatable, e.g. --sbatch mail-type=END",
    )
    submit_parser.add_argument("--wait", action="store_true", help="follow rank 0's log until the job ends")
    submit_parser.set_defaults(
        handler=cmd_submit, takes_overrides=True, names_elsewhere=TRAINING_NAMES + SUBMIT_LAUNCH_NAMES
    )


def cmd_submit(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.engine.config_io import load_config

    config = load_config(args.config, overrides)
    options = SlurmOptions(
        nodes=args.nodes,
        tasks_per_node=args.tasks_per_node,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        mem_gb=args.mem_gb,
        time_minutes=parse_time_minutes(args.time),
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        constraint=args.constraint,
        exclusive=args.exclusive,
        job_name=args.job_name,
        signal_delay_s=args.signal_delay_s,
        sbatch=parse_sbatch_options(args.sbatch),
    )
    job = submit(config, options)
    run_dir = Path(config.train.run_dir)
    print(
        f"submitted job {job.job_id}: {options.nodes} node(s) x {options.tasks_per_node} task(s), "
        f"tp={config.parallel.tp} pp={config.parallel.pp} dp={config.parallel.dp}\n"
        f"  rank 0 log: {rank0_log(run_dir, job.job_id)}\n  metrics:    {metrics_of(run_dir)}\n"
        f"  follow:     tail -f {shlex.quote(str(rank0_log(run_dir, job.job_id)))}    cancel: scancel {job.job_id}",
        flush=True,
    )
    if not args.wait:
        return
    try:
        state = follow(job.job_id, run_dir)
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job.job_id} keeps running (scancel {job.job_id} to end it)", file=sys.stderr)
        sys.exit(130)
    if state == "COMPLETED" and stopped_by_a_signal(job):
        print(
            f"error: job {job.job_id} ended COMPLETED, but a stop signal (SIGTERM without a requeue) ended its "
            f"training before train.steps = {config.train.steps}; its checkpoint is saved: submit the same command "
            "to continue",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    if state == "COMPLETED":
        unfinished = unfinished_by_exit_after(run_dir, config)
        if unfinished:
            print(f"job {job.job_id} ended COMPLETED {unfinished}", file=sys.stderr, flush=True)
            sys.exit(1)
        return
    failure = first_failure(run_dir, job.job_id)
    killed = killed_task(rank0_log(run_dir, job.job_id)) if state != "CANCELLED" else None
    if failure:
        cause = f": {rank_failure(failure['rank'], failure['host'], failure['message'])}"
    elif state == "CANCELLED":  # a SIGKILL srun reports after it is KillWait's, not the OOM killer's
        cause = " (scancel, or an administrator)"
    else:
        cause = f"; see {rank0_log(run_dir, job.job_id)}"
    if killed is not None and (failure is None or failure["rank"] != killed[0]):
        failure = None  # a peer's broken connection, after the killed rank died without a word
        task, host, name = killed
        cause = f": rank {task} on {host} was killed by {name}{SIGNAL_CAUSES.get(name, '')}"
    print(f"error: job {job.job_id} ended {state}{cause}{saved_so_far(run_dir, config)}", file=sys.stderr, flush=True)
    if failure and not failure.get("user_error", True):
        print(failure["traceback"], file=sys.stderr, end="", flush=True)
    sys.exit(1)

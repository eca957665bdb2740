"""The `loom` command: argument parsing, pre-flight checks and one-line errors; the work lives elsewhere.

Every subcommand is a thin function over engine/, data_tools/, tools/ or launch/. User errors
(loom.errors.LoomError: a bad config, missing data, corrupt files) print one line `error: ...` and
exit 2; a failing rank prints its rank, host and message and exits 1, followed by its traceback
when the error is not the user's. Anything else is a bug and keeps Python's traceback.
LOOM_DEBUG=1 shows tracebacks for user errors too.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import os
import signal
import sys
from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.config_io import is_override_flag, load_config, parse_overrides
from loom.engine.names_elsewhere import TRAIN_LAUNCH_NAMES, TRAINING_NAMES
from loom.engine.run_dir import SCHEDULE_CHART
from loom.errors import Interrupted, is_user_error, user_message
from loom.launch.arguments import OneLineParser, add_parallel_size, existing_dir, image_file, int_in

EPILOG_TRAIN = """\
Every config field can be overridden as --section.field value, for example
  loom train --config configs/tiny.toml --nproc 4 --parallel.tp 2 --train.steps 50
  loom train --config configs/tiny.toml --data.paths a b --data.weights 0.7 0.3
Sections: model, parallel, optim, data, train, checkpoint, lora (every field, its default and meaning:
docs/config.md, written from engine/config/; presets: configs/*.toml; --print-config shows the resolved config).
Megatron-LM's and torchtitan's names (--tensor-model-parallel-size, parallelism.tensor_parallel_degree) are
answered with loom's; the whole table ends docs/config.md.
Under torchrun or Slurm (RANK and WORLD_SIZE set) and without --nproc, this process is one rank.

Layouts: world = tp * cp * pp * dp; --parallel.vp V interleaves V chunks per pipeline stage (needs
micro-batches per step divisible by pp); --parallel.cp C splits each sequence over C ranks (ring attention;
rotary positions, no dropout, train.seq_length divisible by 2C). Optimizers (--optim.name): adamw, sgd, lamb,
adafactor. --optim.zero 1 shards master weights and optimizer state over DP (x CP) (ZeRO-1), --optim.zero 2
the gradients too (ZeRO-2), --optim.zero 3 the weights too (ZeRO-3: each block gathered around its use), for
adamw, sgd and lamb, with fp32, bf16 or fp16 (dynamic loss scaling) and any tp/cp/pp/vp; --optim.offload cpu
keeps master weights and optimizer state in host memory and steps there (alone or with ZeRO). adafactor
runs without either. --optim.grad_dtype bf16 accumulates and reduces gradients in bf16 (with
--train.precision bf16: 2 bytes per parameter instead of 4, half the DP traffic).
--model.compile auto (the default) compiles each block on CUDA; true/false force it.

LoRA: --lora.rank 8 --lora.base DIR trains low-rank adapters on a frozen base checkpoint (any layout, e.g.
from loom ckpt import-hf; [model] is taken from it, a RoPE model's positions may be raised) on --lora.targets
qkv proj fc1 fc2 with --lora.alpha; checkpoints hold the adapters; loom ckpt merge-lora folds them in. Any
lora.* setting without --lora.rank is refused: it would train a fresh model, not adapters.

Checkpoints: --checkpoint.interval N saves every N steps; the last step is saved too unless
--checkpoint.save_at_end false. A run resumes from its own newest checkpoint, else --checkpoint.load DIR,
training on from its step (with --checkpoint.finetune true: from its weights alone, at step 1)."""


def _prediction(config) -> str:
    """The planner's memory (and, on a GPU it knows, speed) for this run, printed before it starts; the first
    metrics rows then show the measured mem_gb and tokens_per_s beside it."""
    import torch

    from loom.tools.plan import gpu_kind, predicted_line

    on_cuda = config.train.device != "cpu" and torch.cuda.is_available()
    gpu = gpu_kind(torch.cuda.get_device_name()) if on_cuda else None
    line = predicted_line(config, gpu)[0]
    on_cpu = config.train.device == "cpu" or (config.train.device == "auto" and not torch.cuda.is_available())
    return line + "; on CPU the step lines' mem is each process's peak RSS instead" if on_cpu else line


def _parent_command() -> str:
    try:
        return Path(f"/proc/{os.getppid()}/comm").read_text().strip()
    except OSError:
        return ""


def _srun_tasks() -> int:
    """The tasks of the srun step of which this process is one (1 when it is none). A shell that srun started (`srun
    --pty bash` on an interactive node) hands the step's variables to all it runs, which are not its tasks: a task is
    started by slurmstepd itself."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if not tasks.isdigit() or int(tasks) < 2 or "SLURM_PTY_PORT" in os.environ:
        return 1
    return int(tasks) if _parent_command() in ("slurmstepd", "") else 1


def _layout(config: LoomConfig) -> str:
    """How a resolved config splits the model over its ranks, and where the run writes."""
    cp = f"cp={config.parallel.cp} " if config.parallel.cp > 1 else ""
    return (
        f"tp={config.parallel.tp} {cp}pp={config.parallel.pp} dp={config.parallel.dp}, run directory "
        f"{config.train.run_dir}"
    )


def _reached_the_last_step(config: LoomConfig) -> bool:
    """Whether the run's newest checkpoint is of train.steps (a stop agreed during the last step ends a finished
    run)."""
    from loom.launch.slurm_jobs import newest_checkpoint

    newest = newest_checkpoint(Path(config.train.run_dir))
    return newest is not None and newest.step >= config.train.steps


def _report_a_lost_peer(error: Exception, rank: int, config: LoomConfig) -> None:
    """Raise, for a torchrun or srun rank whose collective failed because another rank died or hung, the line the
    --nproc launcher would print (gloo's traceback named no rank and no checkpoint); the traceback stays in its
    details (shown with LOOM_DEBUG=1)."""
    import socket
    import traceback

    from loom.launch.local import RankFailed, collective_failure, describe_rank_error
    from loom.launch.slurm_jobs import saved_so_far

    if collective_failure(error) is None:
        return
    message, _ = describe_rank_error(error, config.parallel.timeout_minutes)
    where = saved_so_far(Path(config.train.run_dir), config, "start the same command on every node")
    raise RankFailed(rank, message + where, traceback.format_exc(), host=socket.gethostname())


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.parallel.rendezvous import start_rank_server
    from loom.engine.preflight import preflight, removed_if_left_empty
    from loom.launch.local import launch_local
    from loom.launch.slurm_jobs import check_no_job_queued

    config = load_config(args.config, overrides)
    given = [name for name in parse_overrides(overrides).get("lora", {}) if name != "rank"]
    if given and not config.lora.enabled:  # the config's own check sees only values that differ from the defaults
        raise ConfigError(
            f"--lora.{given[0]} is given but lora.rank is 0 (no adapters): add --lora.rank R (e.g. 8) to fine-tune "
            "with LoRA, or drop the lora settings to train the whole model"
        )
    external = args.nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    tasks = _srun_tasks()
    if not external and tasks > 1:  # else each task trained a run of its own
        raise ConfigError(
            f"this is task {os.environ.get('SLURM_PROCID', '?')} of {tasks} of an srun step, and each task would start "
            "a training run of its own: use `loom submit` (it starts one rank per task), or run one task "
            "(srun -n 1 loom train --nproc N), or torchrun in each task"
        )
    if external:  # one rank of torchrun or srun: checkpoint and stop on SIGTERM/Ctrl-C like --nproc does
        from loom.engine.preflight import preflight_of_a_rank, warn_settings_without_effect
        from loom.launch.env import StopSignals, rank_from_environment, run_rank

        rank, world = rank_from_environment()
        if rank == 0:  # else a leftover RANK/WORLD_SIZE made loom wait for peers in silence
            others = f", meeting the other {world - 1} at" if world > 1 else " at"
            print(
                f"loom train: rank 0 of {world} (RANK, WORLD_SIZE from the environment){others} "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                flush=True,
            )
            warn_settings_without_effect(config)
        preflight_of_a_rank(config)
        check_same_tokenizer(config.data.paths, config.data.tokenizer)  # as --nproc's launcher checks
        config.resolve_world(world)
        if rank == 0:
            print(f"loom train: {_layout(config)}", flush=True)
        stop = StopSignals.exit_on_terminate()
        try:
            run_rank(config, stop=stop)
        except Exception as error:
            _report_a_lost_peer(error, rank, config)
            raise
        if stop.exited_early and not _reached_the_last_step(config):  # torchrun or a script must not see success
            raise SystemExit(128 + signal.Signals[stop.received or "SIGTERM"])
        return
    nproc = args.nproc or 1
    if args.print_config:
        from loom.engine.config_io import config_to_toml
        from loom.engine.preflight import adopt_lora_base, adopt_settings_of_the_checkpoint_to_resume

        adopt_lora_base(config)
        adopt_settings_of_the_checkpoint_to_resume(config, say=False)
        try:
            config.resolve_world(nproc)
        except ConfigError as error:
            if args.nproc is not None:
                raise
            raise ConfigError(f"{error}; the resolved config depends on the world size: add --nproc N") from None
        print(config_to_toml(config), end="")
        return
    start_rank_server()  # its imports overlap the checks below
    check_no_job_queued(Path(config.train.run_dir))
    with removed_if_left_empty(Path(config.train.run_dir)):
        preflight(config, nproc)
        check_same_tokenizer(config.data.paths, config.data.tokenizer)  # the dataset's manifest knows
        print(f"loom train: {nproc} rank(s), {_layout(config)}", flush=True)
        print(_prediction(config), flush=True)
        launch_local(config, nproc)


def cmd_schedule(args: argparse.Namespace) -> None:
    from loom.tools.charts import claim_chart_file
    from loom.tools.schedule_plot import describe, draw, load_measured

    measured = None
    if args.from_run:
        flags = (("--parallel.pp (--pp)", args.pp), ("--microbatches", args.microbatches), ("--parallel.vp", args.vp))
        given = [flag for flag, value in flags if value and (flag != "--parallel.vp" or value != 1)]
        if given:
            raise ConfigError(
                f"--from-run draws the run's own layout; drop {' and '.join(given)}, or drop --from-run to draw another"
            )
        layout, measured = load_measured(Path(args.from_run))
        args.pp, args.vp, args.microbatches = layout["pp"], layout["vp"], layout["microbatches"]
    elif args.pp is None or args.microbatches is None:
        raise ConfigError("give --parallel.pp and --microbatches (and --parallel.vp), or --from-run RUN_DIR")
    from loom.engine.pipeline.schedules import ScheduleError

    if args.output:
        claim_chart_file(Path(args.output), "--output", args.overwrite, "schedule")
    try:
        text, _ = describe(args.pp, args.vp, args.microbatches)
    except ScheduleError as error:
        raise ConfigError(str(error)) from None
    print(text)
    if args.output or measured:
        output = Path(args.output or Path(args.from_run) / SCHEDULE_CHART)
        draw(args.pp, args.vp, args.microbatches, output, measured)
        print(f"wrote {output}")


def build_parser() -> argparse.ArgumentParser:
    from loom.launch import cli_bench, cli_ckpt, cli_data, cli_plan, cli_submit, demo

    parser = OneLineParser(prog="loom", description="3D-parallel LLM training: data tools, training, launch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train a model (locally, or as one rank under torchrun/Slurm)",
        epilog=EPILOG_TRAIN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", required=True, help="TOML config, e.g. configs/tiny.toml")
    train.add_argument("--nproc", type=int_in(1, 1024), help="spawn this many local ranks (gloo on CPU, NCCL on GPU)")
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (the defaults, then the --config preset or file, then the flags, then the "
        "derived fields; as config.toml) and exit",
    )
    train.set_defaults(handler=cmd_train, takes_overrides=True, names_elsewhere=TRAINING_NAMES + TRAIN_LAUNCH_NAMES)

    schedule = commands.add_parser(
        "schedule",
        help="print and draw a pipeline schedule with its bubble",
        description="Print each pipeline rank's forwards (F) and backwards (B) as "
        "microbatch[.chunk], the bubble (idle time over ideal compute) and the activations held, "
        "and draw a Gantt chart.",
    )
    add_parallel_size(schedule, "pp", "pipeline stages")
    add_parallel_size(schedule, "vp", "virtual stages (chunks) per rank; >1 interleaves", default=1)
    schedule.add_argument("--microbatches", type=int_in(1, 100_000), help="micro-batches per step")
    schedule.add_argument("--output", type=image_file, help="PNG (or PDF, SVG) file for the Gantt chart")
    schedule.add_argument(
        "--overwrite", action="store_true", help="replace --output even if it is not a chart `loom schedule` drew"
    )
    schedule.add_argument(
        "--from-run",
        type=existing_dir,
        help="run directory trained with --train.record_pipeline_timeline true: "
        "draw its measured timeline next to the ideal one",
    )
    schedule.set_defaults(handler=cmd_schedule)

    demo.add_parser(commands)
    cli_data.add_parser(commands)
    cli_ckpt.add_parsers(commands)
    cli_submit.add_parser(commands)
    cli_bench.add_parser(commands)
    cli_plan.add_parser(commands)
    return parser


def _stop_now(signum: int, frame, trains: bool = False) -> None:
    from loom.launch.local import Stopped, stopped_before_a_checkpoint

    name = signal.Signals(signum).name  # a training launcher, once running, says itself what was saved
    raise stopped_before_a_checkpoint(name) if trains else Stopped(name, f"stopped by {name}")


def _invoked_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's own parser, whose --help lists what it takes."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if chosen not in (sub.choices if sub is not None else {}):
            return parser
        parser = sub.choices[chosen]


def main(argv: list[str] | None = None) -> None:
    # Until a command installs its own handling (the launcher forwards stops to its ranks), a stop signal
    # ends the command through Python, so cleanups run and the user is told, instead of a silent kill. Everything
    # after it is inside the handling below: a stop while the parser is built is a stop too, not a traceback.
    caller_handler = signal.signal(signal.SIGTERM, _stop_now)
    for stream in (sys.stdout, sys.stderr):  # an ASCII locale: decoded text printed as escapes, not a traceback
        if hasattr(stream, "reconfigure") and codecs.lookup(stream.encoding or "utf-8").name != "utf-8":
            stream.reconfigure(errors="backslashreplace")
    try:
        _run_command(argv)
    except Interrupted as error:  # the launchers' Stopped, and _stop_now's
        print(str(error), file=sys.stderr)
        sys.exit(getattr(error, "exit_code", 130))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # `loom ... | head` closed the pipe: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        sys.exit(141)
    except Exception as error:
        from loom.launch.local import RankFailed

        if isinstance(error, RankFailed):
            print(f"error: {error}", file=sys.stderr)
            if error.details and (not error.user_error or os.environ.get("LOOM_DEBUG")):
                print(f"traceback of rank {error.rank}{f' on {error.host}' if error.host else ''}:", file=sys.stderr)
                print(error.details, file=sys.stderr, end="")
            sys.exit(1)
        if not is_user_error(error) or os.environ.get("LOOM_DEBUG"):
            raise  # a bug: Python's traceback, not a one-line message that would blame the user
        print(f"error: {user_message(error)}", file=sys.stderr)
        sys.exit(2)
    finally:  # called in a script or notebook: a later SIGTERM raised our Stopped there, which `except Exception` ate
        signal.signal(signal.SIGTERM, caller_handler)


# The commands that import torch. A Ctrl-C that lands inside torch's native initialisation aborts the process
# ("terminate called after throwing an instance of 'pybind11::error_already_set'", exit 134) instead of raising
# KeyboardInterrupt, so these import it first with the stop signals held: one that came meanwhile is delivered
# right after, and the command stops as usual.
TORCH_COMMANDS = ("train", "demo", "eval", "generate", "ckpt", "submit", "bench")


def _import_torch_with_stops_held() -> None:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _check_inductor_cache_dir() -> None:
    """torch._dynamo (which loom's model and trainer import) makes TORCHINDUCTOR_CACHE_DIR on import: an unwritable
    one failed every command that trains as '/proc/x: No such file or directory', naming neither the variable nor
    the cause."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"TORCHINDUCTOR_CACHE_DIR={folder} cannot be made ({error.strerror}), and torch makes it on import: point "
            "it at a writable folder, or unset it"
        ) from None


def _check_arguments_spellable(argv: list[str]) -> None:
    """Under an ASCII locale with Python's UTF-8 mode turned off (LC_ALL=POSIX PYTHONUTF8=0) a non-ASCII argument
    arrives as undecodable bytes: a run name with one crashed TensorBoard's writer, and config.toml's writer after
    it, once the run had started. The commands that write those are refused it up front."""
    encoding = sys.getfilesystemencoding()
    if codecs.lookup(encoding).name != "ascii" or not argv or argv[0] not in ("train", "submit", "demo"):
        return
    for argument in argv:
        if not argument.isascii():
            shown = os.fsencode(argument).decode("utf-8", "replace")
            raise ConfigError(
                f"the argument {shown!r} is not ASCII, and this locale's filesystem encoding is {encoding}, in which "
                "loom's files cannot name or hold it: set PYTHONUTF8=1 (or LC_ALL=C.UTF-8), or use ASCII names"
            )


def _run_command(argv: list[str] | None) -> None:
    _check_arguments_spellable(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "demo"):
        signal.signal(signal.SIGTERM, functools.partial(_stop_now, trains=True))
    if args.command in TORCH_COMMANDS:
        _check_inductor_cache_dir()
        _import_torch_with_stops_held()
    takes_overrides = getattr(args, "takes_overrides", False)
    unknown = [a for a in extra if a.startswith("--") and not is_override_flag(a)] if takes_overrides else extra
    if takes_overrides and extra and not extra[0].startswith("--"):
        unknown.insert(0, extra[0])
    if unknown:
        _invoked_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if takes_overrides:
        args.handler(args, extra)
    else:
        args.handler(args)


if __name__ == "__main__":
    main()

"""`loom train --nproc N`: start N ranks on this machine and supervise them.

Each rank is a process forked from a fork server that has imported torch and loom once
(engine/parallel/rendezvous.py), with the launcher's environment, working directory and output, plus
torchrun-style variables. The parent waits on
all of them; the first one to fail makes the others stop (SIGTERM, then SIGKILL) and its error,
with its rank, is what the user sees. SIGTERM or Ctrl-C to the parent is passed to the ranks,
which checkpoint at the next step boundary and exit; a second one stops them at once. CPU threads
are divided among the ranks so N ranks on a few cores do not oversubscribe them.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing import reduction

from loom.engine.config import LoomConfig
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.parallel.rendezvous import end_ranks, host_rendezvous, rank_context
from loom.engine.run_dir import checkpoints_of, metrics_of
from loom.errors import Interrupted, is_user_error, user_message


def rank_failure(rank: int, host: str, message: str) -> str:
    """`rank R on HOST failed: MESSAGE`, the line a launcher reports a rank's error in. A failure the ranks agreed
    on names the rank it was found on: said once where that is this one."""
    who = f"rank {rank}{f' on {host}' if host else ''}"
    return f"{who} failed: {message.removeprefix(f'{who}: ')}"


class RankFailed(RuntimeError):
    """A rank's error as the launcher reports it: one line, plus the traceback when it is not the user's to fix."""

    def __init__(self, rank: int, message: str, details: str, user_error: bool = True, host: str = ""):
        super().__init__(rank_failure(rank, host, message))
        self.rank, self.details, self.user_error, self.host = rank, details, user_error, host


class Stopped(Interrupted):
    """The run was stopped by a signal, after the ranks checkpointed (or before training began)."""

    def __init__(self, signal_name: str, message: str):
        super().__init__(message)
        self.exit_code = 128 + signal.Signals[signal_name].value


def _first_line(error: BaseException) -> str:
    return user_message(error).splitlines()[0] if str(error) else type(error).__name__


# How gloo says that the rank at the other end of a connection is gone (its process ended mid-collective). Under
# NCCL a dead peer shows as a collective timeout, or the watchdog aborts the rank (SIGABRT, SIGNAL_CAUSES).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing")


def collective_failure(error: BaseException) -> str | None:
    """ "timeout" or "peer lost" for a collective that failed because of another rank (torch.distributed raises
    RuntimeErrors; its store, TimeoutErrors), else None: the user's own errors and other errors are what they say."""
    if is_user_error(error) or not isinstance(error, (RuntimeError, TimeoutError)):
        return None
    message = _first_line(error)
    if "timed out" in message.lower() or "timeout" in type(error).__name__.lower():
        return "timeout"
    return "peer lost" if any(phrase in message for phrase in PEER_LOST) else None


def describe_rank_error(error: BaseException, timeout_minutes: float) -> tuple[str, bool]:
    """(one line for a rank's failure, whether it is the user's to fix). A collective timeout is named as
    what it usually means (a peer died or hung), a closed connection as a peer gone; both count as the user's:
    the cause is on another rank."""
    message, failure = _first_line(error), collective_failure(error)
    if failure == "timeout":
        return (
            f"a collective timed out after {timeout_minutes:g} min: a peer rank stopped answering "
            f"(crashed, hung or killed); parallel.timeout_minutes sets the limit [{message}]"
        ), True
    if failure == "peer lost":
        said = re.sub(r"^\[[^\]]*\] ", "", message).split(". ")[0]  # gloo's source position and its advice left out
        return f"a peer rank ended mid-collective (it crashed or was killed: its own output says why) [{said}]", True
    if is_user_error(error):
        return message, True
    return f"{type(error).__name__}: {message}", False


class _InheritedFd:
    """A file descriptor of the launcher handed to a rank (through the fork server's fd passing): a rank
    writes to the launcher's stdout/stderr of now, not those of whoever started the server."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _InheritedFd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(duplicate) -> int:
        return duplicate.detach()


def _adopt_launcher_process(environ: dict, cwd: str, stdout: int, stderr: int) -> None:
    """Take the launcher's environment, working directory and output, as a spawned rank would have them."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)


def _die_with_launcher(launcher_pid: int) -> None:
    """A launcher killed with SIGKILL cannot stop its ranks: each rank watches it and exits when it is gone.
    (PR_SET_PDEATHSIG would watch the fork server, which in turn lives as long as any rank does.)"""

    def watch() -> None:
        while True:
            try:
                os.kill(launcher_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _rank_main(
    rank: int,
    world: int,
    rendezvous: dict[str, str],
    raw_config: dict,
    threads: int,
    errors,
    stops,
    mode: str,
    launcher_pid: int,
    launcher_process: tuple,
    launcher_stop,
) -> None:
    # A stop that arrives while the rank starts must not kill it with the default action: keep it for
    # the trainer, which then checkpoints after the first step.
    early_stops: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, frame: early_stops.append(received))
    # A signal that reached this process before Python's fork handling ran was dropped with the parent's pending
    # ones (the launcher can signal a rank before the rank has run at all). The launcher writes its stop here
    # before it signals the ranks, and this is read after the handlers are in place: no stop falls between.
    if launcher_stop.value:
        early_stops.append(launcher_stop.value)
    _die_with_launcher(launcher_pid)
    _adopt_launcher_process(*launcher_process)
    os.environ.update(rendezvous, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    from tqdm import tqdm

    from loom.launch.env import StopSignals, run_rank

    torch.set_num_threads(threads)
    # tqdm's bars share a multiprocessing lock, in a rank a named semaphore (its start method is the rank server's)
    # that the resource tracker reports as leaked under the launcher's message when the rank is stopped. A rank
    # draws no bars from other processes.
    tqdm.set_lock(threading.RLock())
    stop = None
    if mode == "train":
        stop = StopSignals.exit_on_terminate()
        if early_stops:
            stop.code = StopSignals.EXIT
            stop.received = signal.Signals(early_stops[0]).name
    else:  # an evaluation has nothing to save: a stop ends it at once (the launcher says so)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        if early_stops:
            os.kill(os.getpid(), early_stops[0])
    config = config_from_dict(raw_config)
    try:
        run_rank(config, mode, stop)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent
        message, user_error = describe_rank_error(error, config.parallel.timeout_minutes)
        errors.put((time.time(), rank, message, traceback.format_exc(), user_error, socket.gethostname()))
        raise SystemExit(1) from None
    if stop is not None and stop.exited_early:  # a signal to a rank alone: the launcher must not report a finished run
        stops.put((rank, stop.received))


def launch_local(config: LoomConfig, nproc: int, grace_s: float = 2.0, mode: str = "train") -> None:
    """Run training (or evaluation, mode "eval") on `nproc` local ranks; raises RankFailed with the
    first failing rank's error."""
    from loom.launch.env import check_local_ranks_fit_the_gpus

    check_local_ranks_fit_the_gpus(config, nproc)
    ctx = rank_context()
    errors, stops = ctx.Queue(), ctx.Queue()
    launcher_stop = ctx.RawValue("i", 0)  # the number of the first stop signal the launcher received
    store, rendezvous = host_rendezvous()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    raw = config_to_dict(config)
    launcher = (dict(os.environ), os.getcwd(), _InheritedFd(1), _InheritedFd(2))
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, nproc, rendezvous, raw, threads, errors, stops, mode, os.getpid(), launcher, launcher_stop),
            daemon=False,
        )
        for r in range(nproc)
    ]
    stop_signals: list[str] = []

    def forward_stop(signum: int, frame) -> None:
        if stop_signals:
            name = signal.Signals(signum).name
            raise Stopped(name, f"stopped at once by a second {name}: the ranks were killed without saving")
        stop_signals.append(signal.Signals(signum).name)
        launcher_stop.value = signum  # for the ranks not started yet, and those that miss the signal
        if mode == "train":
            print(
                f"{stop_signals[0]}: the ranks save a checkpoint at the next step boundary and stop; "
                f"send it again to stop at once without saving",
                file=sys.stderr,
                flush=True,
            )
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    running = {}
    try:
        for p in procs:
            p.start()
        running = {p.sentinel: (r, p) for r, p in enumerate(procs)}
        failed: list[tuple[int, int]] = []
        while running and not failed:
            for sentinel in multiprocessing.connection.wait(list(running)):
                rank, proc = running.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    failed.append((rank, proc.exitcode))
        # A rank killed by a signal reports nothing, and its peers' broken connections can reach the
        # launcher first: collect every rank already dead before the launcher stops the others.
        for rank, proc in list(running.values()):
            if not proc.is_alive():
                proc.join()
                del running[proc.sentinel]
                if proc.exitcode != 0:
                    failed.append((rank, proc.exitcode))
    except BaseException:
        end_ranks([p for _, p in running.values()], grace_s=0.0)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    end_ranks([p for _, p in running.values()], grace_s)
    del store  # hosted until every rank has ended
    if mode != "train" and (stop := stopped_rank(failed, "the evaluation", stop_signals[:1])):
        print(file=sys.stderr)  # ends the line of rank 0's progress bar, which the stopped rank could not end
        raise stop
    if stop_signals:
        raise _stopped(stop_signals[0], config, not failed)
    if failed:
        raise _first_error(errors, failed, _last_logged_step(config.train.run_dir))
    if stopped_ranks := _drain(stops, 0.1):
        rank, name = next(((r, n) for r, n in sorted(stopped_ranks) if n), stopped_ranks[0])
        raise _stopped(name or "SIGTERM", config, True, f" (sent to rank {rank})")


def _drain(queue, timeout: float) -> list:
    """What the ranks (all gone: their queue feeders flushed as they exited) put in `queue`."""
    items = []
    while True:
        try:
            items.append(queue.get(timeout=timeout))
        except Exception:  # queue.Empty
            return items


def _stopped(signal_name: str, config: LoomConfig, clean: bool, sent_to: str = "") -> Stopped:
    from loom.engine.checkpoint.format import LATEST

    latest = checkpoints_of(config.train.run_dir) / LATEST
    by = f"{signal_name}{sent_to}"
    if clean and latest.is_file():
        where = latest.parent / latest.read_text().strip()
        return Stopped(
            signal_name, f"stopped by {by}: checkpoint {where} saved; run the same command to resume from it"
        )
    return stopped_before_a_checkpoint(signal_name)


def stopped_rank(failed: list[tuple[int, int]], work: str, launcher_signals: list[str] = ()) -> Stopped | None:
    """The stop of work with nothing to save (an evaluation, a generation): by a signal to the launcher (the first
    of `launcher_signals`), or to one rank, which it ended (exit code -N, SIGTERM or SIGINT) -- not a failure."""
    if launcher_signals:
        return Stopped(launcher_signals[0], f"stopped by {launcher_signals[0]} before {work} finished")
    stops = {-signal.SIGTERM, -signal.SIGINT}
    for rank, exitcode in failed:
        if exitcode in stops:
            name = signal.Signals(-exitcode).name
            return Stopped(name, f"stopped by {name} (sent to rank {rank}) before {work} finished")
    return None


def stopped_before_a_checkpoint(signal_name: str) -> Stopped:
    """A training command stopped before its ranks wrote anything to resume from."""
    return Stopped(signal_name, f"stopped by {signal_name} before a checkpoint was written; nothing to resume")


def killed_rank(rank: int, exitcode: int, more: str = "") -> RankFailed:
    """A rank a signal ended (exit code -N), as every launcher reports one: the signal, and what usually sends it."""
    name = _signal_name(exitcode)
    return RankFailed(rank, f"killed by {name}{SIGNAL_CAUSES.get(name, '')}{more}", "")


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


# What usually sends each signal to a rank, for the one line that names the rank.
SIGNAL_CAUSES = {
    "SIGKILL": " (the kernel's OOM killer sends it when memory runs out; see dmesg)",
    "SIGABRT": (
        " (under NCCL, the watchdog aborts a rank whose collective timed out after parallel.timeout_minutes or "
        "failed: a peer died or hung; the rank's stderr names the collective)"
    ),
    "SIGSEGV": " (a crash in native code: a CUDA/NCCL driver or extension fault)",
    "SIGBUS": " (a memory-mapped file changed or its disk filled up)",
}


def _last_logged_step(run_dir: str) -> int | None:
    try:
        rows = metrics_of(run_dir).read_text().splitlines()
        return int(json.loads(rows[-1])["step"]) if rows else None
    except (OSError, ValueError, KeyError):
        return None


def _first_error(errors, failed: list[tuple[int, int]], last_step: int | None = None) -> RankFailed:
    """The root cause. A rank killed by a signal (exit code -N) is it: its peers' errors (connection
    reset, a collective timeout) follow from its death. Otherwise the earliest report: peers of a failed
    rank fail too, but only after it has reported and exited (their collectives break when its sockets close)."""
    reports = _drain(errors, 0.5)
    reported = {report[1] for report in reports}
    killed = [(rank, code) for rank, code in failed if code < 0 and rank not in reported]
    if killed:
        rank, code = killed[0]
        more = f"; the last step logged was {last_step}" if last_step is not None else ""
        if reports:
            consequences = "; ".join(f"rank {r}: {m}" for _, r, m, *_ in sorted(reports)[:2])
            more += f"; the other ranks then failed with it ({consequences})"
        return killed_rank(rank, code, more)
    if not reports:
        rank, code = failed[0]
        return RankFailed(rank, f"exited with code {code} without a Python error", "")
    _, first_rank, message, details, user_error, host = min(reports)
    return RankFailed(first_rank, message, details, user_error, host)

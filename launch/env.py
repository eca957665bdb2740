"""Rank start-up from the environment (torchrun's variables), shared by every launcher.

Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, picks the backend (NCCL on
CUDA, gloo otherwise), initialises torch.distributed with a bounded timeout so a dead peer
becomes an error instead of a hang, and runs one Trainer.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.cuda_env import computes_on_cuda, set_cuda_env_defaults
from loom.engine.metrics import perplexity
from loom.engine.run_lock import RunLock
from loom.errors import naming


def choose_backend(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if computes_on_cuda(device) else "gloo"


def check_local_ranks_fit_the_gpus(config: LoomConfig, nproc: int) -> None:
    """NCCL runs one rank per GPU: more ranks on this machine than it shows GPUs would share one and fail at the
    first collective with NCCL's own error, which names neither the cause nor the remedy."""
    if choose_backend(config.parallel.backend, config.train.device) != "nccl":
        return
    gpus = torch.cuda.device_count()
    if gpus == 0:
        if config.parallel.backend == "nccl":
            asked, advice = "parallel.backend = nccl", "--parallel.backend auto"
        else:
            asked, advice = f"train.device = {config.train.device}", "--train.device cpu"
        raise ConfigError(f"{asked} asks for NCCL ranks, but no CUDA device is visible; use {advice} (gloo ranks)")
    if nproc > gpus:
        raise ConfigError(
            f"--nproc {nproc} NCCL ranks on a machine that shows {gpus} GPU(s): NCCL runs one rank per GPU; "
            f"use --nproc {gpus} or fewer (each rank on its own GPU), or --train.device cpu (gloo ranks)"
        )


class StopSignals:
    """Turns stop signals into a request the trainer honours at the next step boundary (checkpoint,
    then return), instead of dying mid-step. `code` is what the trainer agrees on across ranks: the
    largest wins, so an exit request (SIGTERM, Ctrl-C) overrides a requeue request (SIGUSR2)."""

    REQUEUE, EXIT = 1, 2

    def __init__(self, actions: dict[signal.Signals, int]):
        self.code = 0
        self.agreed = 0
        self.received: str | None = None
        """The name of the first signal this process received (None: it stopped because a peer did)."""
        self._actions = actions
        for signum in actions:
            signal.signal(signum, self._handle)

    @classmethod
    def exit_on_terminate(cls) -> StopSignals:
        """What a rank of `loom train` does (local, torchrun or srun): SIGTERM and Ctrl-C save and stop."""
        return cls({signal.SIGTERM: cls.EXIT, signal.SIGINT: cls.EXIT})

    def _handle(self, signum: int, frame) -> None:
        self.received = self.received or signal.Signals(signum).name
        self.code = max(self.code, self._actions[signal.Signals(signum)])

    @property
    def exited_early(self) -> bool:
        """The ranks agreed to save and stop before the run's last step (not a requeue)."""
        return self.agreed == self.EXIT


RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

WAITING_NOTICE_S = 60.0
"""A rank still meeting the others after this long says so once: else a rank whose peers never come (a RANK and
WORLD_SIZE left in the shell, a node that failed to start) is silent until parallel.timeout_minutes."""


def rank_from_environment() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) of a rank that torchrun, srun or a user's script started, checked: a shell that still
    holds RANK and WORLD_SIZE from another job made `loom train` a rank of a launch that does not exist (a traceback
    about MASTER_ADDR, or a silent wait for peers until the timeout)."""
    missing = [name for name in RENDEZVOUS_VARIABLES if not os.environ.get(name)]
    given = ", ".join(f"{name}={os.environ.get(name, '')}" for name in RENDEZVOUS_VARIABLES if name in os.environ)
    if missing:
        raise ConfigError(
            f"{given} in the environment make this process one rank of a torchrun/srun launch, but {missing[0]} is "
            "not set: set it too, or unset RANK and WORLD_SIZE (left from another job?) and pass --nproc N"
        )
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ConfigError(f"RANK and WORLD_SIZE must be integers ({given})") from None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK must lie in [0, WORLD_SIZE) ({given})")
    return rank, world


def init_distributed(config: LoomConfig) -> int:
    """Initialise the default process group from the environment; returns the local rank."""
    rank, world = rank_from_environment()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = choose_backend(config.parallel.backend, config.train.device)
    if backend == "nccl" or computes_on_cuda(config.train.device):
        set_cuda_env_defaults(config)  # a CUDA rank's, whatever its backend (gloo over CUDA tensors too)
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    minutes = config.parallel.timeout_minutes
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    notice = threading.Timer(
        WAITING_NOTICE_S,
        print,
        [
            f"loom: rank {rank} of {world} has waited {WAITING_NOTICE_S:g} s at {where} for the other ranks; it gives "
            f"up after parallel.timeout_minutes = {minutes:g}. If no launch of {world} ranks is under way, stop it and "
            "unset RANK and WORLD_SIZE (left from another job?)"
        ],
        {"file": sys.stderr, "flush": True},
    )
    notice.daemon = True
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one per machine (torchrun sets LOCAL_RANK; a leftover RANK, not)
        notice.start()
    started = time.monotonic()
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=minutes))
    except (dist.DistStoreError, dist.DistNetworkError) as error:  # rank 0 hosts the store (torchrun/srun); all connect
        if "EADDRINUSE" in str(error):
            raise ConfigError(
                f"rank 0 cannot listen on {where} (MASTER_ADDR:MASTER_PORT): another process took the port; pick "
                "another MASTER_PORT (torchrun --master-port, or the job's environment under srun)"
            ) from None
        if "timed out" not in str(error).lower():
            raise
        waited = time.monotonic() - started  # torch's client retries past the timeout (by a minute, at 1.5)
        raise ConfigError(
            f"rank {rank} of WORLD_SIZE = {world} waited {waited:.0f} s at {where} for the other ranks "
            f"(parallel.timeout_minutes = {minutes:g}), and not all came ({str(error).splitlines()[0]}); start every "
            "rank, or unset RANK and WORLD_SIZE (left from another job?) and pass --nproc N"
        ) from None
    finally:
        notice.cancel()
    return local_rank


SHARED_CHECK = ".loom-shared-check"
"""What rank 0 writes into the run directory for the other ranks to find: they see it only if the folder is shared."""


NODE_LOCAL_SETTING = ("data", "cache_dir")
"""The setting that may differ between nodes: where each keeps the sample-index caches (a node's scratch disk)."""


def agree_with_rank_0(config: LoomConfig, check_run_dir: bool) -> None:
    """Refuse, on every rank at once, a launch whose ranks do not see rank 0's run directory (`check_run_dir`: every
    rank writes its part of each checkpoint there, and a node with a folder of its own failed the first save, after
    all the training before it), or were given other settings than rank 0 (under torchrun or srun each node has its
    own command line: a node told other steps trained on another learning-rate schedule beside the rest, unsaid;
    another tp hung). Before any other collective."""
    import secrets
    import socket

    from loom.engine.config_io import config_to_dict
    from loom.engine.preflight import first_difference

    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return
    run_dir = Path(config.train.run_dir)
    marker = run_dir / SHARED_CHECK
    token = secrets.token_hex(8) if rank == 0 and check_run_dir else None
    settings = _without(config_to_dict(config), *NODE_LOCAL_SETTING)
    ranks: list = [None] * world
    seen: list = [None] * world
    try:
        if token is not None:
            with naming(marker):
                marker.write_text(token)  # the run directory exists: rank 0 holds its lock
        dist.all_gather_object(ranks, (settings, socket.gethostname(), token, str(run_dir.resolve())))
        try:
            sees = rank == 0 or not check_run_dir or (marker.is_file() and marker.read_text() == ranks[0][2])
        except OSError:
            sees = False
        dist.all_gather_object(seen, sees)
    finally:
        if token is not None:
            marker.unlink(missing_ok=True)

    def where(r: int) -> str:
        return f"rank {r} on {ranks[r][1]}"

    blind = next((r for r in range(world) if not seen[r]), None)
    if blind is not None:  # first: a node that resumes from a folder of its own also adopts other settings
        raise ConfigError(
            f"run directory {run_dir} is not shared: {where(blind)} (at {ranks[blind][3]}) does not see what rank 0 "
            f"on {ranks[0][1]} (at {ranks[0][3]}) wrote there; every rank writes its part of each checkpoint into "
            "it: give --train.run_dir a folder on a filesystem every node shares"
        )
    other = next((r for r in range(1, world) if ranks[r][0] != ranks[0][0]), None)
    if other is not None:
        names = ("on rank 0", f"on rank {other}")
        mine, theirs = ranks[0][0], ranks[other][0]
        # parallel.dp follows from the rest: name what the user gave (another tp) rather than what it changed
        given = first_difference(_without(mine, "parallel", "dp"), _without(theirs, "parallel", "dp"), names)
        difference = first_difference(mine, theirs, names) if given.startswith("the same") else given
        raise ConfigError(
            f"{where(other)} was given other settings than rank 0 on {ranks[0][1]} ({difference}); start every "
            "rank with the same command"
        )


def _without(settings: dict, section: str, name: str) -> dict:
    """A config's dict of sections without field `section.name`."""
    return {s: {k: v for k, v in values.items() if (s, k) != (section, name)} for s, values in settings.items()}


def run_rank(config: LoomConfig, mode: str = "train", stop: StopSignals | None = None) -> list[dict]:
    """Everything one rank does for `loom train` (mode "train": the logged rows) or `loom eval`
    (mode "eval": one row with val_loss and val_ppl, printed by rank 0). With `stop`, a stop signal
    checkpoints and returns early; `stop.agreed` then says what all ranks agreed on."""

    from loom.engine.train import Trainer

    local_rank = init_distributed(config)
    lock = None
    try:
        if mode == "train" and dist.get_rank() == 0:
            lock = RunLock(Path(config.train.run_dir))
            if not lock.supported:
                print(
                    f"warning: {config.train.run_dir}'s filesystem has no file locks: another run started in this "
                    "directory meanwhile would not be refused",
                    flush=True,
                )
        agree_with_rank_0(config, check_run_dir=mode == "train")
        trainer = Trainer(config, local_rank=local_rank, evaluation_only=mode == "eval")
        try:
            if mode == "eval":
                loss = trainer.evaluate()
                rows = [{"step": trainer.step, "val_loss": loss, "val_ppl": perplexity(loss)}]
                if dist.get_rank() == 0:
                    print(
                        f"step {trainer.step}: validation loss {loss:.6f}, perplexity {rows[0]['val_ppl']:.2f}",
                        flush=True,
                    )
            else:
                rows = trainer.run(stop)
        finally:
            trainer.close()
        # Leave together: with ranks tearing down gloo groups at different times, we have seen
        # gloo abort (SIGABRT) a rank at exit after ZeRO-1's asynchronous all-gathers.
        dist.barrier()
        return rows
    finally:
        if lock is not None:
            lock.close()
        dist.destroy_process_group()

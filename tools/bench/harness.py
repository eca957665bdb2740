"""How a benchmark runs loom on one device: world size 1 in a process group of its own, random tokens, the config
fields it sets itself (and refuses as overrides), and the checks made before any work, so that a config's own
mistake is one line and a lent GPU's minutes go to measuring. `loom bench mfu`, `gpu` and `profile` share it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.config_io import config_to_dict, load_config, parse_overrides
from loom.engine.data.indexed import IndexedDatasetWriter
from loom.errors import Interrupted

T = TypeVar("T")


RANDOM_DOCUMENTS = 1024
"""The most documents of random tokens a benchmark writes: its dataset serves them again, epoch after epoch."""


def random_tokens_for(base: LoomConfig, sequences: int, folder: str) -> str:
    """A dataset (its prefix in `folder`) of random tokens for `sequences` training sequences of `base`'s shape."""
    documents = min(2 * sequences, RANDOM_DOCUMENTS)
    return write_random_tokens(Path(folder) / "random", base.model.vocab_size, documents, base.train.seq_length + 1)


def write_random_tokens(prefix: Path, vocab_size: int, documents: int, length: int) -> str:
    rng = np.random.default_rng(0)
    dtype = np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(0, vocab_size, length))
    return str(prefix)


def _bench_settings(micro_batch_size: int, data: str, run_dir: str, steps: int, microbatches: int) -> dict:
    """What every loom row sets, whatever the config says: world size 1, random data, no eval, checkpoints or
    TensorBoard (llama-1b's checkpoint is ~20 GB, and writing it took ~50 s of each row on an H200)."""
    return {
        "parallel": {
            **{"tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "dp": None},
            **{"sequence_parallel": False, "backend": "auto"},
        },
        "data": {"paths": [data], "weights": None, "tokenizer": None, "split": "100,0,0"},
        "train": {
            "steps": steps,
            "global_batch_size": micro_batch_size * microbatches,
            "rampup_batch_size": None,
            "run_dir": run_dir,
            "log_interval": 1,
            "eval_interval": 0,
            "tensorboard": False,
            "exit_after": 0,
        },
        "checkpoint": {"interval": 0, "load": None, "save_at_end": False},
        "optim": {"warmup_steps": 0},
    }


BENCH_SET_FIELDS = {section: set(values) for section, values in _bench_settings(1, "", "", 1, 1).items()}
"""The config fields the benchmarks set themselves: an override of one would be dropped without a word."""

MAX_SEQUENCES = 1_000_000
"""The most sequences a loom row trains (--steps and --warmup times the global batch): far above what figures
that settle within tens of steps need, far below a run that fills the disk with random tokens and never ends."""


def refuse_bench_set_fields(overrides: list[str], command: str, own_flags: dict[str, str] | None = None) -> None:
    """One line for an override the benchmark would drop (BENCH_SET_FIELDS) or that one of its own flags sets
    (`own_flags`: "section.field" -> the flag), before any work."""
    for section, values in parse_overrides(overrides).items():
        for name in values:
            if name in BENCH_SET_FIELDS.get(section, ()):
                raise ConfigError(
                    f"--{section}.{name}: loom bench {command} sets it itself (one rank on random tokens, "
                    "--steps/--warmup/--microbatches, nothing saved); drop it"
                )
            if flag := (own_flags or {}).get(f"{section}.{name}"):
                raise ConfigError(f"--{section}.{name}: loom bench {command} sets it in a row of its own; use {flag}")


def bench_device(base: LoomConfig, steps: int, microbatches: int) -> torch.device:
    """The device the loom rows of `base` run on, after the checks the Trainer would make there (a GPU that is not
    there, kernels the device cannot run, a batch beyond MAX_SEQUENCES), so that the config's own mistake is one
    line before any work rather than a failed row. On CUDA, loom's CUDA environment defaults for `base` are set
    first, as a launcher sets them for its ranks."""
    from loom.engine.cuda_env import computes_on_cuda, set_cuda_env_defaults
    from loom.engine.train import pick_device

    sequences = steps * base.train.micro_batch_size * microbatches
    if sequences > MAX_SEQUENCES:
        raise ConfigError(
            f"{steps} steps of {microbatches} micro-batches of {base.train.micro_batch_size} is {sequences:,} "
            f"sequences, above the {MAX_SEQUENCES:,} a benchmark trains; lower --steps or --microbatches"
        )
    if computes_on_cuda(base.train.device):
        set_cuda_env_defaults(base)  # as a launcher sets them for its ranks: the allocator reads them at the first
        # CUDA call, which pick_device makes
    device = pick_device(base.train.device, 0)
    checked(lambda: bench_config(base, "random", "run", steps, microbatches), device)
    return device


def checked(configure: Callable[[], LoomConfig], device: torch.device) -> LoomConfig:
    """configure()'s config after the checks the Trainer makes on `device` (ConfigError: why it cannot run there)."""
    from loom.engine.model.kernels import choose_kernels

    config = configure()
    choose_kernels(config, device)
    return config


def skip_note(error: ConfigError) -> str:
    """Why a row is skipped: the refusal, without an FP8 refusal's advice (--train.fp8 off, ...), which is for
    `loom train`; a bench sets train.fp8 itself."""
    from loom.engine.model.kernels import Fp8Unavailable

    return f"skipped: {error.reason if isinstance(error, Fp8Unavailable) else error}"


def bench_config(base: LoomConfig, data: str, run_dir: str, steps: int, microbatches: int, **train) -> LoomConfig:
    """The config of one loom row: `base` with _bench_settings, and `train` fields on top."""
    overrides = _bench_settings(base.train.micro_batch_size, data, run_dir, steps, microbatches)
    overrides["train"].update(train)
    config = with_overrides(base, overrides)
    config.resolve_world(1)
    return config


def with_overrides(base: LoomConfig, overrides: dict) -> LoomConfig:
    values = config_to_dict(base)
    for section, settings in overrides.items():
        values[section].update(settings)
    return load_config(None, values)


def stop_within(error: BaseException) -> Interrupted | None:
    """The stop (a SIGTERM the command raises as Interrupted) that `error` carries, if any: torch.compile reports one
    that came while it compiled as its own failure (BackendCompilerFailed), which a bench would take for a
    compiler's and go on."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Interrupted):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def guarded(make: Callable[[], T], failed: Callable[[str], T], device: torch.device) -> T:
    """make(), or failed(why) when it raises (traceback on stderr): a lent GPU is minutes long, and one part of a
    bench that breaks (a kernel never run on this device before) must not take the others' figures with it."""
    try:
        return make()
    except Interrupted:  # a SIGTERM (the lease's time limit): the bench ends
        raise
    except Exception as error:  # noqa: BLE001 -- reported in the table and on stderr, never swallowed
        if (stop := stop_within(error)) is not None:
            raise stop from None
        traceback.print_exc(file=sys.stderr)
        why = f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    try:
        free_memory(device)  # outside the handler: the traceback's frames hold the failed run's tensors until it ends
    except Exception:  # noqa: BLE001 -- a sticky CUDA error (an illegal access) fails every later CUDA call too
        traceback.print_exc(file=sys.stderr)
    return failed(why)


@contextlib.contextmanager
def single_process_group(device: torch.device):
    """World size 1 for the measured runs (the Trainer works in a process group), gone afterwards with the
    rendezvous variables it set: ranks a launcher starts later in this process must not inherit them."""
    from loom.engine.parallel.rendezvous import free_port

    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    rendezvous["LOCAL_RANK"] = "0"
    before = {name: os.environ.get(name) for name in rendezvous}
    os.environ.update(rendezvous)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

"""What the training tests share: the tiny config with test settings (as a LoomConfig or as `loom train`
flags), a run's metrics, and waiting for a process to reach a state.

A test waits for the state it needs (a metrics row, a line of output, a process gone), never for time to
pass, and asserts nothing about how long anything took: a loaded machine is slow, not wrong. Every wait
has a deadline, HANG_S unless said otherwise, far above any healthy run's time; it only turns a hang
into a failure.
"""

from __future__ import annotations

import math
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from loom.engine.config import LoomConfig
from loom.engine.config_io import load_config
from loom.engine.run_dir import read_metrics

HANG_S = 300

# Every row logged, no evaluation, TensorBoard or final checkpoint unless a test asks for them.
TEST_TRAIN_SETTINGS = {"log_interval": 1, "eval_interval": 0, "tensorboard": False}
TEST_CHECKPOINT_SETTINGS = {"save_at_end": False}


def tiny_config(dataset: str, run_dir: str | Path, **sections: dict) -> LoomConfig:
    """configs/tiny.toml training on `dataset` (token ids: no tokenizer) into `run_dir`, with
    TEST_TRAIN_SETTINGS; `sections` add or override fields, e.g. train={"steps": 4}, parallel={"tp": 2}."""
    overrides = {
        "data": {"paths": [dataset], "tokenizer": None},
        "train": {"run_dir": str(run_dir), **TEST_TRAIN_SETTINGS},
        "checkpoint": dict(TEST_CHECKPOINT_SETTINGS),
    }
    for section, fields in sections.items():
        overrides[section] = {**overrides.get(section, {}), **fields}
    return load_config("tiny", overrides)


def tiny_train_args(dataset: str, run_dir: str | Path, *extra: str) -> list[str]:
    """tiny_config's settings as `loom train` (or `loom submit`) flags; `extra` flags come last and win."""
    return [
        "--config",
        "tiny",
        "--data.paths",
        dataset,
        "--data.tokenizer",
        "none",
        "--train.run_dir",
        str(run_dir),
        "--train.log_interval",
        "1",
        "--train.eval_interval",
        "0",
        "--train.tensorboard",
        "false",
        "--checkpoint.save_at_end",
        "false",
        *extra,
    ]


def loom(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`loom ARGS` as a user types it, in a fresh process; its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", *args], capture_output=True, text=True, timeout=HANG_S, env=env
    )


def loom_here(capfd, *args: str) -> subprocess.CompletedProcess:
    """`loom ARGS` through the console script's entry point in this process (its ranks fork from this process's
    warm fork server and write to the same file descriptors, which `capfd` reads): what loom() gives, seconds
    sooner."""
    from loom.launch.cli import main

    code = 0
    try:
        main(list(args))
    except SystemExit as exited:
        code = exited.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def loom_logits(checkpoints, tokens: torch.Tensor) -> torch.Tensor:
    """The logits [batch, seq, vocab] of the checkpoint's model (its newest under `checkpoints`) on one CPU rank."""
    from loom.engine.checkpoint.format import find_loadable
    from loom.engine.checkpoint.load import PieceReader, load_expert_biases
    from loom.engine.config_io import config_from_dict
    from loom.engine.model.gpt import GPTModel
    from loom.engine.parallel.param_info import param_info
    from loom.engine.parallel.sharding import initialize_parameters

    directory, metadata = find_loadable(checkpoints)
    config = config_from_dict(metadata.config)
    model = GPTModel(config.model, None)
    initialize_parameters(model, 0, 0, 1)
    reader = PieceReader(directory, metadata)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(param_info(param).shard_spec.shard(reader.model(name), 0, 1))
        load_expert_biases([model], reader, metadata)
        return model.eval()(tokens)[..., : config.model.vocab_size].transpose(0, 1)


def one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """The command failed as a user's mistake: exit 2 and one line `error: ...` holding each fragment."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def wait_for(condition: Callable[[], bool], what: str, process: subprocess.Popen | None = None) -> None:
    """Poll until condition() holds. Fails if `process` exits before it does, or after HANG_S."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        if process is not None and process.poll() is not None:
            if condition():
                return
            stdout, stderr = process.communicate()
            raise AssertionError(f"exited with {process.returncode} before {what}:\n{stdout}\n{stderr}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {HANG_S} s: hung?")
        time.sleep(0.2)


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen | None = None) -> None:
    """Until rank 0 has logged `step` (or a later one) in run_dir/metrics.jsonl."""
    wait_for(lambda: any(row["step"] >= step for row in read_metrics(run_dir)), f"step {step} logged", process)


def read_output_until(process: subprocess.Popen, text: str) -> str:
    """Read `process`'s stdout (a pipe) until `text` appears; returns what was read. process.communicate()
    gives the rest later. Fails if the output ends first, or after HANG_S."""
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + HANG_S
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while text.encode() not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} in the output after {HANG_S} s: hung?\n{seen.decode()}")
            if selector.select(left):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    process.wait()
                    raise AssertionError(f"exited with {process.returncode} before {text!r}:\n{seen.decode()}")
                seen += chunk
    return seen.decode()


@contextmanager
def fails_if_hung() -> Iterator[None]:
    """For code run in this process (no subprocess timeout= to lean on): raises TimeoutError in it
    after HANG_S. Needs the main thread; SIGALRM must be free."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {HANG_S} s: hung?")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_trains_as_torch_loop(model, optimizer, params: list, samples, config: LoomConfig, loom_rows: list) -> int:
    """Train `model` (a transformers causal LM) with torch `optimizer` over `params` on loom's training `samples`, one
    step per (loss, grad norm, lr) row of loom's, and assert each row equal: a global batch's micro-batches summed
    into one gradient averaged over its tokens, clip_grad_norm_ over `params`, linear warm-up then cosine to min_lr
    (megatron-core's scheduler: test_optim.py). Returns the number of steps whose gradient was clipped."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    t, o = config.train, config.optim
    # the schedule written out below: linear warm-up, then cosine over the rest of the run
    assert o.decay == "cosine" and o.warmup_steps > 0 and o.decay_steps in (None, 0, len(loom_rows)), o
    tokens_per_step = t.global_batch_size * t.seq_length
    vocab = model.config.vocab_size
    clipped = 0
    for step, (loom_loss, loom_norm, loom_lr) in enumerate(loom_rows):
        first = step * t.global_batch_size
        batch = torch.stack(
            [torch.from_numpy(samples[i].astype(np.int64)) for i in range(first, first + t.global_batch_size)]
        )
        optimizer.zero_grad()
        loss_sum = 0.0
        for micro in batch.split(t.micro_batch_size):
            logits = model(micro[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, vocab), micro[:, 1:].reshape(-1), reduction="sum")
            (loss / tokens_per_step).backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, o.clip_grad).item()
        clipped += norm > o.clip_grad
        lr = o.lr * (step + 1) / o.warmup_steps
        if step >= o.warmup_steps:
            progress = (step - o.warmup_steps) / (len(loom_rows) - o.warmup_steps)
            lr = o.min_lr + (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress)) / 2
        assert loom_lr == pytest.approx(lr, rel=1e-12), step
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        assert loom_loss == pytest.approx(loss_sum / tokens_per_step, rel=1e-6), step
        assert loom_norm == pytest.approx(norm, rel=1e-5), step
    return clipped


def mount_tmpfs(target: Path, options: str) -> None:
    """A tmpfs at `target` (`options`: size=12k, ro, ...), to fill or write-protect for real (chmod does not stop
    root); skips the test where mounting needs a root this is not."""
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")


def unmount(target: Path) -> None:
    """Unmount `target`; lazily (-l) if a file is still open there, rather than leave the mount behind."""
    if subprocess.run(["umount", str(target)], capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)

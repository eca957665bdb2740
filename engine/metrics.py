"""The metrics contract: metrics.jsonl rows, TensorBoard scalars and a console line per logged step.

Only the rank that owns logging (global rank 0) creates a MetricsWriter. metrics.jsonl is opened
in append mode so it survives resume; each row is flushed as soon as it is written.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from loom.engine.atomic import write_text_atomically
from loom.engine.config import ConfigError
from loom.engine.config_io import config_to_dict
from loom.engine.run_dir import METRICS, TENSORBOARD
from loom.errors import naming


def perplexity(loss: float) -> float:
    """exp(loss), capped where it would overflow (a diverged model's loss)."""
    return math.exp(min(loss, 50.0))


def memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def _json_row(row: dict) -> dict:
    """`row` with each value that is not a finite number (a diverged step's loss, its gradient norm) as None: JSON
    has no NaN or infinity, and Python's `NaN` breaks other readers (JavaScript's JSON.parse, pandas' engines).
    TensorBoard and the console keep the value itself."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in row.items()}


class MetricsWriter:
    """Appends to run_dir/metrics.jsonl; on resume from step N, rows after N (logged before the
    interruption, to be trained again) are dropped first, so no step appears twice."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int = 0, total_steps: int | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / METRICS
        if path.exists():
            drop_rows_after(path, resume_step)
        self.jsonl = open(path, "a")
        self.total_steps = total_steps
        self.tensorboard = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops the events of steps that will be trained again, as for metrics.jsonl
            self.tensorboard = SummaryWriter(str(run_dir / TENSORBOARD), purge_step=resume_step + 1)
            _leave_writer_thread_errors_to_the_writer()

    def attach_wandb(self, config, run_dir: Path) -> None:
        """Log every row to W&B too (train.wandb_project), resuming the run whose id this run directory keeps."""
        import wandb

        t = config.train
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        write_text_atomically(id_file, run_id + "\n")
        self.wandb = wandb.init(
            project=t.wandb_project,
            entity=t.wandb_entity,
            name=t.wandb_run_name or t.name,
            mode=t.wandb_mode,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config_to_dict(config),
        )

    def write(self, row: dict, eta_s: float | None = None) -> None:
        """Append `row`; the console line also shows the step out of total_steps and `eta_s`, the time left."""
        with naming(self.jsonl.name):
            self.jsonl.write(json.dumps(_json_row(row)) + "\n")
            self.jsonl.flush()
        if self.tensorboard is not None:
            with naming(self.tensorboard.log_dir):  # its writer thread's error, raised again here
                for key, value in _scalars(row):
                    self.tensorboard.add_scalar(_scalar_tag(key), value, row["step"])
                self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({_scalar_tag(key): value for key, value in _scalars(row)}, step=row["step"])
        print(format_console_line(row, self.total_steps, eta_s), file=sys.stdout, flush=True)

    def close(self) -> None:
        with naming(self.jsonl.name):
            self.jsonl.close()
        if self.tensorboard is not None:
            with naming(self.tensorboard.log_dir):
                self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _leave_writer_thread_errors_to_the_writer() -> None:
    """TensorBoard writes events from a thread of its own, whose OSError (a full disk) it raises again at the next
    add_scalar or flush, where write() names the folder; the thread's own traceback, printed by threading's hook
    on the way, would precede that one line."""
    previous = threading.excepthook
    if getattr(previous, "leaves_writer_errors", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.leaves_writer_errors = True
    threading.excepthook = hook


def _scalars(row: dict):
    """The row's numbers, as TensorBoard and W&B get them (the step is their x axis)."""
    return ((k, v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool))


def _scalar_tag(key: str) -> str:
    return f"valid/{key}" if key.startswith("val_") else f"train/{key}"


def drop_rows_after(path: Path, step: int) -> None:
    """Keep the JSON lines of `path` (rows with a "step") up to `step`: what a resumed run trains again goes. A last
    line cut short (the process killed, or the disk full, mid-write) goes too; a damaged line before it is named."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            row_step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if number == len(lines):
                break
            raise ConfigError(
                f"{path}, line {number}, is not a row of steps ({line[:60]!r}); fix or remove it"
            ) from None
        if row_step <= step:
            kept.append(line)
    write_text_atomically(path, "".join(line + "\n" for line in kept))


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def format_console_line(row: dict, total_steps: int | None = None, eta_s: float | None = None) -> str:
    step = f"{row['step']:>6}" + (f"/{total_steps}" if total_steps else "")
    if "val_loss" in row:
        return f"step {step} | validation loss {row['val_loss']:.4f} | perplexity {row['val_ppl']:.2f}"
    parts = [
        f"step {step}",
        f"loss {row['loss']:.4f}",
        f"lr {row['lr']:.3e}",
        f"grad norm {row['grad_norm']:.3f}",
    ]
    if "moe_aux_loss" in row:  # summed over the blocks: 1 a block when the experts' load is even
        parts.append(f"moe aux {row['moe_aux_loss']:.3f}")
    if "moe_z_loss" in row:
        parts.append(f"moe z {row['moe_z_loss']:.3f}")
    parts += [f"{row['tokens_per_s']:,.0f} tok/s"]
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    parts.append(f"mem {row['mem_gb']:.2f} GB")
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


class StepClock:
    """Throughput and the time left in a job. Steps and tokens are counted from one device sync to the next
    (the logging steps), so the host's logging in between counts too, as it holds up the next step; the time left
    is the mean step time's, the first interval (warm-up) left out once others exist."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, int]] = []
        self.restart()

    def restart(self) -> None:
        """Start a new interval now (after a sync): what ran since (an evaluation, a save) is not throughput."""
        self.started, self.steps, self.tokens = time.perf_counter(), 0, 0

    def count(self, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens

    def lap(self) -> float:
        """Close the interval at a sync: its tokens per second; the next interval starts now."""
        now = time.perf_counter()
        elapsed = now - self.started
        self.intervals.append((elapsed, self.steps))
        tokens_per_s = self.tokens / elapsed
        self.started, self.steps, self.tokens = now, 0, 0
        return tokens_per_s

    def seconds_left(self, steps_left: int) -> float | None:
        settled = self.intervals[1:] or self.intervals
        steps = sum(n for _, n in settled)
        return sum(t for t, _ in settled) / steps * steps_left if steps else None

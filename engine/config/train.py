"""[train] and [checkpoint]: the run's length, batch and precision, and how it saves and resumes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from loom.engine.config.fields import ConfigError, check_choices, check_positive, is_plain_name


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to run."""
    global_batch_size: int = 256
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    rampup_batch_size: list[int] | None = None
    """[start, increment, ramp_samples]: the global batch grows from start by increment until
    global_batch_size over the first ramp_samples samples (Megatron's --rampup-batch-size). The learning-rate
    schedule counts samples, as Megatron's does: a ramp step of batch b moves it b / global_batch_size of a step,
    so optim.warmup_steps and optim.decay_steps count full global batches, and the decay's default length is the
    run's samples over global_batch_size."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank."""
    seq_length: int = 2048
    """Tokens per sequence."""
    seed: int = 1234
    """Seeds initialisation (per parameter name) and the data order."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Compute precision; master weights and optimizer state stay fp32."""
    name: str = "loom"
    """Run name; the run directory defaults to runs/<name>."""
    run_dir: str | None = None
    """Where config.toml, metrics.jsonl, tensorboard/ and checkpoints/ go."""
    overwrite: bool = False
    """Start afresh in a run directory that holds another run (a different config.toml and no checkpoint to
    resume from); that run's files are moved to RUN_DIR/replaced/<time>/, not deleted. Without it such a
    directory is refused, so one run never truncates another's metrics."""
    log_interval: int = 1
    """Write a metrics row and a console line every this many steps: that step's loss, lr and grad_norm (not means
    over the interval), with tokens_per_s and mfu measured over the steps since the previous row."""
    eval_interval: int = 0
    """Validation every this many steps (and at the end); 0 turns validation off."""
    eval_iters: int = 4
    """Global batches per validation."""
    exit_after: int = 0
    """Stop this job after this many steps (checkpointing first, whatever checkpoint.save_at_end says), to chain
    jobs; 0 runs to train.steps."""
    early_stop_patience: int = 0
    """Stop when validation loss has not improved for this many evaluations; 0 never stops early."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where ranks compute; auto means CUDA when available."""
    peak_tflops: float | None = None
    """Peak dense FLOP/s per device for MFU; None looks the device up (known GPUs only)."""
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""
    wandb_project: str | None = None
    """Also log metrics.jsonl's scalars and the resolved config to this Weights & Biases project (rank 0;
    needs `pip install wandb`). A restart resumes the same W&B run (its id is kept in the run directory)."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None: the logged-in default."""
    wandb_run_name: str | None = None
    """W&B run name; None: train.name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """online streams to the W&B server; offline writes RUN_DIR/wandb/ for a later `wandb sync`; disabled logs
    nothing to W&B (wandb's own switch, e.g. for a debug run of a config that names a project)."""
    record_pipeline_timeline: bool = False
    """Record per-op times of the last training step in pipeline_timeline.json (`loom schedule --from-run`)."""
    comm_ledger: bool = False
    """Debug: record every collective and p2p transfer of each step (group, op, dtype, count, bytes) in
    RUN_DIR/comm_ledger/rank_NNNNN.jsonl, one line per step (engine/comm_ledger.py). Slows steps down."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """What a NaN/Inf loss or gradient norm does: stop (fail the run; the last checkpoint, saved before
    the bad step, stays the newest) or skip (drop that step's update and go on). Under fp16 a gradient overflow
    with a finite loss is the loss scaler's to handle (it skips the step and lowers the scale), not this
    policy's; a non-finite loss is this policy's at any precision."""
    max_skipped_steps: int = 10
    """Under nan_policy = skip, fail after this many non-finite steps in a row (counted across resumes: a
    checkpoint keeps the count)."""
    fp8: Literal["off", "delayed", "current"] = "off"
    """FP8 matmuls in the transformer blocks (needs precision = bf16 and a GPU of compute capability >= 8.9):
    delayed = Transformer Engine's DelayedScaling (scales from an amax history), current = per-tensor
    scales from each tensor itself (TE's Float8CurrentScaling, or torch._scaled_mm without TE).
    Unavailable FP8 is an error, never a silent fallback."""
    fp8_output_layer: bool = False
    """With fp8 = current, the output layer's three GEMMs in FP8 too (hidden states and weight E4M3, the logits'
    gradient E5M2): the largest GEMM of a small model (a fifth of llama-1b's GEMM time in bf16, a third once its
    blocks run in FP8: 64 of 202 ms on an H200). Off by default, as in Transformer Engine, torchao and
    DeepSeek-V3's recipe, which keep the output layer in bf16; on CPU a 4-layer model trained 200 steps to within
    0.004 of bf16's loss with it (docs/gpu.md)."""

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` (ramp-up, then constant)."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        increments = (self.global_batch_size - start) // increment
        if increments == 0 or consumed_samples >= ramp_samples:
            return self.global_batch_size
        return start + int(consumed_samples / (ramp_samples / increments)) * increment

    def batch_sizes(self) -> list[int]:
        """Every global batch size the run will use."""
        if self.rampup_batch_size is None:
            return [self.global_batch_size]
        start, increment, _ = self.rampup_batch_size
        return list(range(start, self.global_batch_size + 1, increment))

    def ramp_shares(self, consumed_samples: int = 0) -> list[float]:
        """The batch of each step still inside the batch ramp-up, from the one that starts after
        `consumed_samples`, as its share of global_batch_size: what the step moves the learning-rate schedule
        (lr_schedule.learning_rate; a full-batch step moves it 1). [] without a ramp or past its end."""
        shares = []
        while (batch := self.global_batch_size_at(consumed_samples)) != self.global_batch_size:
            consumed_samples += batch
            shares.append(batch / self.global_batch_size)
        return shares

    def schedule_length(self) -> float:
        """The schedule's position after the run's last step, the decay's default length: train.steps, each ramp
        step counted as its share (the run's samples over global_batch_size, as Megatron-LM counts samples)."""
        shares = self.ramp_shares()
        position = 0.0
        for share in shares[: self.steps]:  # added one by one as the trainer adds them (sum() may compensate)
            position += share
        return position + max(0, self.steps - len(shares))

    def __post_init__(self) -> None:
        check_choices(self, "train")
        check_positive(
            "train",
            steps=self.steps,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            seq_length=self.seq_length,
            log_interval=self.log_interval,
            eval_iters=self.eval_iters,
            peak_tflops=self.peak_tflops,
        )
        check_positive("train", max_skipped_steps=self.max_skipped_steps)
        if self.fp8 != "off" and self.precision != "bf16":
            raise ConfigError(
                f"train.fp8 = {self.fp8} needs train.precision = bf16 (got {self.precision}); "
                f"add --train.precision bf16"
            )
        if self.fp8_output_layer and self.fp8 != "current":
            raise ConfigError(
                f"train.fp8_output_layer needs train.fp8 = current (loom's own FP8 linears), got {self.fp8}; "
                f"add --train.fp8 current or drop --train.fp8_output_layer"
            )
        if self.rampup_batch_size is not None:
            if len(self.rampup_batch_size) != 3 or min(self.rampup_batch_size) <= 0:
                raise ConfigError("train.rampup_batch_size takes three positive numbers: start increment samples")
            start, increment, _ = self.rampup_batch_size
            if start > self.global_batch_size or (self.global_batch_size - start) % increment:
                raise ConfigError(
                    f"train.rampup_batch_size: global_batch_size {self.global_batch_size} - start "
                    f"{start} must be a non-negative multiple of the increment {increment}"
                )
        if self.eval_interval < 0 or self.early_stop_patience < 0 or self.exit_after < 0:
            raise ConfigError("train.eval_interval, train.early_stop_patience and train.exit_after must be >= 0")
        if self.run_dir is not None and not self.run_dir.strip():  # Path("") is the current directory
            raise ConfigError("train.run_dir is empty; give a folder, or drop it for runs/<train.name>")
        if self.run_dir is None:
            if not is_plain_name(self.name):
                raise ConfigError(
                    f"train.name = {self.name!r} must be a plain name (it becomes runs/<name>); give a path as "
                    "--train.run_dir instead"
                )
            self.run_dir = str(Path("runs") / self.name)


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps; 0: no periodic saves (the last step is still saved, see save_at_end)."""
    save_at_end: bool = True
    """Save the run's last step (train.steps, or an early stop) so a finished run can be evaluated, exported or
    extended. false matters only to a run without periodic saves (checkpoint.interval 0): it then keeps no
    checkpoint. A run with an interval saves its last step too (a rerun would train the steps after the last save
    again), and a job that train.exit_after ends always saves, for the next job."""
    keep: int = 3
    """Keep the newest this many checkpoints."""
    load: str | None = None
    """Checkpoint a new run starts from (a run directory, its checkpoints/ or an iter_N folder, any layout; the run's
    own directory, as Megatron's --save D --load D, is no other start). Once the run has checkpoints of its own, it
    resumes from its newest instead: rerunning the command, extending the
    run or a requeued job continue it rather than going back here. Its weights are the model: its shapes, RoPE
    and norm settings and context length are the checkpoint's, over the config file's, on this run and its reruns
    (said at start; a flag giving another shape is refused; dropout, recompute, kernels stay the run's)."""
    finetune: bool = False
    """With checkpoint.load: start from its weights alone (Megatron's --finetune, torchtitan's
    initial_load_model_only): step 1 of this run's schedule, fresh optimizer state and loss scale, its data from the
    start. false: train on from the loaded step, its optimizer state and data position. A run with checkpoints of
    its own resumes from them either way."""
    verify: bool = True
    """Check every file's sha256 before resuming (a damaged checkpoint falls back to an older one)."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training continues."""

    def __post_init__(self) -> None:
        check_choices(self, "checkpoint")
        if self.interval < 0 or self.keep < 1:
            raise ConfigError("checkpoint.interval must be >= 0 and checkpoint.keep >= 1")

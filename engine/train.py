"""The training loop of one rank: micro-batches, gradient reduction, clipping, optimizer, metrics, eval.

`Trainer` expects torch.distributed to be initialised (the launchers in launch/ do that) and a
config already validated against the world size. It owns the model, optimizer, data iterator and
metrics; it never spawns processes or parses command lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from loom.engine.atomic import write_text_atomically
from loom.engine.checkpoint.format import CheckpointError, CheckpointMetadata, checkpoint_to_resume, read_metadata
from loom.engine.checkpoint.load import fine_tunes_from, load_checkpoint, load_model_weights
from loom.engine.checkpoint.save import CheckpointWriter
from loom.engine.checkpoint.saved_settings import changed_model_settings, check_same_model, resume_warnings
from loom.engine.checkpoint.state import TrainingState
from loom.engine.comm_ledger import StepLedgerWriter
from loom.engine.config import ConfigError, LoomConfig
from loom.engine.config_io import config_to_toml
from loom.engine.cuda_env import computes_on_cuda
from loom.engine.data.loader import BatchIterator, agree_across_ranks, build_datasets, repeated_data
from loom.engine.faults import FaultPlan
from loom.engine.flops import model_flops_per_token, peak_tflops
from loom.engine.metrics import MetricsWriter, StepClock, memory_gb, perplexity
from loom.engine.model.compiling import first_compiled_step
from loom.engine.model.fp8_state import Fp8ScalingState
from loom.engine.model.kernels import PARAM_DTYPES, choose_kernels
from loom.engine.model.lora import adopt_base_model, check_same_base, open_base, parameter_counts
from loom.engine.model.moe import update_expert_biases
from loom.engine.optim.distributed import DistributedOptimizer
from loom.engine.optim.grad_buffer import GradBuffer
from loom.engine.optim.loss_scaler import LossScaler
from loom.engine.optim.lr_schedule import learning_rate
from loom.engine.optim.model_parallel_grads import (
    needs_model_parallel_sum,
    sum_model_parallel_grads,
)
from loom.engine.optim.param_shards import gather_unit
from loom.engine.parallel.grad_fusion import fusable_weights
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.random import RNGStreams
from loom.engine.parallel.sharding import initialize_parameters
from loom.engine.parallel.state import ParallelState
from loom.engine.pipeline.executor import PipelineExecutor
from loom.engine.pipeline.schedules import build_schedule
from loom.engine.pipeline.stages import build_chunks
from loom.engine.preflight import run_is_complete
from loom.engine.run_dir import CONFIG, TIMELINE, checkpoints_of
from loom.errors import TrainingDiverged


def pick_device(choice: str, local_rank: int) -> torch.device:
    if computes_on_cuda(choice):
        if not torch.cuda.is_available():
            raise ConfigError("train.device = cuda but no CUDA device is visible; use --train.device cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StopRequest(Protocol):
    """Set by a launcher's signal handler (launch/env.py StopSignals): 0 goes on, larger is more urgent."""

    code: int
    agreed: int
    """The code the ranks agreed on and stopped for (the trainer sets it): unlike `code`, a signal arriving after
    the agreement leaves it alone."""


@contextlib.contextmanager
def _weights_must_fit():
    """A model whose weights this rank cannot allocate is the config's to fix (a width or an expert count too
    large for the machine): said in one line, not as the allocator's traceback."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
            raise
        asked = str(error).split("you tried to allocate ")[-1].split(" bytes")[0]
        size = f" ({int(asked) / 2**30:,.0f} GiB for one tensor)" if asked.isdigit() else ""
        raise ConfigError(
            f"the model's weights do not fit in this rank's memory{size}: a smaller model, or more ranks to split it "
            "over (parallel.tp, parallel.pp, optim.zero 3); `loom plan` says which layouts fit"
        ) from None


class Trainer:
    def __init__(self, config: LoomConfig, local_rank: int = 0, evaluation_only: bool = False):
        self.config = config
        base_model_changes = adopt_base_model(config) if config.lora.enabled else []
        config.resolve_world(dist.get_world_size())
        p, t = config.parallel, config.train
        timeout = datetime.timedelta(minutes=p.timeout_minutes)
        self.state = ParallelState.create(tp=p.tp, dp=p.dp, pp=p.pp, vp=p.vp, timeout=timeout, cp=p.cp, ep=p.ep)
        self.device = pick_device(t.device, local_rank)
        self.kernels = choose_kernels(config, self.device)
        # The first step compiles the blocks, the first evaluation their no_grad graphs (engine/model/compiling.py)
        self.compiles_pending = {"step", "evaluation"} if self.kernels.compiles_blocks else set()
        self._log_event(self.kernels.summary())
        if base_model_changes:
            self._log_event(f"LoRA: the model is the base's: {'; '.join(base_model_changes)}")
        self.evaluation_only = evaluation_only
        self._build_model_and_optimizer()
        self.kernels.weights_updated(self.chunks)  # resuming below redoes it for the loaded weights
        self.step = 0
        self.autocast_dtype = None if t.precision == "fp32" else PARAM_DTYPES[t.precision]
        self._schedules: dict[tuple[int, bool], list] = {}
        sequence = t.seq_length // p.cp  # this rank's share under context parallelism
        sequence = sequence // p.tp if (p.sequence_parallel and p.tp > 1) else sequence
        self.executor = PipelineExecutor(
            self.chunks,
            self.state,
            (sequence, t.micro_batch_size, config.model.hidden_size),
            self.device,
            self._autocast,
            p2p_dtype=PARAM_DTYPES[t.precision],
            router_losses=config.model.router_losses,
            expert_loads=config.model.moves_expert_biases,
        )
        self.checkpoints = checkpoints_of(t.run_dir)
        to_resume = self._checkpoint_to_resume()
        self.fine_tunes = to_resume is not None and not evaluation_only and fine_tunes_from(config, to_resume[0])
        self._build_data(evaluation_only, to_resume[1] if to_resume and not self.fine_tunes else None)
        self.flops_per_token = model_flops_per_token(config.model, t.seq_length, config.lora)
        self.peak_flops = self._peak_flops()
        self.faults = FaultPlan.from_environment(self.state.rank)
        self.nonfinite_in_a_row = 0
        self.skipped_updates = 0
        self.lr_position = 0.0  # the learning-rate schedule's (lr_schedule.learning_rate; TrainingState.lr_position)
        self.schedule_length = t.schedule_length()
        # Early stopping's state, saved with each checkpoint: the best validation loss (None before the first
        # evaluation) and the evaluations since it improved.
        self.validation: dict = {"best_loss": None, "evals_without_gain": 0}
        self.hf_origin: dict | None = None  # set by _resume from a checkpoint that has one (TrainingState.hf_origin)
        self.last_saved_step: int | None = None
        self.checkpoint_writer = CheckpointWriter(asynchronous=config.checkpoint.async_save, timeout=timeout)
        if to_resume is not None:
            self._resume(*to_resume)
        self.comm_ledger = None
        if t.comm_ledger and not evaluation_only:
            self.comm_ledger = StepLedgerWriter(t.run_dir, self.state.rank, self.state.named_groups(), self.step)
        self.metrics = None
        if self.state.rank == 0:
            run_dir = Path(t.run_dir)
            self.metrics = MetricsWriter(run_dir, tensorboard=t.tensorboard, resume_step=self.step, total_steps=t.steps)
            if self.step < t.steps and not self._patience_spent():  # a run that trains nothing keeps its record
                write_text_atomically(run_dir / CONFIG, config_to_toml(config))  # a full disk leaves the old one
            if t.wandb_project and t.wandb_mode != "disabled":
                self.metrics.attach_wandb(config, run_dir)

    def _build_model_and_optimizer(self) -> None:
        c, state = self.config, self.state
        param_dtype = PARAM_DTYPES[c.train.precision]
        self.streams = RNGStreams(c.train.seed, state.tp_rank, self.device, pp_rank=state.pp_rank)
        with _weights_must_fit():
            self.chunks = build_chunks(c, state, self.streams, self.kernels)
            for chunk in self.chunks:
                initialize_parameters(chunk, c.train.seed, state.tp_rank, state.tp_size)
                chunk.to(device=self.device, dtype=param_dtype)
        self.lora_base = self._load_lora_base() if c.lora.enabled else None
        named = [(n, q) for chunk in self.chunks for n, q in chunk.named_parameters() if q.requires_grad]
        self.params = [q for _, q in named]
        self.loss_scaler = None
        if c.train.precision == "fp16":
            o = c.optim
            self.loss_scaler = LossScaler(
                o.initial_loss_scale,
                o.loss_scale_window,
                hysteresis=o.loss_scale_hysteresis,
                min_scale=o.min_loss_scale,
            )
        if self.evaluation_only and c.optim.zero < 3:
            # the weights alone: fp32 masters and a gradient buffer took 12 of the 17.7 GB `loom eval` held for a 1B
            # model
            self.grads, self.grad_buffers, self.optimizer = None, [], None
            return
        experts = [q for q in self.params if param_info(q).expert_range is not None]  # (expert parallelism)
        self.grads = self._grad_buffer(  # over DP x CP: the ranks that hold the same weights
            [q for q in self.params if param_info(q).expert_range is None],
            state.grad_group,
            state.grad_size,
            state.grad_rank,
        )
        self.grad_buffers = [self.grads]
        if experts:  # over the ranks that hold the same experts
            self.grad_buffers.append(
                self._grad_buffer(experts, state.expert_grad_group, state.expert_grad_size, state.expert_grad_rank)
            )
        self.optimizer = DistributedOptimizer(
            named,
            self.grad_buffers,
            c.optim,
            state,
            c.model.num_layers,
            self.loss_scaler,
            adamw_impl=self.kernels.optimizer.impl,
            frozen=[q for chunk in self.chunks for q in chunk.parameters() if not q.requires_grad],
        )
        for chunk in self.chunks:
            chunk.param_gather = self.optimizer.sharded_params

    def _grad_buffer(self, params: list[torch.nn.Parameter], group, size: int, rank: int) -> GradBuffer:
        """The gradients of `params`, summed (and ZeRO-sharded) over `group` (this rank's place: `rank` of `size`)."""
        c, state = self.config, self.state
        buffer = GradBuffer(
            params,
            group,
            size,
            rank,
            int(c.parallel.grad_bucket_mb * 2**20),
            overlap=c.parallel.overlap_grad_reduce,
            zero=c.optim.zero,
            enabled=size > 1 or c.optim.zero >= 1 or PARAM_DTYPES[c.train.precision] != torch.float32,
            deferred=lambda q: needs_model_parallel_sum(q, state),
            before_deferred=lambda: sum_model_parallel_grads(buffer.deferred, state),
            dtype=torch.bfloat16 if c.optim.grad_dtype == "bf16" else torch.float32,
            unit_of=gather_unit if c.optim.zero == 3 else None,
            fusable=fusable_weights(self.chunks) if c.optim.grad_accumulation_fusion else (),
        )
        return buffer

    def _load_lora_base(self) -> dict:
        """Load the frozen base weights of a LoRA run (rank 0 picks and verifies the checkpoint, all read it);
        returns the pointer its checkpoints record."""
        c, state = self.config, self.state
        chosen = [None]
        if state.rank == 0:
            directory, _, pointer = open_base(c.lora.base)
            chosen[0] = (str(directory), pointer)
        dist.broadcast_object_list(chosen, src=0)
        directory, pointer = Path(chosen[0][0]), chosen[0][1]
        metadata = read_metadata(directory, verify_hashes=False)
        frozen = [(n, q) for chunk in self.chunks for n, q in chunk.named_parameters() if not q.requires_grad]
        load_model_weights(frozen, directory, metadata, state.tp_rank, state.tp_size, self.chunks)
        trainable, total = parameter_counts(self.chunks, state.pp_group, state.pp_size)
        self._log_event(
            f"LoRA rank {c.lora.rank} on {', '.join(c.lora.targets)}: {trainable:,} trainable parameters of "
            f"{total:,} ({100 * trainable / total:.2f}%); base {directory} frozen"
        )
        changes = changed_model_settings(metadata.config["model"], c.model)
        if changes:
            self._log_event(f"warning: the base {directory} was saved with other settings ({'; '.join(changes)})")
        return pointer

    def _checkpoint_to_resume(self) -> tuple[Path, CheckpointMetadata] | None:
        """The run's own newest intact checkpoint, else checkpoint.load: rank 0 picks, every rank learns it."""
        c = self.config.checkpoint
        choice = [None]
        if self.state.rank == 0:
            if c.load and not Path(c.load).exists():
                raise CheckpointError(f"checkpoint.load = {c.load} does not exist")
            found = checkpoint_to_resume(self.checkpoints, c.load, verify_hashes=c.verify)
            choice[0] = str(found[0]) if found else None
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        return Path(choice[0]), read_metadata(Path(choice[0]), verify_hashes=False)

    def _resume(self, directory: Path, metadata: CheckpointMetadata) -> None:
        """Load `directory` (the checkpoint _checkpoint_to_resume picked) into this trainer's state."""
        check_same_base(directory, metadata.lora_base, self.lora_base)
        check_same_model(directory, metadata.config, self.config)
        load_checkpoint(self.training_state(), directory, metadata, weights_only=self.fine_tunes)
        self.kernels.weights_updated(self.chunks)
        self.hf_origin = metadata.hf_origin
        if not self.fine_tunes:  # a fine-tuning run starts at step 0 with its own record
            self.step = metadata.step
            self.last_saved_step = self.step
            if metadata.validation is not None:
                self.validation = dict(metadata.validation)
            self.nonfinite_in_a_row = metadata.nonfinite_in_a_row
            self.skipped_updates = metadata.skipped_updates
            self.lr_position = metadata.schedule_position
        self._say_what_was_resumed(directory, metadata)

    def _say_what_was_resumed(self, directory: Path, metadata: CheckpointMetadata) -> None:
        """Rank 0's lines about the checkpoint just loaded, and warnings for what this run changes about it."""
        own = directory.parent == self.checkpoints
        if self.evaluation_only:
            self._log_event(f"evaluating {directory} (step {self.step})")
        elif self.fine_tunes:
            self._log_event(
                f"fine-tuning from the weights of {directory} (checkpoint.load, step {metadata.step}; "
                "checkpoint.finetune): step 1, fresh optimizer state, the data from its start"
            )
        elif not own:
            self._log_event(
                f"started from {directory} (checkpoint.load) at step {self.step}, sample "
                f"{metadata.consumed_samples:,} of its data: this run trains on from there, on its schedule"
            )
        else:
            where_it_started = self._where_it_started(metadata)
            self._log_event(f"resumed from {directory} at step {self.step}{where_it_started}")
        continues = not (self.evaluation_only or self.fine_tunes)
        for warning in resume_warnings(directory, metadata, self.config, continues_run=continues):
            self._log_event(f"warning: {warning}")

    def _where_it_started(self, metadata: CheckpointMetadata) -> str:
        """What became of checkpoint.load, for a run that resumes from its own checkpoint: where it started, or a
        setting given since, which it does not use (it had said the run started there). The run's record keeps
        where it started: a later rerun would otherwise read the unused one as its start."""
        load = self.config.checkpoint.load
        saved = metadata.config.get("checkpoint", {})
        started = saved.get("load")
        if not load:
            return ""
        if started and Path(started).resolve() == Path(load).resolve():
            return f" (this run's own; checkpoint.load = {load} is where it started)"
        self.config.checkpoint = dataclasses.replace(
            self.config.checkpoint, load=started, finetune=saved.get("finetune", False) and started is not None
        )
        return (
            f" (this run's own: checkpoint.load = {load} is not used, as a run with checkpoints of its own resumes "
            "from them; to start from it, give the run another directory: --train.name or --train.run_dir)"
        )

    def training_state(self) -> TrainingState:
        """What a checkpoint saves and restores: this trainer's state objects, handed over explicitly."""
        return TrainingState(
            config=self.config,
            parallel=self.state,
            model_chunks=self.chunks,
            optimizer=self.optimizer,
            data=self.train_batches,
            rng=self.streams,
            loss_scaler=self.loss_scaler,
            step=self.step,
            fp8=Fp8ScalingState(self.chunks) if self.kernels.fp8 == "delayed" else None,
            lora_base=self.lora_base,
            validation=self.validation,
            hf_origin=self.hf_origin,
            nonfinite_in_a_row=self.nonfinite_in_a_row,
            skipped_updates=self.skipped_updates,
            lr_position=self.lr_position,
        )

    def save(self) -> Path:
        self.last_saved_step = self.step
        return self.checkpoint_writer.save(self.training_state(), self.checkpoints, self.config.checkpoint.keep)

    def _build_data(self, evaluation_only: bool, resumed: CheckpointMetadata | None) -> None:
        c = self.config
        position = (resumed.step, resumed.consumed_samples) if resumed is not None else None
        train_set, self.valid_set = build_datasets(
            c, not evaluation_only, self.state.rank == 0, agree_across_ranks, resumed_at=position
        )
        self.train_batches = self._batches(train_set, c.train.global_batch_size_at)
        if self.state.rank == 0:
            for repeated in repeated_data(train_set):
                self._log_event(f"data: this run reads {repeated}")
            for repeated in repeated_data(self.valid_set, "validation"):
                self._log_event(f"data: each evaluation reads {repeated}")

    def _batches(self, dataset, batch_size_at) -> BatchIterator:
        """This DP rank's micro-batches of `dataset`, cut to this CP rank's chunks of each sequence."""
        state = self.state
        return BatchIterator(
            dataset,
            batch_size_at,
            self.config.train.micro_batch_size,
            state.dp_rank,
            state.dp_size,
            cp_rank=state.cp_rank,
            cp_size=state.cp_size,
            seq_length=self.config.train.seq_length,
        )

    def _peak_flops(self) -> float | None:
        if self.config.train.peak_tflops:
            return self.config.train.peak_tflops * 1e12
        if self.device.type != "cuda":
            return None
        peak = peak_tflops(torch.cuda.get_device_name(self.device), self.config.train.precision)
        return peak * 1e12 if peak else None

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _schedule(self, microbatches: int, forward_only: bool = False) -> list:
        """This rank's pipeline op list for a step of `microbatches` (several sizes under ramp-up)."""
        key = (microbatches, forward_only)
        if key not in self._schedules:
            p = self.config.parallel
            self._schedules[key] = build_schedule(self.state.pp_rank, p.pp, p.vp, microbatches, forward_only)
        return self._schedules[key]

    def _set_last_microbatch(self, last: bool) -> None:
        for grads in self.grad_buffers:
            grads.last_microbatch = last

    def _global_sum(self, local_sum: torch.Tensor) -> torch.Tensor:
        """Sum the per-rank shares of a loss over DP x CP and over the pipeline (only the last stage has one)."""
        if self.state.grad_size > 1:
            dist.all_reduce(local_sum, group=self.state.grad_group)
        if self.state.pp_size > 1:
            dist.all_reduce(local_sum, group=self.state.pp_group)
        return local_sum

    def _train_mode(self, training: bool) -> None:
        for chunk in self.chunks:
            chunk.train(training)

    def train_step(self, stop: StopRequest | None = None) -> dict:
        """One optimizer step; returns its metrics row. With `stop`, the ranks also agree on the most urgent
        stop code (stop.code afterwards), read in the step's one device-to-host transfer."""
        ledger = contextlib.nullcontext() if self.comm_ledger is None else self.comm_ledger.step(self.step + 1)
        with self._first_compiled("step"), ledger:
            return self._train_step(stop)

    def _train_step(self, stop: StopRequest | None) -> dict:
        t = self.config.train
        global_batch = t.global_batch_size_at(self.train_batches.consumed_samples)
        step_share = global_batch / t.global_batch_size
        lr = learning_rate(self.lr_position, self.config.optim, self.schedule_length, step_share)
        self._train_mode(True)
        for grads in self.grad_buffers:
            grads.start_step()
        microbatches = self.train_batches.next_step(self.device)
        scale = self.loss_scaler.scale if self.loss_scaler else 1.0
        # Each rank back-propagates scale x its share of the global-batch mean; x grad_size makes that scale x its
        # own tokens' mean, as in Megatron-LM, so an fp16 scale keeps the gradients it keeps there at any dp x cp
        # (the reduced sum is grad_size times larger, in fp32 buffers; prepare unscales both factors)
        backward_scale = scale * self.state.grad_size if self.loss_scaler else 1.0
        loss_sum = self.executor.run(
            self._schedule(len(microbatches)),
            microbatches,
            global_batch * t.seq_length,
            self._set_last_microbatch,
            record=t.record_pipeline_timeline,
            loss_scale=backward_scale,
        )
        for grads in self.grad_buffers:
            grads.finish()
        if self.optimizer.sharded_params is not None:
            self.optimizer.sharded_params.free_all()
        squared_norm = self.optimizer.prepare()
        # The step's one device-to-host transfer: the loss and the gradient norm together (the update and the
        # NaN policy need both on the host; every other value stays on the device).
        # Filled on the device: a tensor made from a host value is a blocking copy, which waits for the GPU's queue.
        stop_code = torch.full((), float(stop.code if stop is not None else 0), device=self.device)
        if stop is not None:
            dist.all_reduce(stop_code, op=dist.ReduceOp.MAX)
        zero = torch.zeros((), dtype=torch.float32, device=self.device)  # a rank whose blocks logged none
        router_losses = self.config.model.router_loss_metrics
        sums = [loss_sum, *(self.executor.router_loss_sums.get(name, zero) for name in router_losses)]
        sums = self._global_sum(torch.stack(sums))  # the router losses ride on the loss's sum
        figures = torch.cat([sums, torch.stack([squared_norm, stop_code])])
        loss, *router_loss_values, squared_norm, stop_code = figures.tolist()
        if stop is not None:
            self._adopt_agreed_stop(stop, stop_code)
        if self.step + 1 in self.faults.nan_loss_at_steps:
            loss = squared_norm = math.nan
        skipped_before = self.loss_scaler.skipped_steps if self.loss_scaler is not None else 0
        result = self.optimizer.apply(lr, math.sqrt(squared_norm), skip=not math.isfinite(loss))
        if not result["skipped"]:  # a skipped update leaves the model as it was, its experts' biases too
            m = self.config.model
            update_expert_biases(self.chunks, self.executor.expert_loads, m.moe_expert_bias_rate, self.state.grad_group)
        self.kernels.weights_updated(self.chunks)
        self.step += 1
        self.skipped_updates += result["skipped"]
        # A skipped update leaves the schedule where it was (Megatron-LM and DeepSpeed step their schedulers only
        # after an applied update): an fp16 run's early overflows then do not eat into the warmup.
        self.lr_position += 0.0 if result["skipped"] else step_share
        row = {"loss": loss, "lr": lr, "grad_norm": result["grad_norm"], "global_batch_size": global_batch}
        row.update(zip(router_losses, router_loss_values))
        if self.loss_scaler is not None:
            if self.loss_scaler.skipped_steps > skipped_before:
                self._log_event(
                    f"step {self.step}: fp16 gradients overflowed at loss scale {scale:g}; update skipped "
                    f"(the scale is now {self.loss_scaler.scale:g}; {self.loss_scaler.skipped_steps} skipped so far)"
                )
            row.update(loss_scale=scale, skipped_steps=self.loss_scaler.skipped_steps)
        self._apply_nan_policy(result["nonfinite"], loss, result["grad_norm"])
        if self.nonfinite_in_a_row:
            row["nonfinite_skipped"] = self.nonfinite_in_a_row
        return row

    def _apply_nan_policy(self, nonfinite: bool, loss: float, grad_norm: float) -> None:
        """Every rank sees the same global loss and norm, so all ranks take the same branch here."""
        t = self.config.train
        if not nonfinite:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        what = f"loss {loss} / gradient norm {grad_norm} at step {self.step}"
        newest = (
            f"the newest checkpoint is {self.checkpoints} (step {self.last_saved_step})"
            if self.last_saved_step is not None
            else "no checkpoint was saved by this job"
        )
        if t.nan_policy == "stop":
            raise TrainingDiverged(
                f"{what} (train.nan_policy = stop); {newest}. Lower optim.lr, clip harder (a lower optim.clip_grad, "
                f"now {self.config.optim.clip_grad:g}; 0 is off) or set --train.nan_policy skip"
            )
        if self.nonfinite_in_a_row > t.max_skipped_steps:
            raise TrainingDiverged(
                f"{what}: {self.nonfinite_in_a_row} non-finite steps in a row "
                f"(train.max_skipped_steps = {t.max_skipped_steps}); {newest}"
            )
        self._log_event(f"{what}: update skipped (train.nan_policy = skip)")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over train.eval_iters global batches (the same batches every time)."""
        t = self.config.train
        batches = self._batches(self.valid_set, lambda _: t.global_batch_size)
        self._train_mode(False)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        # `loom eval` can take long on one CPU rank: it shows batches done and time left; training's periodic
        # validation stays quiet between its console lines.
        shown = self.evaluation_only and self.state.rank == 0
        bar = tqdm(total=t.eval_iters, desc="evaluating", unit="batch", file=sys.stderr, disable=not shown)
        with self._first_compiled("evaluation"), bar:
            for _ in range(t.eval_iters):
                total += self.executor.run(
                    self._schedule(self.config.num_microbatches, forward_only=True),
                    batches.next_step(self.device),
                    t.global_batch_size * t.seq_length * t.eval_iters,
                )
                bar.update()
        return self._global_sum(total).item()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _agreed_stop(self, stop: StopRequest) -> int:
        """The most urgent stop code any rank holds (signals reach ranks at different moments)."""
        code = torch.tensor([stop.code], dtype=torch.int64, device=self.device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return self._adopt_agreed_stop(stop, code.item())

    @staticmethod
    def _adopt_agreed_stop(stop: StopRequest, agreed: float) -> int:
        """The ranks' agreed code, which decides; the local code only grows (a signal that came during the
        exchange must not be overwritten)."""
        stop.code = max(stop.code, int(agreed))
        stop.agreed = int(agreed)
        return int(agreed)

    def run(self, stop: StopRequest | None = None) -> list[dict]:
        """Train for train.steps (or until early stopping); return the logged rows.

        `stop` (optional) has an int attribute `code` that a signal handler sets (0: go on); at each
        step boundary the ranks agree on the largest code, and a non-zero one checkpoints and returns
        with `stop.code` set to the agreed value (the launcher decides whether to exit or requeue).
        """
        t = self.config.train
        rows = []
        stop_at = self._stop_at()
        clock = StepClock()
        # Later agreements ride on each step's own transfer (train_step); this one covers a stop before the first.
        stop_agreed = stop is not None and self._agreed_stop(stop)
        self._sync()
        clock.restart()
        while self.step < stop_at:
            if stop_agreed:
                if self.last_saved_step != self.step:
                    self.save()
                self.checkpoint_writer.wait()
                self._log_event(f"stop requested: checkpoint of step {self.step} saved in {self.checkpoints}")
                break
            self.checkpoint_writer.raise_if_failed()
            self.faults.before_step(self.step, stop)
            row = self.train_step(stop)
            stop_agreed = stop is not None and stop.agreed > 0
            clock.count(row["global_batch_size"] * t.seq_length)
            if self.step % t.log_interval == 0 or self.step == t.steps:
                self._sync()  # a device sync on logging steps only
                rows.append(self._log_step(row, clock, first=not rows))
            saving = self._saves_at(self.step, stop_at)
            evaluating = self.valid_set is not None and (self.step % t.eval_interval == 0 or self.step == t.steps)
            stopping_early = False
            if evaluating:  # before the save, which then holds this evaluation's early-stopping state
                val_loss = self.evaluate()
                rows.append(self._log({"step": self.step, "val_loss": val_loss, "val_ppl": perplexity(val_loss)}))
                self._record_validation(val_loss)
                stopping_early = self._patience_spent()
                c = self.config.checkpoint
                saving = saving or (stopping_early and bool(c.save_at_end or c.interval))
            if saving:
                self.save()
            if stopping_early:
                self._log_event(f"early stop at step {self.step}: {self._no_gain_in_validation()}")
                break
            if saving or evaluating:  # their time is not training throughput
                self._sync()
                clock.restart()
        if t.record_pipeline_timeline:
            self.write_pipeline_timeline()
        return rows

    def _stop_at(self) -> int:
        """The step this job trains to: train.steps, sooner with train.exit_after, now if there is nothing to
        train (said on rank 0)."""
        t = self.config.train
        stop_at = min(t.steps, self.step + t.exit_after) if t.exit_after else t.steps
        c = self.config.checkpoint
        if not (c.interval or c.save_at_end or t.exit_after):
            self._log_event(
                "this run saves no checkpoint unless a stop signal asks for one (checkpoint.interval = 0, "
                f"checkpoint.save_at_end = false): a rerun of it starts again from step {self.step + 1}; "
                "--checkpoint.interval N keeps some"
            )
        if self.step >= t.steps:
            self._log_event(run_is_complete(t.run_dir, self.step, t.steps))
        elif self._patience_spent():
            stop_at = self.step
            self._log_event(
                f"nothing to train: the run in {t.run_dir} stopped early at step {self.step}: "
                f"{self._no_gain_in_validation()}; raise --train.early_stop_patience, or set it to 0, to train on"
            )
        return stop_at

    def _log_step(self, step_row: dict, clock: StepClock, first: bool) -> dict:
        """Log a training step's row with the throughput of the steps since the last logged one (timed from sync
        to sync by `clock`) and the whole run's time left, also when train.exit_after ends this job before it."""
        tokens_per_s = clock.lap()
        mfu = (
            self.flops_per_token * tokens_per_s / (self.peak_flops * self.state.world_size) if self.peak_flops else None
        )
        row = {
            "step": self.step,
            **step_row,
            "tokens": self.train_batches.consumed_tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "mem_gb": memory_gb(self.device),
        }
        if first:  # the first row of each job records the kernels this job runs
            row["kernels"] = self.kernels.as_dict()
        return self._log(row, clock.seconds_left(self.config.train.steps - self.step))

    def _record_validation(self, loss: float) -> None:
        best = self.validation["best_loss"]
        # A NaN kept as the best would stay it (nothing compares below NaN): every later evaluation a "no gain".
        if math.isfinite(loss) and (best is None or loss < best):
            self.validation = {"best_loss": loss, "evals_without_gain": 0}
        else:
            self.validation = {"best_loss": best, "evals_without_gain": self.validation["evals_without_gain"] + 1}

    def _no_gain_in_validation(self) -> str:
        best, evaluations = self.validation["best_loss"], self.validation["evals_without_gain"]
        if best is None:
            return f"no evaluation in {evaluations} has given a finite validation loss"
        return f"validation loss has not improved for {evaluations} evaluations (best {best:.4f})"

    def _patience_spent(self) -> bool:
        patience = self.config.train.early_stop_patience
        return bool(patience) and self.validation["evals_without_gain"] >= patience

    def _saves_at(self, step: int, stop_at: int) -> bool:
        """Whether `step` is saved: every checkpoint.interval steps; the last of a job that train.exit_after ends
        (the next job resumes from it); the run's last unless it keeps no checkpoints (no interval, save_at_end
        false): a run with periodic saves that left its last steps unsaved would train them again on every rerun."""
        c = self.config.checkpoint
        if c.interval and step % c.interval == 0:
            return True
        return step == stop_at and bool(step < self.config.train.steps or c.save_at_end or c.interval)

    def write_pipeline_timeline(self) -> None:
        """Gather the last step's per-op times of pipeline 0 and write them to the run directory."""
        if self.state.tp_rank or self.state.dp_rank or self.state.cp_rank:
            return
        ranks = [None] * self.state.pp_size
        dist.all_gather_object(ranks, self.executor.timeline, group=self.state.pp_group)
        if self.state.rank == 0:
            origin = min(span[3] for rank in ranks for span in rank)
            data = {
                "layout": {
                    "pp": self.state.pp_size,
                    "vp": self.state.vp_size,
                    "microbatches": self.config.num_microbatches,
                },
                "ranks": [
                    [(k, mb, c, start - origin, end - origin) for k, mb, c, start, end in rank] for rank in ranks
                ],
            }
            write_text_atomically(Path(self.config.train.run_dir) / TIMELINE, json.dumps(data))

    def _log(self, row: dict, eta_s: float | None = None) -> dict:
        if self.metrics is not None:
            self.metrics.write(row, eta_s)
        return row

    def _log_event(self, message: str) -> None:
        if self.state.rank == 0:
            print(message, flush=True)

    @property
    def _stage_named(self) -> str:
        return f" on pipeline stage {self.state.pp_rank}" if self.state.pp_size > 1 else ""

    def _warn_once_per_stage(self, message: str) -> None:
        """A stage's blocks are the same on all its ranks, so one of them (the first of its tp x cp x dp) says it."""
        s = self.state
        if s.tp_rank == 0 and s.cp_rank == 0 and s.dp_rank == 0:
            print(message, flush=True)

    def _first_compiled(self, what: str) -> contextlib.AbstractContextManager:
        """Around the first training step or the first evaluation (training's or `loom eval`'s), which compile the
        blocks' graphs: a compiler failure leaves them eager, said in one line; the step's time is said too."""
        if what not in self.compiles_pending:
            return contextlib.nullcontext()
        self.compiles_pending.discard(what)
        timed = self._log_event if what == "step" else None
        return first_compiled_step(timed, self._warn_once_per_stage, self._stage_named)

    def close(self) -> None:
        self.checkpoint_writer.wait()
        for grads in self.grad_buffers:
            grads.remove_hooks()
        if self.optimizer is not None and self.optimizer.sharded_params is not None:
            self.optimizer.sharded_params.remove_hooks()
        if self.metrics is not None:
            self.metrics.close()

"""Distributed save: every rank writes its own pieces in parallel, rank 0 seals the checkpoint.

Sequence, so that a crash at any point leaves the previous checkpoint as `latest`:
1. every rank writes rank<r>.safetensors into iter_N.tmp/ (temporary name, then renamed);
2. the file names, sizes, sha256 and tensor keys are gathered on rank 0;
3. rank 0 seals it with format.commit(): metadata.json, rename iter_N.tmp -> iter_N, `latest`,
   then removes checkpoints beyond the newest `keep`.
Which ranks write what: model weights by the first of the DP x CP ranks holding them (grad rank 0) of each
(TP, PP) position (under ZeRO-3 all of them gather the weights, a bucket at a time, for it); master weights and
optimizer state by their owner (every DP x CP rank with optim.zero >= 1, else grad rank 0); FP8 scaling state by
TP and grad rank 0 of each pipeline stage; RNG by everyone.
With checkpoint.async_save, steps 1-3 run in a background thread while training continues.
What is saved comes from a TrainingState (state.py), never from the trainer itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from loom.engine.checkpoint.format import (
    CheckpointError,
    CheckpointLayout,
    CheckpointMetadata,
    FileRecord,
    buffer_key,
    commit,
    fp8_key,
    iteration_dir,
    make_staging_dir,
    model_key,
    model_range_key,
    optim_key,
    rng_key,
    staging_dir,
    tokenizer_record,
    write_rank_file,
)
from loom.engine.checkpoint.state import TrainingState
from loom.engine.config_io import config_to_dict
from loom.engine.data.indexed import dataset_record
from loom.engine.faults import FaultPlan
from loom.engine.model.moe import expert_biases
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.sharding import ShardSpec, held_offset


@dataclass
class _RankReport:
    """What one rank tells rank 0 about the file it wrote."""

    file: str
    record: FileRecord
    keys: list[str]
    specs: dict[str, ShardSpec]
    optimizer_step: int | None


def _model_pieces(state: TrainingState) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """This TP rank's shard of every weight (written once per replica: by grad rank 0; an expert-parallel rank's
    experts, a flat range of the shard, by expert_grad rank 0). Under ZeRO-3 every DP x CP rank takes part in
    gathering the weights, a bucket at a time, and grad rank 0 keeps a host copy of each."""
    pieces, specs = {}, {}
    p = state.parallel
    sharded = state.optimizer.sharded_params
    writer = p.grad_rank == 0  # one of the DP x CP ranks holding the same weights
    if not writer and sharded is None and p.expert_grad_rank != 0:
        return pieces, specs
    weights = sharded.whole_weights() if sharded is not None else ((q, q) for _, q in state.named_parameters())
    for param, weight in weights:
        info = param_info(param)
        experts = info.expert_range is not None
        if info.tied_copy or not param.requires_grad or not (p.expert_grad_rank == 0 if experts else writer):
            continue  # (a LoRA base is not saved)
        specs[info.name] = info.shard_spec
        if experts:
            start = held_offset(info, info.shard_spec.local_shape(p.tp_size))
            pieces[model_range_key(info.name, p.tp_rank, start, start + param.numel())] = weight.reshape(-1)
            continue
        pieces[model_key(info.name, p.tp_rank)] = weight.detach().cpu().clone() if sharded else weight
    return pieces, specs


def _optimizer_pieces(state: TrainingState) -> tuple[dict[str, torch.Tensor], int | None]:
    """Master weights and optimizer state of the segments this rank owns, and the optimizer's step."""
    optimizer, tp_rank, tp = state.optimizer, state.parallel.tp_rank, state.parallel.tp_size
    pieces: dict[str, torch.Tensor] = {}
    step = None
    for seg in optimizer.segments:
        info = param_info(seg.param)
        if info.tied_copy or not optimizer.writes(seg):
            continue
        name = info.name
        offset = held_offset(info, info.shard_spec.local_shape(tp))  # the ranges are the TP shard's
        start, end = offset + seg.start, offset + seg.end
        if not seg.aliases_param:
            pieces[optim_key("master", name, tp_rank, start, end)] = seg.master.detach().reshape(-1)
        for key, value in optimizer.inner.state.get(seg.master, {}).items():
            if torch.is_tensor(value) and value.numel() == seg.end - seg.start:
                pieces[optim_key(key, name, tp_rank, start, end)] = value.reshape(-1)
            elif key == "step":
                step = int(value)
            elif torch.is_tensor(value):  # factored (Adafactor) state: kept per TP rank, not resharded
                pieces[f"factored/{key}/{name}/tp{tp_rank}"] = value
    return pieces, step


def _fp8_pieces(state: TrainingState) -> dict[str, torch.Tensor]:
    """FP8 scaling state of this stage's modules, written by one rank per stage: amaxes are reduced over
    the TP group, so every TP rank holds the same (fp8_state.py), and grad rank 0's stands for the replicas."""
    p = state.parallel
    if state.fp8 is None or p.tp_rank != 0 or p.grad_rank != 0:
        return {}
    return {fp8_key(name): value for name, value in state.fp8.state_dict().items()}


def _buffer_pieces(state: TrainingState) -> dict[str, torch.Tensor]:
    """The experts' biases of this stage's MoE blocks, written by one rank per stage (every rank of a stage holds
    the same: moe.update_expert_biases)."""
    p = state.parallel
    if p.tp_rank != 0 or p.grad_rank != 0:
        return {}
    return {buffer_key(name): value for name, value in expert_biases(state.model_chunks).items()}


def collect_pieces(state: TrainingState) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec], int | None]:
    """This rank's tensors to write (on the CPU), the ShardSpecs of its weights, and the optimizer's step."""
    model, specs = _model_pieces(state)
    optimizer, step = _optimizer_pieces(state)
    rng = {rng_key(state.parallel.rank, name): value for name, value in state.rng.state_dict().items()}
    pieces = {**model, **optimizer, **_fp8_pieces(state), **_buffer_pieces(state), **rng}
    return {k: v.detach().cpu().contiguous() for k, v in pieces.items()}, specs, step


def _dataset_records(paths: list[str]) -> list[dict] | None:
    records = [dataset_record(prefix) for prefix in paths]
    return None if None in records else records


def describe_run(state: TrainingState) -> CheckpointMetadata:
    """metadata.json's facts about the run, taken at the moment of the save; the files are added when sealing."""
    p, c = state.parallel, state.config
    position = state.data.state_dict()
    return CheckpointMetadata(
        step=state.step,
        consumed_samples=position["consumed_samples"],
        tokens=position["consumed_tokens"],
        layout=CheckpointLayout(
            tp=p.tp_size,
            pp=p.pp_size,
            vp=p.vp_size,
            dp=p.dp_size,
            cp=p.cp_size,
            ep=p.ep_size,
            world=p.world_size,
            zero=c.optim.zero,
            optimizer=c.optim.name,
            precision=c.train.precision,
        ),
        optimizer_step=0,
        loss_scaler=state.loss_scaler.state_dict() if state.loss_scaler else None,
        config=config_to_dict(c),
        specs={},
        files={},
        index={},
        lora_base=state.lora_base,
        validation=state.validation,
        nonfinite_in_a_row=state.nonfinite_in_a_row,
        skipped_updates=state.skipped_updates,
        lr_position=state.lr_position,
        datasets=_dataset_records(c.data.paths),
        tokenizer=tokenizer_record(c.data.tokenizer),
        **(state.hf_origin or {}),
    )


class CheckpointWriter:
    """Saves checkpoints; with `asynchronous`, files are written and sealed by a background thread
    while training goes on (the pieces are copied first, so later steps cannot change them).

    Sealing uses a process group of its own (gloo), so its collectives never interleave with the
    training's. All ranks create the writer together.
    """

    def __init__(self, asynchronous: bool = False, timeout: datetime.timedelta | None = None):
        self.asynchronous = asynchronous
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: TrainingState, checkpoints: Path, keep: int) -> Path:
        """Checkpoint `state` as iteration state.step under `checkpoints`; all ranks call this together."""
        self.wait()
        started = time.perf_counter()
        rank = state.parallel.rank
        final = iteration_dir(checkpoints, state.step)
        staging = make_staging_dir(final) if rank == 0 else staging_dir(final)
        dist.barrier(group=self.group)
        pieces, specs, optimizer_step = collect_pieces(state)
        if self.asynchronous:
            pieces = {k: v.clone() for k, v in pieces.items()}
        job = (
            rank,
            state.parallel.world_size,
            staging,
            final,
            pieces,
            specs,
            optimizer_step,
            describe_run(state),
            keep,
            started,
        )
        if self.asynchronous:
            self._thread = threading.Thread(target=self._run, args=job, daemon=True)
            self._thread.start()
        else:
            self._write(*job)
        return final

    def _run(self, *job) -> None:
        try:
            self._write(*job)
        except BaseException as error:  # noqa: BLE001 - re-raised in the training thread by wait()
            self._error = error

    def _write(self, rank, world, staging, final, pieces, specs, optimizer_step, run, keep, started) -> None:
        with _disk_full_said(staging, final, run.step):
            name, record = write_rank_file(staging, rank, pieces)
        FaultPlan.from_environment(rank).after_checkpoint_file(run.step)
        report = _RankReport(name, record, list(pieces), specs, optimizer_step)
        reports: list[_RankReport | None] = [None] * world
        dist.all_gather_object(reports, report, group=self.group)
        if rank == 0:
            with _disk_full_said(staging, final, run.step):
                commit(staging, final, _complete(run, reports), keep=keep)
            # a save of GBs said nothing (Megatron says each); a background one says when it is done
            size = sum(report.record.size for report in reports)
            shown = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
            seconds = time.perf_counter() - started
            where = ", in the background" if self.asynchronous else ""
            print(f"checkpoint: step {run.step} saved to {final} ({shown} in {seconds:.1f} s{where})", flush=True)
        dist.barrier(group=self.group)

    def raise_if_failed(self) -> None:
        """A background save that failed (a full disk) raises its error now, at a step boundary: at the next save,
        training went on for an interval first, its steps then lost."""
        if self._error is not None:
            self.wait()

    def wait(self) -> None:
        """Block until a background save has finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


@contextlib.contextmanager
def _disk_full_said(staging: Path, final: Path, step: int) -> Iterator[None]:
    """A save that runs out of space says what a user does next: the unfinished save's folder (the other ranks'
    files in it, GBs on a full disk) is never loaded and can go, and a rerun resumes the newest checkpoint."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        unfinished = f" ({staging.name}/, this unfinished save, can go)" if staging.exists() else ""
        raise CheckpointError(
            f"no space left to save step {step} in {final.parent} ({error.filename or staging}: {error.strerror}); "
            f"free some space{unfinished} and rerun: it resumes from the newest complete checkpoint, if any"
        ) from error


def _complete(run: CheckpointMetadata, reports: list[_RankReport]) -> CheckpointMetadata:
    """The run's metadata with every rank's file, pieces, ShardSpecs and the optimizer's step."""
    steps = {r.optimizer_step for r in reports if r.optimizer_step is not None}
    return dataclasses.replace(
        run,
        optimizer_step=max(steps) if steps else 0,
        specs={name: spec for r in reports for name, spec in r.specs.items()},
        files={r.file: r.record for r in reports},
        index={key: r.file for r in reports for key in r.keys},
    )

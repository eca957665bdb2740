"""Distributed save: every rank writes its own pieces in parallel, rank 0 seals the checkpoint.

Sequence, so that a crash at any point leaves the previous checkpoint as `latest`:
1. every rank writes rank<r>.safetensors into iter_N.tmp/ (temporary name, then renamed);
2. the file names, sizes, sha256 and tensor keys are gathered on rank 0;
3. rank 0 writes metadata.json, renames iter_N.tmp -> iter_N, then points `latest` at it
   (atomic rename) and removes checkpoints beyond the newest `keep`.
Which ranks write what: model weights by DP rank 0 of each (TP, PP) position; master weights and
optimizer state by their owner (every DP rank under ZeRO-1, else DP rank 0); RNG by everyone.
With checkpoint.async_save, steps 1-3 run in a background thread while training continues.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from loom.engine.atomic import write_text_atomically
from loom.engine.checkpoint.format import (
    FORMAT_VERSION,
    LATEST,
    METADATA,
    candidates,
    iteration_dir,
    model_key,
    optim_key,
    rank_file,
    sha256_of,
    spec_to_json,
)
from loom.engine.config_io import config_to_dict
from loom.engine.faults import FaultPlan


def logical_name(name: str, param: torch.nn.Parameter) -> str:
    """The layout-independent name (the last stage's tied output copy is the embedding)."""
    return getattr(param, "init_name", name)


def collect_pieces(trainer) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's tensors to write, and the per-parameter facts rank 0 records."""
    state, optimizer = trainer.state, trainer.optimizer
    pieces: dict[str, torch.Tensor] = {}
    specs, step = {}, None
    if state.dp_rank == 0:
        for name, param in optimizer.named_params:
            if getattr(param, "tied_copy", False):
                continue
            pieces[model_key(name, state.tp_rank)] = param.detach()
            specs[name] = spec_to_json(param.shard_spec)
    for seg in optimizer.segments:
        if getattr(seg.param, "tied_copy", False) or not (optimizer.zero1 or state.dp_rank == 0):
            continue
        name = logical_name(optimizer.names[seg.param], seg.param)
        if not seg.aliases_param:
            pieces[optim_key("master", name, state.tp_rank, seg.start, seg.end)] = seg.master.detach().reshape(-1)
        for key, value in optimizer.inner.state.get(seg.master, {}).items():
            if torch.is_tensor(value) and value.numel() == seg.end - seg.start:
                pieces[optim_key(key, name, state.tp_rank, seg.start, seg.end)] = value.reshape(-1)
            elif key == "step":
                step = int(value)
            elif torch.is_tensor(value):  # factored (Adafactor) state: kept per TP rank, not resharded
                pieces[f"factored/{key}/{name}/tp{state.tp_rank}"] = value
    pieces[f"rng/{state.rank}/torch"] = torch.get_rng_state()
    for stream, value in trainer.streams.states.items():
        pieces[f"rng/{state.rank}/{stream}"] = value
    return {k: v.detach().cpu().contiguous() for k, v in pieces.items()}, {"specs": specs, "optimizer_step": step}


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

    def save(self, trainer, checkpoints: Path, keep: int) -> Path:
        """Checkpoint the trainer's current step; all ranks call this together."""
        self.wait()
        state = trainer.state
        final = iteration_dir(checkpoints, trainer.step)
        staging = final.with_name(final.name + ".tmp")
        if state.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier(group=self.group)
        pieces, facts = collect_pieces(trainer)
        if self.asynchronous:
            pieces = {k: v.clone() for k, v in pieces.items()}
        snapshot = _run_facts(trainer)
        job = (state.rank, state.world_size, checkpoints, staging, final, pieces, facts, snapshot, keep)
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

    def _write(self, rank, world, checkpoints, staging, final, pieces, facts, snapshot, keep) -> None:
        name = rank_file(rank)
        tmp = staging / f".{name}.tmp"
        save_file(pieces, str(tmp))
        os.replace(tmp, staging / name)
        FaultPlan.from_environment(rank).after_checkpoint_file(snapshot["step"])
        report = {
            "file": name,
            "size": (staging / name).stat().st_size,
            "sha256": sha256_of(staging / name),
            "keys": list(pieces),
            **facts,
        }
        reports = [None] * world
        dist.all_gather_object(reports, report, group=self.group)
        if rank == 0:
            _seal(snapshot, checkpoints, staging, final, reports, keep)
        dist.barrier(group=self.group)

    def wait(self) -> None:
        """Block until a background save has finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _run_facts(trainer) -> dict:
    """What metadata.json records about the run, taken at the moment of the save."""
    s, c = trainer.state, trainer.config
    return {
        "step": trainer.step,
        "consumed_samples": trainer.train_batches.consumed_samples,
        "tokens": trainer.train_batches.consumed_samples * c.train.seq_length,
        "layout": {
            "tp": s.tp_size,
            "pp": s.pp_size,
            "vp": s.vp_size,
            "dp": s.dp_size,
            "world": s.world_size,
            "zero1": c.optim.zero1,
            "optimizer": c.optim.name,
            "precision": c.train.precision,
        },
        "loss_scaler": trainer.loss_scaler.state_dict() if trainer.loss_scaler else None,
        "config": config_to_dict(c),
    }


def _seal(snapshot: dict, checkpoints: Path, staging: Path, final: Path, reports: list[dict], keep: int) -> None:
    steps = {r["optimizer_step"] for r in reports if r["optimizer_step"] is not None}
    metadata = {
        "format_version": FORMAT_VERSION,
        **snapshot,
        "optimizer_step": max(steps) if steps else 0,
        "specs": {name: spec for r in reports for name, spec in r["specs"].items()},
        "files": {r["file"]: {"size": r["size"], "sha256": r["sha256"]} for r in reports},
        "index": {key: r["file"] for r in reports for key in r["keys"]},
    }
    write_text_atomically(staging / METADATA, json.dumps(metadata, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    write_text_atomically(checkpoints / LATEST, final.name + "\n")
    for old in candidates(checkpoints)[keep:]:
        shutil.rmtree(old, ignore_errors=True)

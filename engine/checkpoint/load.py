"""Load a checkpoint into a TrainingState of any layout: rebuild each logical tensor, slice it anew.

For every parameter this rank holds, the pieces saved under the old layout (all old TP shards,
and with optim.zero >= 1 all old DP x CP pieces of them) are read, joined into the logical tensor through the
saved ShardSpec, and sliced with the current one: model weights into the parameter, master
weights and elementwise optimizer state into this rank's segments. One parameter is in memory at
a time. Safetensors files are opened lazily, so a rank reads only the pieces it needs. The data
iterator, loss scaler, FP8 scaling state and RNG get their saved state through their own load_state_dict().
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from loom.engine.atomic import torch_dtype_of
from loom.engine.checkpoint.format import (
    CheckpointError,
    CheckpointMetadata,
    buffer_key,
    buffer_names,
    fp8_key,
    model_key,
    parse_model_range_key,
    parse_optim_key,
    rng_key,
)
from loom.engine.checkpoint.state import TrainingState
from loom.engine.config import LoomConfig
from loom.engine.model.moe import expert_biases
from loom.engine.optim.algorithms import Adafactor, Lamb
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.sharding import ShardSpec, rank_part
from loom.engine.run_dir import checkpoints_of

if TYPE_CHECKING:
    from loom.engine.optim.distributed import DistributedOptimizer
    from loom.engine.parallel.state import ParallelState


class PieceReader:
    """Logical tensors of one checkpoint, rebuilt from the pieces its ranks wrote."""

    def __init__(self, directory: Path, metadata: CheckpointMetadata):
        self.directory, self.metadata = directory, metadata
        self.saved_tp = metadata.layout.tp
        self._files: dict[str, object] = {}
        self.optim_pieces: dict[tuple[str, int], dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self.model_ranges: dict[tuple[str, int], list] = defaultdict(list)
        """Weights saved in flat ranges of their TP shards (by expert-parallel ranks), by (name, tp rank)."""
        for key in metadata.index:
            if key.startswith("optim/"):
                state, name, tp, start, end = parse_optim_key(key)
                self.optim_pieces[(name, tp)][state].append((start, end, key))
            elif (ranged := parse_model_range_key(key)) is not None:
                name, tp, start, end = ranged
                self.model_ranges[(name, tp)].append((start, end, key))

    def _file_holding(self, key: str):
        file = self.metadata.index.get(key)
        if file is None:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {key}")
        if file not in self._files:
            self._files[file] = safe_open(str(self.directory / file), framework="pt")
        return self._files[file]

    def tensor(self, key: str) -> torch.Tensor:
        return self._file_holding(key).get_tensor(key)

    def header(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """A stored tensor's dtype and shape, from its file's header: nothing of its data is read."""
        stored = self._file_holding(key).get_slice(key)
        try:
            return torch_dtype_of(stored.get_dtype(), key), tuple(stored.get_shape())
        except ValueError as error:
            raise CheckpointError(f"checkpoint {self.directory}: {error}") from None

    def spec(self, name: str) -> ShardSpec:
        if name not in self.metadata.specs:
            raise CheckpointError(
                f"checkpoint {self.directory} has no parameter {name}; it is a checkpoint of another model"
            )
        return self.metadata.specs[name]

    def model(self, name: str) -> torch.Tensor:
        return self.spec(name).unshard([self._model_shard(name, r) for r in range(self.saved_tp)])

    def _model_shard(self, name: str, tp: int) -> torch.Tensor:
        key = model_key(name, tp)
        if key in self.metadata.index or (name, tp) not in self.model_ranges:
            return self.tensor(key)
        return self._joined(self.model_ranges[(name, tp)], name, tp, f"{name}'s weights", float32=False)

    def model_dtype(self, name: str) -> torch.dtype:
        """The dtype a weight was saved in (its first piece's header)."""
        key = model_key(name, 0)
        if key not in self.metadata.index and (name, 0) in self.model_ranges:
            key = min(self.model_ranges[(name, 0)])[2]
        return self.header(key)[0]

    def states(self, name: str) -> set[str]:
        return set(self.optim_pieces[(name, 0)])

    def optim(self, state: str, name: str) -> torch.Tensor:
        shards = [
            self._joined(self.optim_pieces[(name, tp)][state], name, tp, f"{state} of {name}")
            for tp in range(self.saved_tp)
        ]
        return self.spec(name).unshard(shards)

    def _joined(self, pieces: list, name: str, tp: int, what: str, float32: bool = True) -> torch.Tensor:
        """TP rank tp's shard of `name` from flat (start, end, key) pieces that must cover it end to end."""
        local_shape = self.spec(name).local_shape(self.saved_tp)
        pieces, reached = sorted(pieces), 0
        for start, end, _ in pieces:
            if start != reached:
                break
            reached = end
        if reached != torch.Size(local_shape).numel():
            raise CheckpointError(f"checkpoint {self.directory}: pieces of {what} do not cover it")
        flat = torch.cat([self.tensor(key).reshape(-1) for _, _, key in pieces])
        return (flat.float() if float32 else flat).view(local_shape)


def check_shapes(reader: PieceReader, named_params) -> None:
    """Refuse a checkpoint of another model, naming the first tensor that differs."""
    for name, param in named_params:
        info = param_info(param)
        saved = reader.spec(info.name).full_shape
        if tuple(saved) != info.shard_spec.full_shape:
            raise CheckpointError(
                f"checkpoint {reader.directory} is of another model: {name} has shape "
                f"{tuple(saved)} there, {info.shard_spec.full_shape} here"
            )


@torch.no_grad()
def load_model_weights(
    named_params, directory: Path, metadata: CheckpointMetadata, tp_rank: int, tp_size: int, chunks=()
) -> None:
    """Only the weights of `named_params` (a LoRA run's frozen base), and the experts' biases of `chunks`, from a
    checkpoint of any layout."""
    reader = PieceReader(directory, metadata)
    check_shapes(reader, named_params)
    for _, param in named_params:
        info = param_info(param)
        param.copy_(rank_part(info, reader.model(info.name), tp_rank, tp_size).to(param.dtype))
    load_expert_biases(list(chunks), reader, metadata)


@torch.no_grad()
def load_expert_biases(chunks: list[torch.nn.Module], reader: PieceReader, metadata: CheckpointMetadata) -> None:
    """The experts' biases of `chunks`' MoE blocks (model.moe_expert_bias), by name, so under any layout; a
    checkpoint saved without them leaves them at zero (no bias yet)."""
    for name, bias in expert_biases(chunks).items():
        if buffer_key(name) in metadata.index:
            bias.copy_(reader.tensor(buffer_key(name)))


def saved_expert_biases(directory: Path, metadata: CheckpointMetadata) -> dict[str, torch.Tensor]:
    """A checkpoint's experts' biases by name (`layers.3.mlp.router.expert_bias`); empty where it has none."""
    reader = PieceReader(directory, metadata)
    return {name: reader.tensor(key) for name, key in buffer_names(metadata).items()}


def fine_tunes_from(config: LoomConfig, checkpoint: Path) -> bool:
    """Whether a run under `config` takes only the weights of `checkpoint` (checkpoint.finetune): a checkpoint of
    checkpoint.load's, not one of the run's own, which it resumes whole."""
    return config.checkpoint.finetune and checkpoint.parent != checkpoints_of(config.train.run_dir)


@torch.no_grad()
def load_checkpoint(
    state: TrainingState, directory: Path, metadata: CheckpointMetadata, weights_only: bool = False
) -> None:
    """Restore weights, optimizer state, loss scale, data position and (under the same layout) RNG into
    `state`'s objects. The step is metadata.step; the caller takes it from there. `weights_only`
    (checkpoint.finetune): the weights, the optimizer's fp32 master copies of them and their FP8 scaling state (as
    Megatron's --finetune keeps Transformer Engine's), nothing else."""
    reader = PieceReader(directory, metadata)
    parallel, optimizer = state.parallel, state.optimizer
    named_params = state.named_parameters()
    check_shapes(reader, named_params)
    segments_of = defaultdict(list)
    for seg in optimizer.segments if optimizer is not None else ():
        segments_of[seg.param].append(seg)
    # Another optimizer's state means nothing to this one (Adam's moments are not SGD's momentum): it starts fresh
    # from the saved master weights, as the trainer tells the user, and saves no stale state later.
    same_optimizer = metadata.layout.optimizer in (None, state.config.optim.name) and not weights_only
    for _, param in named_params:
        info = param_info(param)
        weights = reader.model(info.name)
        local = rank_part(info, weights, parallel.tp_rank, parallel.tp_size).to(param.dtype)
        if optimizer is not None and optimizer.sharded_params is not None:  # ZeRO-3: gathered only around its use
            optimizer.sharded_params.load(param, local)
        else:
            param.copy_(local)
        if optimizer is not None:
            _load_segments(
                reader, optimizer, parallel, param, info.name, weights, segments_of[param], metadata, same_optimizer
            )
    _restore_fp8_scaling(state, reader, metadata)  # the scales of trained weights: a fine-tune keeps them too
    load_expert_biases(state.model_chunks, reader, metadata)  # part of the model: a fine-tune's too
    if not weights_only:
        _restore_loop_state(state, reader, metadata)


def _load_segments(
    reader: PieceReader,
    optimizer: DistributedOptimizer,
    parallel: ParallelState,
    param: torch.nn.Parameter,
    logical: str,
    weights: torch.Tensor,
    segments: list,
    metadata: CheckpointMetadata,
    same_optimizer: bool,
) -> None:
    """Master weights and (from the same optimizer) elementwise optimizer state of this rank's segments of one
    parameter."""
    saved_states = reader.states(logical) if same_optimizer else reader.states(logical) & {"master"}
    for kind in ["master", *sorted(saved_states - {"master"})]:
        if kind == "master":
            logical_tensor = reader.optim("master", logical) if "master" in saved_states else weights.float()
        else:
            logical_tensor = reader.optim(kind, logical)
        local = rank_part(param_info(param), logical_tensor, parallel.tp_rank, parallel.tp_size).reshape(-1)
        for seg in segments:
            piece = local[seg.start : seg.end].view_as(seg.master).to(seg.master.device)
            if kind != "master":
                optimizer.inner.state[seg.master][kind] = piece.clone()
            elif not seg.aliases_param:
                seg.master.copy_(piece)
    if saved_states - {"master"}:
        for seg in segments:
            optimizer.inner.state[seg.master]["step"] = step_value(optimizer.inner, metadata.optimizer_step, seg.master)


def step_value(inner, step: int, master: torch.Tensor):
    """The optimizer state's step as `inner` keeps it: an int for loom's own algorithms; for torch's, an fp32
    tensor on the host, or on the master's device for the fused (and capturable) kernels, which take it there
    (torch's own load_state_dict places it so; CUDA's fused AdamW refuses a host step, at the first resumed step)."""
    if isinstance(inner, (Lamb, Adafactor)):
        return step
    on_device = any(group.get("fused") or group.get("capturable") for group in inner.param_groups)
    return torch.tensor(float(step), dtype=torch.float32, device=master.device if on_device else "cpu")


def _restore_fp8_scaling(state: TrainingState, reader: PieceReader, metadata: CheckpointMetadata) -> None:
    """Transformer Engine's delayed-scaling amax histories and scales, by module name, so under any layout; a module
    the checkpoint lacks keeps its own."""
    if state.fp8 is not None:
        saved = {name: fp8_key(name) for name in state.fp8.modules if fp8_key(name) in metadata.index}
        state.fp8.load_state_dict({name: reader.tensor(key) for name, key in saved.items()})


def _restore_loop_state(state: TrainingState, reader: PieceReader, metadata: CheckpointMetadata) -> None:
    state.data.load_state_dict({"consumed_samples": metadata.consumed_samples, "consumed_tokens": metadata.tokens})
    if state.loss_scaler is not None and metadata.loss_scaler:
        state.loss_scaler.load_state_dict(metadata.loss_scaler)
    p = state.parallel
    keys = {name: rng_key(p.rank, name) for name in state.rng.state_dict()}
    same_layout = metadata.layout.places_ranks_like(
        tp=p.tp_size, pp=p.pp_size, dp=p.dp_size, vp=p.vp_size, cp=p.cp_size
    )
    if same_layout and all(key in metadata.index for key in keys.values()):  # streams belong to ranks of one layout
        saved = {name: reader.tensor(key) for name, key in keys.items()}
        if same_generators(saved, state.rng.state_dict()):
            state.rng.load_state_dict(saved)


def same_generators(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint's random streams are states of this run's generators: a run resumed on another device
    (trained on CPU, resumed on CUDA) has generators of another kind, whose states another cannot take (CUDA's
    takes 16 bytes, not the CPU's 5,056, and would refuse them at the first dropout mask); its streams then start
    from their seeds."""
    return all(saved[name].shape == state.shape for name, state in current.items())

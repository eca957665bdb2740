"""Load a checkpoint into a TrainingState of any layout: rebuild each logical tensor, slice it anew.

For every parameter this rank holds, the pieces saved under the old layout (all old TP shards,
and with optim.zero >= 1 all old DP x CP pieces of them) are read, joined into the logical tensor through the
saved ShardSpec, and sliced with the current one: model weights into the parameter, master
weights and elementwise optimizer state into this rank's segments. One parameter is in memory at
a time. Safetensors files are opened lazily, so a rank reads only the pieces it needs. The data
iterator, loss scaler, FP8 scaling state and RNG get their saved state through their own load_state_dict().
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from loom.engine.atomic import torch_dtype_of
from loom.engine.checkpoint.format import (
    CheckpointError,
    CheckpointMetadata,
    fp8_key,
    model_key,
    parse_optim_key,
    rng_key,
)
from loom.engine.checkpoint.state import TrainingState
from loom.engine.config import ConfigError, LoomConfig, ModelConfig
from loom.engine.data.indexed import dataset_record
from loom.engine.optim.algorithms import Adafactor, Lamb
from loom.engine.optim.lr_schedule import learning_rate
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.sharding import ShardSpec
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
        for key in metadata.index:
            if key.startswith("optim/"):
                state, name, tp, start, end = parse_optim_key(key)
                self.optim_pieces[(name, tp)][state].append((start, end, key))

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
        return self.spec(name).unshard([self.tensor(model_key(name, r)) for r in range(self.saved_tp)])

    def states(self, name: str) -> set[str]:
        return set(self.optim_pieces[(name, 0)])

    def optim(self, state: str, name: str) -> torch.Tensor:
        spec = self.spec(name)
        local_shape = spec.local_shape(self.saved_tp)
        shards = []
        for tp in range(self.saved_tp):
            pieces = sorted(self.optim_pieces[(name, tp)][state])
            flat = torch.cat([self.tensor(key).float() for _, _, key in pieces])
            if flat.numel() != torch.Size(local_shape).numel():
                raise CheckpointError(f"checkpoint {self.directory}: pieces of {state} of {name} do not cover it")
            shards.append(flat.view(local_shape))
        return spec.unshard(shards)


# Model settings that change what the weights compute without changing any shape: a checkpoint loaded under
# other values runs, but as another model. Some changes are deliberate (a larger rope_theta to extend the
# context), so they are reported rather than refused.
FUNCTIONAL_MODEL_FIELDS = (
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
    "norm_eps",
)

# Model settings that decide which tensors a checkpoint holds, their shapes or what the block computes with them.
# A checkpoint loaded under other values is another model: a smaller one would silently drop tensors (a 4-layer
# checkpoint into 3 layers), so they are refused before anything loads.
ARCHITECTURE_MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "vocab_size",
    "position_embedding",
    "norm",
    "activation",
    "bias",
    "tie_embeddings",
)


# What a LoRA checkpoint's adapters are: other targets leave trained adapters unloaded, another alpha scales them.
ADAPTER_FIELDS = ("rank", "alpha", "targets")


def check_same_model(directory: Path, saved_config: dict, current: LoomConfig) -> None:
    """Refuse to load checkpoint `directory` (whose run's config is `saved_config`) into another architecture or,
    for a LoRA checkpoint, other adapters, naming every setting that differs and the flags that keep them (one at a
    time, a fine-tune from an import under another preset took a try per field)."""
    fields = [("model", name) for name in ARCHITECTURE_MODEL_FIELDS]
    if current.model.position_embedding == "learned":  # the learned table's length is a shape; RoPE's is not
        fields.append(("model", "max_position_embeddings"))
    if saved_config.get("lora", {}).get("rank") and current.lora.enabled:
        fields += [("lora", name) for name in ADAPTER_FIELDS]
    differences = list(_differences(saved_config, current, fields))
    if differences:
        shown = ", ".join(f"{section}.{name} = {value} there, {now} here" for section, name, value, now in differences)
        flags = _flags_keeping((f"{section}.{name}", value) for section, name, value, _ in differences)
        raise CheckpointError(
            f"checkpoint {directory} is of another model: {shown}; pass {flags} to load it (a new model needs its "
            "own run directory: another --train.name or --train.run_dir, no --checkpoint.load)"
        )


def _differences(saved_config: dict, current: LoomConfig, fields: Iterable[tuple[str, str]]) -> Iterator[tuple]:
    """(section, name, saved value, current value) for each of `fields` the saved config records otherwise."""
    for section, name in fields:
        saved, now = saved_config.get(section, {}), getattr(getattr(current, section), name)
        if name in saved and saved[name] != now:
            yield section, name, saved[name], now


# Settings that decide which samples a run reads in which order: changed on a resume, the samples from the saved
# position on are another sequence (some read twice, some never), which a user may intend (new data) or not.
DATA_ORDER_FIELDS = (
    ("train", "seed"),
    ("train", "seq_length"),
    ("data", "paths"),
    ("data", "weights"),
    ("data", "split"),
)


def changed_data_order(saved_config: dict, current: LoomConfig, saved_datasets: list | None = None) -> list[str]:
    """`section.name: saved -> current` for each of DATA_ORDER_FIELDS this run changes. With the datasets the
    checkpoint records (`saved_datasets`), data.paths are compared by the files they name, not by their spelling: a
    relative path from another working directory may name the same data, or other data under the same name."""
    fields = tuple(field for field in DATA_ORDER_FIELDS if field != ("data", "weights"))
    changes = []
    saved_data = saved_config.get("data", {})
    saved_weights = saved_data.get("weights")  # none is not written to config.toml (TOML has no null)
    if len(saved_data.get("paths", current.data.paths)) == len(current.data.paths):
        differs = _shares(saved_weights) != _shares(current.data.weights)  # [1, 1], [2, 2] and none: one blend
    else:  # the paths' change is said; weights given on either side differ too
        differs = saved_weights != current.data.weights
    if differs:
        changes.append(f"data.weights: {saved_weights} -> {current.data.weights}")
    if saved_datasets is not None:
        fields = tuple(field for field in fields if field != ("data", "paths"))
        now = [dataset_record(prefix) for prefix in current.data.paths]
        if len(saved_datasets) != len(now) or not all(map(_same_files, saved_datasets, now)):
            changes.append(f"data.paths: {_described(saved_datasets)} -> {_described(now)}")
    changes += [
        f"{section}.{name}: {saved} -> {now}"
        for section, name, saved, now in _differences(saved_config, current, fields)
    ]
    return changes


def _shares(weights: list | None) -> list[float] | None:
    """Each dataset's share of the blend (data.weights are relative, and positive), rounded past float noise; None
    (equal shares) for none or equal weights."""
    if not weights or len(set(weights)) == 1:
        return None
    return [round(weight / sum(weights), 12) for weight in weights]


def _same_files(saved: dict | None, now: dict | None) -> bool:
    """Whether two dataset_records are of the same data: the same sizes, and the same write time or (a copy) the
    same sampled bytes; a checkpoint from before loom sampled them compares the write time alone."""
    if saved is None or now is None:
        return saved is now
    if (saved["bin_bytes"], saved["idx_bytes"]) != (now["bin_bytes"], now["idx_bytes"]):
        return False
    return (
        saved.get("idx_written_ns") == now["idx_written_ns"] or saved.get("sampled_sha256", "") == now["sampled_sha256"]
    )


def _described(records: list) -> str:
    return ", ".join(
        f"{r['path']} ({r['bin_bytes']:,} bytes, written {_when(r.get('idx_written_ns'))})" if r else "(missing)"
        for r in records
    )


def _when(nanoseconds: int | None) -> str:
    if nanoseconds is None:
        return "?"
    return datetime.datetime.fromtimestamp(nanoseconds / 1e9).isoformat(sep=" ", timespec="seconds")


# Settings of the optimizer step, the loss and the batch that a resume may change on purpose (less weight decay for
# a last phase) or through a flag its rerun lost: either way the run trains otherwise from the checkpoint on.
# fp16's loss scaler reads these on a resume (its scale and counters come from the checkpoint, its rules from the
# config); optim.initial_loss_scale it does not read (resume_warnings says so).
FP16_SCALER_FIELDS = (("optim", "loss_scale_window"), ("optim", "loss_scale_hysteresis"), ("optim", "min_loss_scale"))


TRAINING_FIELDS = (
    ("optim", "weight_decay"),
    ("optim", "beta1"),
    ("optim", "beta2"),
    ("optim", "eps"),
    ("optim", "momentum"),
    ("optim", "clip_grad"),
    ("optim", "layer_lr_decay"),
    ("optim", "grad_dtype"),
    ("train", "precision"),
    ("train", "fp8"),
    ("train", "global_batch_size"),
    ("model", "dropout"),
    ("lora", "dropout"),
    *FP16_SCALER_FIELDS,
)


def changed_training_settings(saved_config: dict, current: LoomConfig) -> list[tuple[str, Any, Any]]:
    """(section.name, saved, current) for each of TRAINING_FIELDS this run changes and reads (SGD's momentum is not
    read by AdamW, Adam's betas not by SGD or Adafactor)."""
    unread = {("optim", "momentum")} if current.optim.name != "sgd" else set()
    if current.optim.name in ("sgd", "adafactor"):
        unread |= {("optim", "beta1"), ("optim", "beta2"), ("optim", "eps")}
    if not current.lora.enabled:
        unread.add(("lora", "dropout"))
    if current.train.precision != "fp16":
        unread |= set(FP16_SCALER_FIELDS)
    fields = [field for field in TRAINING_FIELDS if field not in unread]
    return [
        (f"{section}.{name}", saved, now) for section, name, saved, now in _differences(saved_config, current, fields)
    ]


def flag_value(value: Any) -> str:
    """A config value as its --section.name flag takes it."""
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _flags_keeping(saved: Iterable[tuple[str, Any]]) -> str:
    """The flags that give a run the saved values back, from (section.name, saved value) pairs."""
    return " ".join(f"--{field} {flag_value(value)}" for field, value in saved)


SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "decay")
"""The optim fields of the learning-rate schedule besides its decay's length (optim.decay_steps, else train.steps)."""


def changed_schedule(step: int, saved_config: dict, current: LoomConfig) -> str | None:
    """How the learning rate of the steps from `step` (0-based: the first one this run trains) on differs from
    what the saved run's schedule gives them (past its end: min_lr), or None where it does not."""
    saved_optim = saved_config.get("optim", {})
    fields = (*SCHEDULE_FIELDS, "decay_steps")
    try:
        saved = dataclasses.replace(current.optim, **{k: saved_optim[k] for k in fields if k in saved_optim})
    except ConfigError:  # values an older loom accepted: nothing to compare with
        return None
    saved_steps = saved_config.get("train", {}).get("steps", current.train.steps)
    end = current.train.steps
    probes = range(step, end, max(1, (end - step) // 1000))
    differs = next(
        (s for s in probes if learning_rate(s, saved, saved_steps) != learning_rate(s, current.optim, end)), None
    )
    if differs is None:
        return None
    changed = [k for k in SCHEDULE_FIELDS if getattr(saved, k) != getattr(current.optim, k)]
    changes = [f"optim.{k}: {getattr(saved, k)} -> {getattr(current.optim, k)}" for k in changed]
    keep = [f"--optim.{k} {getattr(saved, k)}" for k in changed]
    saved_length, length = saved.decay_steps or saved_steps, current.optim.decay_steps or end
    if saved_length != length and "constant" not in (saved.decay, current.optim.decay):
        changes.append(f"the decay's length: {saved_length} -> {length} steps (optim.decay_steps, else train.steps)")
        keep.append(f"--optim.decay_steps {saved_length}")
    now, then = _told_apart(learning_rate(differs, current.optim, end), learning_rate(differs, saved, saved_steps))
    return (
        f"the learning-rate schedule is not the one this run trained with ({'; '.join(changes)}): step {differs + 1} "
        f"takes lr {now} where the saved schedule gives {then}; pass {', '.join(keep)} to keep it, unless the "
        "change is intended"
    )


def _told_apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` with 3 significant digits, or as many more as show them different (lr 0.001 against 0.001)."""
    for digits in range(3, 18):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return repr(a), repr(b)


def _changed_model_fields(saved_model: dict, current: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(field, saved, current) for each functional setting of the checkpoint that this run changes. Fields a
    checkpoint predates count as their defaults."""
    defaults = ModelConfig()
    changed = []
    for field in FUNCTIONAL_MODEL_FIELDS:
        saved, now = saved_model.get(field, getattr(defaults, field)), getattr(current, field)
        if saved != now:
            changed.append((field, saved, now))
    return changed


def changed_model_settings(saved_model: dict, current: ModelConfig) -> list[str]:
    """`model.F: saved -> current` for each functional setting of the checkpoint that this run changes."""
    return [f"model.{field}: {saved} -> {now}" for field, saved, now in _changed_model_fields(saved_model, current)]


def _saved_model_flags(saved_model: dict, current: ModelConfig) -> str:
    """The flags that give this run the checkpoint's settings back (the warning named rope_theta whatever changed)."""
    return _flags_keeping((f"model.{field}", saved) for field, saved, _ in _changed_model_fields(saved_model, current))


def resume_warnings(
    directory: Path, metadata: CheckpointMetadata, config: LoomConfig, continues_run: bool
) -> list[str]:
    """What a run under `config` changes about the checkpoint it resumes from `directory`: another optimizer (its
    state starts fresh), data order, learning-rate schedule or optimizer, loss and batch settings (when it trains on
    from the checkpoint's step, `continues_run`: its own, or checkpoint.load's without checkpoint.finetune), another
    model (always)."""
    warnings = []
    saved_optimizer = metadata.layout.optimizer
    if continues_run and saved_optimizer not in (None, config.optim.name):
        warnings.append(
            f"{directory} was trained with {saved_optimizer}; its optimizer state does not carry over "
            f"to {config.optim.name}, which starts from fresh state (the weights are resumed)"
        )
    reordered = changed_data_order(metadata.config, config, metadata.datasets)
    if reordered and continues_run:
        warnings.append(
            f"from step {metadata.step} on this run reads its data in another order than it did "
            f"({'; '.join(reordered)}): some samples may be read twice and others not at all"
        )
    schedule = changed_schedule(metadata.step, metadata.config, config) if continues_run else None
    if schedule:
        warnings.append(schedule)
    trains_otherwise = changed_training_settings(metadata.config, config) if continues_run else []
    if trains_otherwise:
        changes = "; ".join(f"{field}: {saved} -> {now}" for field, saved, now in trains_otherwise)
        flags = _flags_keeping((field, saved) for field, saved, _ in trains_otherwise)
        warnings.append(
            f"this run trains on from step {metadata.step} with other settings than {directory} was saved with "
            f"({changes}); pass {flags} to keep them, unless the change is intended"
        )
    saved_scale = metadata.config.get("optim", {}).get("initial_loss_scale", config.optim.initial_loss_scale)
    scaled = continues_run and metadata.loss_scaler and config.train.precision == "fp16"
    if scaled and saved_scale != config.optim.initial_loss_scale:
        warnings.append(
            f"optim.initial_loss_scale = {config.optim.initial_loss_scale} is not used: this run continues the loss "
            f"scale {metadata.loss_scaler['scale']:g} that {directory} reached (fp16's scaler state resumes with the "
            "run, as in Megatron-LM); the initial scale is a run's first step's, or a fine-tune's from this "
            "checkpoint (--checkpoint.load with --checkpoint.finetune true, in a run directory of its own)"
        )
    changes = changed_model_settings(metadata.config["model"], config.model)
    if changes:
        flags = _saved_model_flags(metadata.config["model"], config.model)
        warnings.append(
            f"this run computes a different model than {directory} was saved with "
            f"({'; '.join(changes)}); pass the saved values ({flags}) unless that is intended"
        )
    return warnings


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
def load_model_weights(named_params, directory: Path, metadata: CheckpointMetadata, tp_rank: int, tp_size: int) -> None:
    """Only the weights of `named_params` (a LoRA run's frozen base), from a checkpoint of any layout."""
    reader = PieceReader(directory, metadata)
    check_shapes(reader, named_params)
    for _, param in named_params:
        info = param_info(param)
        param.copy_(info.shard_spec.shard(reader.model(info.name), tp_rank, tp_size).to(param.dtype))


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
        local = info.shard_spec.shard(weights, parallel.tp_rank, parallel.tp_size).to(param.dtype)
        if optimizer is not None and optimizer.sharded_params is not None:  # ZeRO-3: gathered only around its use
            optimizer.sharded_params.load(param, local)
        else:
            param.copy_(local)
        if optimizer is not None:
            _load_segments(
                reader, optimizer, parallel, param, info.name, weights, segments_of[param], metadata, same_optimizer
            )
    _restore_fp8_scaling(state, reader, metadata)  # the scales of trained weights: a fine-tune keeps them too
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
        local = param_info(param).shard_spec.shard(logical_tensor, parallel.tp_rank, parallel.tp_size).reshape(-1)
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

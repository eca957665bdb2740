"""LoRA (Hu et al. 2021): a frozen base model plus trainable low-rank adapters, W x + (alpha / r) B A x.

Adapters sit on loom's tensor-parallel linear layers (engine/parallel/layers.py) and are split so that
no activation crosses a new collective:
- column-parallel layers (qkv, fc1): A [r, in] is replicated and B [out, r] is split by output rows like
  W (with W's blocks: Q/K/V, gate/up), so each rank computes its own slice of the output;
- row-parallel layers (proj, fc2): A [r, in] is split by input columns like W and B [out, r] is replicated;
  each rank's B A_k x_k is a partial sum that joins the layer's partial x_k W_k^T before the layer's
  all-reduce (or reduce-scatter under sequence parallelism), which completes both.
The replicated factor's gradient is then partial on each TP rank (it sees one slice of the other factor),
so it is marked tp_partial_grad and summed over TP once per step, in the same flat all-reduce as the
sequence-parallel norm gradients: r x (in + out) numbers per adapter, not activations.

Everything else is frozen (requires_grad False): no gradient, no grad-buffer space, no optimizer state, and
checkpoints (which save trainable parameters) hold only the adapters and a pointer to the base.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.engine.checkpoint.format import (
    METADATA,
    CheckpointError,
    CheckpointMetadata,
    find_loadable,
    foreign_checkpoint_hint,
    sha256_of,
)
from loom.engine.config import ConfigError, LoomConfig, LoraConfig, ModelConfig
from loom.engine.config_io import config_from_dict
from loom.engine.model import naming
from loom.engine.parallel import mappings
from loom.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.random import RNGStreams
from loom.engine.parallel.sharding import ShardSpec, make_parameter


class LoRAAdapter(torch.nn.Module):
    """(alpha / r) B A x for one linear layer, its factors split to match the layer (module docstring)."""

    def __init__(self, layer: torch.nn.Module, config: LoraConfig, streams: RNGStreams | None):
        super().__init__()
        column = isinstance(layer, ColumnParallelLinear)
        weight_spec = param_info(layer.weight).shard_spec
        out_features, in_features = weight_spec.full_shape
        tp, r = mappings.group_size(layer.tp_group), config.rank
        a_init = ("uniform", 1 / math.sqrt(in_features)) if config.init == "kaiming" else ("normal", 1 / r)
        a_spec = ShardSpec((r, in_features)) if column else ShardSpec((r, in_features), 1)
        b_spec = ShardSpec((out_features, r), 0, weight_spec.blocks) if column else ShardSpec((out_features, r))
        self.lora_a = make_parameter(a_spec, tp, a_init, tp_partial_grad=column)
        self.lora_b = make_parameter(b_spec, tp, ("zeros",), tp_partial_grad=not column)
        self.scale, self.dropout, self.streams = config.scale, config.dropout, streams
        # A column layer's input is the same on every TP rank, a row layer's is split by features.
        self.dropout_stream = "replicated" if column else "tensor"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            with self.streams.fork(self.dropout_stream):
                x = F.dropout(x, self.dropout)
        return F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def add_adapters(chunk: torch.nn.Module, config: LoraConfig, streams: RNGStreams | None) -> None:
    """Freeze every parameter of a model chunk and put an adapter on each targeted linear layer."""
    for param in chunk.parameters():
        param.requires_grad_(False)
    for name, module in list(chunk.named_modules()):
        if name.rpartition(".")[2] not in config.targets or naming.split_block_param_name(name + ".weight") is None:
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            raise ConfigError(
                f"LoRA adapters sit on loom's own linear layers, and {name} is {type(module).__name__}; "
                "use --model.kernels native"
            )
        module.adapter = LoRAAdapter(module, config, streams)
    chunk.name_parameters()


def parameter_counts(chunks: list[torch.nn.Module], pp_group, pp_size: int) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model: logical sizes, each weight counted once."""
    trainable = total = 0
    device = torch.device("cpu")
    for chunk in chunks:
        for param in chunk.parameters():
            info = param_info(param)
            device = param.device
            if info.tied_copy:
                continue
            count = math.prod(info.shard_spec.full_shape)
            total += count
            trainable += count if param.requires_grad else 0
    # on the parameters' device: an NCCL group reduces CUDA tensors only (it refuses a host tensor under pp > 1)
    counts = torch.tensor([trainable, total], dtype=torch.float64, device=device)
    if pp_size > 1:
        dist.all_reduce(counts, group=pp_group)
    return int(counts[0]), int(counts[1])


def _find_base(base: str, verify_hashes: bool) -> tuple[Path, CheckpointMetadata]:
    if not Path(base).exists():  # e.g. a LoRA checkpoint's recorded base, moved since
        raise CheckpointError(f"lora.base = {base} does not exist (moved? give its new place with --lora.base)")
    found = find_loadable(Path(base), verify_hashes=verify_hashes)
    if found is None:
        raise CheckpointError(
            f"lora.base = {base} holds no intact checkpoint; point it at a loom checkpoint"
            + foreign_checkpoint_hint(Path(base))
        )
    return found


def open_base(base: str) -> tuple[Path, CheckpointMetadata, dict]:
    """The base model's checkpoint, its metadata and the pointer a LoRA checkpoint records: its path and the
    sha256 of its metadata.json (which holds every file's sha256, so it names the weights exactly)."""
    directory, metadata = _find_base(base, verify_hashes=True)
    if metadata.lora_base is not None:
        raise CheckpointError(
            f"lora.base = {base} is itself a LoRA checkpoint (adapters only); fold its adapters in first with "
            f"loom ckpt merge-lora --checkpoint {base} --output DIR"
        )
    return directory, metadata, _pointer(directory)


def _pointer(directory: Path) -> dict:
    return {"path": str(directory.resolve()), "metadata_sha256": sha256_of(directory / METADATA)}


def base_pointer(config: LoomConfig) -> dict | None:
    """The pointer a LoRA run's checkpoints record for its base (None for a run without adapters), found without
    checking the base's files (open_base does, on rank 0): for the launcher's checks."""
    return _pointer(_find_base(config.lora.base, verify_hashes=False)[0]) if config.lora.enabled else None


# How a run computes, not what the model is: these stay the LoRA run's own.
_RUN_SETTINGS = ("dropout", "recompute", "kernels", "compile")
# What trains a mixture of experts' router, which a LoRA run freezes (as peft's fine-tunes of Mixtral do): 0 whatever
# the base trained with (its losses' gradients would reach the adapters through the hidden states); the biases' rate
# where the base has biases.
FROZEN_ROUTER = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_bias_rate")


def frozen_router_fields(base: ModelConfig) -> tuple[str, ...]:
    """The FROZEN_ROUTER settings a LoRA run on `base` sets to 0: none for a dense base, the biases' rate only
    where it has biases."""
    if not base.moe:
        return ()
    return tuple(name for name in FROZEN_ROUTER if name != "moe_expert_bias_rate" or base.moe_expert_bias)


def adopt_base_model(config: LoomConfig) -> list[str]:
    """A LoRA run's model is its base's: [model] is taken from the base checkpoint's config (except the run
    settings above; a mixture of experts' FROZEN_ROUTER settings are 0: its router is frozen), so a config need not
    restate an imported model. Returns what changed, as `field: a -> b`."""
    _, metadata = _find_base(config.lora.base, verify_hashes=False)
    base = config_from_dict({"model": metadata.config["model"]}).model
    frozen = frozen_router_fields(base)
    changes, values = [], {}
    for field in dataclasses.fields(ModelConfig):
        ours, theirs = getattr(config.model, field.name), getattr(base, field.name)
        if field.name == "max_position_embeddings" and base.position_embedding == "rope":
            # RoPE has no position weights: a training context longer than the base's keeps the run's (as a
            # fine-tune's does: preflight.adopt_saved_model_settings), a shorter one takes the base's
            theirs = max(ours, theirs) if config.train.seq_length > theirs else theirs
        if field.name in frozen:
            values[field.name] = 0.0
        elif field.name not in _RUN_SETTINGS and ours != theirs:
            changes.append(f"{field.name}: {ours} -> {theirs}")
            values[field.name] = theirs
    config.model = dataclasses.replace(config.model, **values)
    positions = config.model.max_position_embeddings
    if base.position_embedding == "learned" and config.train.seq_length > positions:
        raise ConfigError(
            f"train.seq_length = {config.train.seq_length} exceeds the base model's {positions} learned positions "
            f"({config.lora.base}); lower --train.seq_length"
        )
    return changes


def check_rank(config: LoomConfig) -> None:
    """Refuse a rank above the adapted layers' smallest side: B A then has more parameters than W (a rank of
    100,000 on hidden 128 is 16 GB of adapters) and no more expressive power than rank = that side."""
    m, lora = config.model, config.lora
    sides = {"hidden_size": m.hidden_size}
    if {"fc1", "fc2"} & set(lora.targets):
        sides["ffn_hidden_size"] = m.ffn_hidden_size
    name, smallest = min(sides.items(), key=lambda item: item[1])
    if lora.rank > smallest:
        raise ConfigError(
            f"lora.rank = {lora.rank} exceeds the adapted layers' smallest side (model.{name} = {smallest}); "
            f"a rank up to {smallest} gives every update a full-rank adapter can, typically 8-64"
        )


def check_same_base(checkpoint: Path, saved: dict | None, current: dict | None) -> None:
    """Refuse to resume adapters onto another base model, or a full run from adapters alone."""
    if current is None and saved is not None:
        raise CheckpointError(
            f"{checkpoint} is a LoRA checkpoint (adapters on {saved['path']}): resume it with its [lora] settings, "
            f"or fold the adapters in with loom ckpt merge-lora --checkpoint {checkpoint} --output DIR"
        )
    if current is not None and saved is None:
        raise CheckpointError(
            f"{checkpoint} holds no LoRA adapters (a whole model's checkpoint): a LoRA run takes such a model with "
            "--lora.base, not --checkpoint.load, and trains in a run directory of its own (another --train.name or "
            "--train.run_dir)"
        )
    if current is not None and saved["metadata_sha256"] != current["metadata_sha256"]:
        raise CheckpointError(
            f"{checkpoint}'s adapters were trained on {saved['path']} (metadata sha256 "
            f"{saved['metadata_sha256'][:12]}), but lora.base is {current['path']} "
            f"({current['metadata_sha256'][:12]}): another model; pass --lora.base {saved['path']} to continue "
            "these adapters, or train adapters on the new base in a run directory of their own"
        )

"""Offline LoRA tools: a LoRA checkpoint's model with its adapters folded in, and `loom ckpt merge-lora`.

A LoRA run's checkpoint holds only adapters and a pointer to its base (CheckpointMetadata.lora_base: the
base's path and the sha256 of its metadata.json). Folding W + (alpha / r) B A happens on the logical
tensors in fp32, so the result is independent of the layouts either checkpoint was saved under.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from loom.engine.checkpoint.format import (
    METADATA,
    CheckpointError,
    CheckpointMetadata,
    buffer_names,
    find_loadable,
    read_metadata,
    sha256_of,
)
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config import LoraConfig
from loom.engine.config_io import config_from_dict
from loom.engine.model import naming
from loom.engine.model.lora import FROZEN_ROUTER
from loom.tools.ckpt import LazyWeights, open_checkpoint, write_weights_checkpoint
from loom.tools.outputs import claimed_checkpoint_output


def adapted_weights(specs: dict) -> dict[str, tuple[str, str]]:
    """{linear weight name: (its adapter's A name, B name)} for every adapter among a checkpoint's tensors."""
    weights = {naming.adapted_weight_name(name) for name in specs} - {None}
    return {weight: naming.adapter_factor_names(weight) for weight in sorted(weights)}


def base_of(
    directory: Path, metadata: CheckpointMetadata, moved_to: Path | None = None, verify_hashes: bool = True
) -> tuple[Path, CheckpointMetadata]:
    """The base model a LoRA checkpoint's adapters were trained on (where it was then, or `moved_to`: --lora.base),
    checked to be the same one by the sha256 of its metadata.json (and intact by its files', unless told not to)."""
    pointer = metadata.lora_base
    if moved_to is None:
        base = Path(pointer["path"])
        if not (base / METADATA).is_file():
            raise CheckpointError(
                f"{directory}'s base model {base} is gone; its adapters need it (moved? pass --lora.base NEW_PLACE)"
            )
    else:
        found = find_loadable(moved_to, verify_hashes=False, warn=lambda _: None)
        if found is None:
            raise CheckpointError(f"--lora.base {moved_to} holds no intact checkpoint")
        base = found[0]
    if sha256_of(base / METADATA) != pointer["metadata_sha256"]:
        what = (
            "has changed since its adapters were trained"
            if moved_to is None
            else "is not the model they were trained on"
        )
        raise CheckpointError(
            f"{directory}'s base model {base} {what} (metadata sha256 {pointer['metadata_sha256'][:12]} expected)"
        )
    return base, read_metadata(base, verify_hashes)


class ModelWeights(LazyWeights):
    """The logical weights (fp32) of the model a checkpoint describes, read one at a time: a full checkpoint's
    own, or for a LoRA checkpoint the base's with each adapter folded in (`base`: where it is now, if it moved;
    `verify_hashes`: check its files, as open_checkpoint checked the LoRA checkpoint's)."""

    def __init__(
        self, directory: Path, metadata: CheckpointMetadata, base: Path | None = None, verify_hashes: bool = True
    ):
        reader = PieceReader(directory, metadata)
        self.adapters: dict[str, tuple[str, str]] = {}
        self.base_dir: Path | None = None
        self.model_metadata = metadata  # whose facts the model carries: the base's for a LoRA checkpoint
        self.tokenizer = metadata.tokenizer  # CheckpointMetadata.tokenizer: a fine-tune's own, else its base's
        if metadata.lora_base is None:
            if base is not None:  # said, not ignored: the user may have meant another checkpoint
                raise CheckpointError(
                    f"{directory} is not a LoRA checkpoint, so --lora.base {base} has nothing to do; drop it"
                )
            self.weights, self.factors = reader, None
            super().__init__({**_full_shapes(metadata), **self._buffers(metadata)})
            return
        self.base_dir, base_metadata = base_of(directory, metadata, base, verify_hashes)
        self.model_metadata = base_metadata
        self.tokenizer = metadata.tokenizer or base_metadata.tokenizer
        self.weights, self.factors = PieceReader(self.base_dir, base_metadata), reader
        self.adapters = adapted_weights(metadata.specs)
        self.scale = config_from_dict(metadata.config).lora.scale
        super().__init__({**_full_shapes(base_metadata), **self._buffers(base_metadata)})

    def router_training(self) -> dict:
        """For a LoRA checkpoint, its base's router-training settings (FROZEN_ROUTER), which the LoRA run zeroed for
        itself: a merge or an export is the base's model, trained on as the base was; {} for a full checkpoint."""
        if self.base_dir is None:
            return {}
        base = config_from_dict({"model": self.model_metadata.config["model"]}).model  # fields it predates: defaults
        return {name: getattr(base, name) for name in FROZEN_ROUTER}

    def _buffers(self, metadata: CheckpointMetadata) -> dict[str, tuple[int, ...]]:
        """The model's buffers that are state (experts' biases: buffer/<name>) in `self.weights`' checkpoint, whose
        `metadata` this is, by name, with their shapes."""
        self.buffers = buffer_names(metadata)
        return {name: self.weights.header(key)[1] for name, key in self.buffers.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.buffers:
            return self.weights.tensor(self.buffers[name]).float()
        weight = self.weights.model(name).float()
        if name in self.adapters:
            a, b = (self.factors.model(factor).float() for factor in self.adapters[name])
            weight += self.scale * (b @ a)
        return weight


def _full_shapes(metadata: CheckpointMetadata) -> dict[str, tuple[int, ...]]:
    return {name: tuple(spec.full_shape) for name, spec in metadata.specs.items()}


def merge_lora(source: Path, output: Path, base: Path | None = None, overwrite: bool = False) -> Path:
    """Write the model of the LoRA checkpoint at `source`, adapters folded in, as a weights-only checkpoint
    (step 0, like import-hf) under `output` (claimed as tools/outputs.py says). `base`: where the base model
    is now, if it moved."""
    directory, metadata = open_checkpoint(source)
    if metadata.lora_base is None:
        raise CheckpointError(f"{directory} is not a LoRA checkpoint (it has no adapters to merge)")
    config = config_from_dict(metadata.config)
    config.lora = LoraConfig()
    weights = ModelWeights(directory, metadata, base)
    config.model = dataclasses.replace(config.model, **weights.router_training())
    origin = weights.model_metadata.hf_origin  # the base's Hugging Face origin stays the merged model's
    with claimed_checkpoint_output(output, overwrite, reading=(directory, weights.base_dir)):
        return write_weights_checkpoint(
            output, config, weights, str(directory), hf_origin=origin, tokenizer=weights.tokenizer
        )

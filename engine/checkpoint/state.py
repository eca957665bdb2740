"""What a checkpoint saves and restores: explicit state objects, handed over by whoever trains.

The checkpoint code reads and writes these objects and nothing else, so it does not depend on the
Trainer. Model weights and optimizer state are saved as layout-free pieces (save.py, load.py);
everything else goes through the objects' own state_dict()/load_state_dict().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loom.engine.config import LoomConfig
    from loom.engine.data.loader import BatchIterator
    from loom.engine.model.fp8_state import Fp8ScalingState
    from loom.engine.optim.distributed import DistributedOptimizer
    from loom.engine.optim.loss_scaler import LossScaler
    from loom.engine.parallel.random import RNGStreams
    from loom.engine.parallel.state import ParallelState


@dataclass
class TrainingState:
    """One rank's training state, as the checkpoint code sees it."""

    config: LoomConfig
    """The run's config: recorded in metadata.json, and it names the optimizer, precision and sequence length."""
    parallel: ParallelState
    """This rank's place in the layout: which pieces it writes, and how it slices what it loads."""
    model_chunks: list[torch.nn.Module]
    """This rank's model chunks; their trainable parameters are saved as pieces of the logical tensors."""
    optimizer: DistributedOptimizer | None
    """Master weights and elementwise optimizer state of this rank's segments, saved as flat pieces (None: an
    evaluation, which loads the weights alone)."""
    data: BatchIterator
    """The training data iterator; its state_dict() is its position (consumed samples)."""
    rng: RNGStreams
    """This rank's random state (state_dict()/load_state_dict()); restored only under the same layout."""
    loss_scaler: LossScaler | None
    """The fp16 loss scaler (state_dict()/load_state_dict()), or None when not training in fp16."""
    step: int
    """Training steps completed; the iteration a save is named after (a load leaves it to the caller)."""
    fp8: Fp8ScalingState | None = None
    """FP8 delayed-scaling state (amax histories and scales, state_dict()/load_state_dict(), by module name),
    or None when the run keeps none (train.fp8 = off or current)."""
    lora_base: dict | None = None
    """A LoRA run's pointer to its frozen base model (CheckpointMetadata.lora_base); None otherwise."""
    validation: dict | None = None
    """Early stopping's state (CheckpointMetadata.validation); None when the run keeps none."""
    hf_origin: dict | None = None
    """For a model imported from Hugging Face, and the runs that train on from it: CheckpointMetadata.hf_origin,
    carried into each checkpoint so an export still names the model, its special tokens and its dtype."""
    nonfinite_in_a_row: int = 0
    """Non-finite steps in a row that train.nan_policy = skip has skipped (CheckpointMetadata.nonfinite_in_a_row)."""
    skipped_updates: int = 0
    """Steps whose update was skipped, on which the learning rate stood still (CheckpointMetadata.skipped_updates)."""
    lr_position: float = 0.0
    """The learning-rate schedule's position (CheckpointMetadata.lr_position)."""

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable parameters of the model chunks (those the optimizer holds)."""
        return [
            (name, param)
            for chunk in self.model_chunks
            for name, param in chunk.named_parameters()
            if param.requires_grad
        ]

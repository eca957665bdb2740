"""Learning rate as a pure function of the schedule's position: linear warmup, then cosine / linear / constant
decay."""

from __future__ import annotations

import math

from loom.engine.config import OptimConfig


def learning_rate(position: float, optim: OptimConfig, total_steps: float, step_share: float = 1.0) -> float:
    """LR of the optimizer step that starts at `position`: the applied updates before it (0-based), each counted
    as its batch's share of the full global batch, so a step under a batch ramp-up moves it less than 1 (Megatron-LM's
    schedule counts samples); `step_share` is this step's share. `total_steps`: the run's length in the same units
    (TrainConfig.schedule_length), the decay's unless optim.decay_steps says."""
    if optim.warmup_steps and position < optim.warmup_steps:
        # the rate at the end of the step, so the first one already learns
        return optim.lr * min(position + step_share, optim.warmup_steps) / optim.warmup_steps
    decay_steps = optim.decay_steps or total_steps
    if optim.decay == "constant" or decay_steps <= optim.warmup_steps:
        return optim.lr
    progress = min(1.0, (position - optim.warmup_steps) / (decay_steps - optim.warmup_steps))
    if optim.decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * factor

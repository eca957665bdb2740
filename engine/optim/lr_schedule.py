"""Learning rate as a pure function of the step: linear warmup, then cosine / linear / constant decay."""

from __future__ import annotations

import math

from loom.engine.config import OptimConfig


def learning_rate(step: int, optim: OptimConfig, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based)."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = optim.decay_steps or total_steps
    if optim.decay == "constant" or decay_steps <= optim.warmup_steps:
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / (decay_steps - optim.warmup_steps))
    if optim.decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * factor

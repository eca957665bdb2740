"""Builds the torch optimizer of a run, with weight decay off for norms, biases and other 1-D tensors."""

from __future__ import annotations

import torch

from engine.config import OptimConfig


def parameter_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    decayed = [p for p in params if p.ndim >= 2]
    plain = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decayed, "weight_decay": weight_decay},
                        {"params": plain, "weight_decay": 0.0}) if g["params"]]


def build_optimizer(params: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    groups = parameter_groups(params, optim.weight_decay)
    fused = params[0].is_cuda or None
    if optim.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                 fused=fused)
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum)
    raise ValueError(f"optimizer {optim.name!r} is not available")

"""Global gradient norm over every shard of the model, and clipping by it.

A replicated parameter (norms, row-parallel biases) has the same gradient on every TP rank, so
only TP rank 0 counts it; sharded parameters are counted by all; the last pipeline stage's copy
of a tied embedding is not counted (the first stage's is). Squares are summed over the
model-parallel group (TP x PP); DP ranks hold identical gradients after reduction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def sum_sequence_parallel_grads(params: list[torch.nn.Parameter], tp_group, tp_size: int) -> None:
    """Sum the partial gradients of replicated parameters that saw only a slice of the sequence."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel_grad", False) and p.grad is not None]
    if tp_size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(params: list[torch.nn.Parameter], model_group, tp_rank: int, model_parallel_size: int) -> float:
    squares = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for p in params:
        if p.grad is None or (p.shard_spec.is_replicated and tp_rank != 0) or getattr(p, "tied_copy", False):
            continue
        squares += p.grad.detach().float().pow(2).sum()
    if model_parallel_size > 1:
        dist.all_reduce(squares, group=model_group)
    return math.sqrt(squares.item())


def clip_grads(params: list[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    scale = max_norm / (total_norm + 1e-6)
    if scale < 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)

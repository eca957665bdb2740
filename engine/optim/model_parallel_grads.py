"""Gradient facts that follow from how parameters are split across model-parallel ranks.

- Under sequence parallelism a replicated parameter (norms, row-parallel biases, learned
  positions) sees only its rank's slice of the sequence: its gradient is partial and is summed
  over the TP group.
- A tied embedding held by the first and the last pipeline stage gets the sum of both stages'
  gradients (over the embedding group), which keeps the two copies equal.
- For a global sum (the gradient norm), a replicated parameter is counted on TP rank 0 only and
  the last stage's tied copy not at all, so every weight counts once.
These sums happen on each rank's local gradient, before the data-parallel reduction (sums commute).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.state import ParallelState


def local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient being accumulated: the fp32 buffer view when there is one, else param.grad."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def needs_model_parallel_sum(param: torch.nn.Parameter, state: ParallelState) -> bool:
    info = param_info(param)
    return (info.tp_partial_grad and state.tp_size > 1) or (info.tied_embedding and state.pp_size > 1)


def counted_once(param: torch.nn.Parameter, tp_rank: int) -> bool:
    info = param_info(param)
    if info.tied_copy:
        return False
    return not info.shard_spec.is_replicated or tp_rank == 0


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sum_model_parallel_grads(params: list[torch.nn.Parameter], state: ParallelState) -> None:
    """Sum sequence-parallel partial gradients over TP and tied-embedding gradients over the pipeline ends."""
    if state.tp_size > 1:
        _all_reduce_flat([local_grad(p) for p in params if param_info(p).tp_partial_grad], state.tp_group)
    if state.pp_size > 1:
        tied = [local_grad(p) for p in params if param_info(p).tied_embedding]
        if tied:
            _all_reduce_flat(tied, state.embedding_group)

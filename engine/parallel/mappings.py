"""Autograd-aware collectives of tensor and sequence parallelism (Megatron's f/g conjugate pairs).

Each function is the identity when its group has one rank, so TP=1 pays nothing. Tensors are
[sequence, batch, hidden]: "sequence" collectives work on dim 0, "tensor" ones on the last dim.
This module must not decide *where* collectives go; the layers in layers.py do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

Group = dist.ProcessGroup | None

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
# Used by the TP layers here and by the ZeRO-1 gradient and parameter buffers.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The functional collectives (what torch.compile traces, below) took the same new names.
functional_all_gather = getattr(functional, "all_gather_single", None) or functional.all_gather_tensor
functional_reduce_scatter = getattr(functional, "reduce_scatter_single", None) or functional.reduce_scatter_tensor


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


# Traced by torch.compile, the collectives are the functional ones, which return a new tensor: torch 2.11's dynamo
# cut the autograd graph at an in-place c10d collective in an autograd.Function's forward, so a compiled block at
# tp > 1 trained with zero weight gradients (2.13 traces both right). Eager keeps c10d's, which the comm ledger
# counts.


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return functional.wait_tensor(functional.all_reduce(x, "sum", group))
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split into {size} parts")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return functional.wait_tensor(functional_all_gather(x, dim, group))
    if dim == 0:
        out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_single(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} does not split into {size} parts")
    if torch.compiler.is_compiling():
        return functional.wait_tensor(functional_reduce_scatter(x.contiguous(), "sum", 0, group))
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)  # the input may be saved for another backward: reduce a copy

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    """Entering a TP region under sequence parallelism: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first_dim(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Leaving a TP region under sequence parallelism: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


def copy_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dim; the gradient is all-gathered."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, x.dim() - 1, group)


def gather_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim; the gradient is split."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, x.dim() - 1, group)


def scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0); the gradient is all-gathered."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, 0, group)


def gather_from_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent to the group's ranks, `send` rows to each in rank order, and `receive` rows gathered from
    each; backward sends the gradients back the same way (expert parallelism's dispatch and combine)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group: Group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, send: list[int], receive: list[int], group: Group) -> torch.Tensor:
    """`x`'s rows in `send`-sized runs to the group's ranks in order; the `receive`-sized runs they send back, in
    rank order (every rank's `receive[i]` is rank i's `send` to it)."""
    return _AllToAll.apply(x, send, receive, group)

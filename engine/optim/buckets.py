"""How the gradient buffer is cut into buckets: the one rule, torch-free so that the planner (tools/plan_bytes.py)
lays out a rank's gradients exactly as GradBuffer (grad_buffer.py) does without importing torch.

Parameters are laid out in the order given along one buffer coordinate space; a bucket closes once it holds at
least `bucket_numel` elements (or at the last parameter) and is padded to a multiple of the DP size, so every
DP rank owns an equal contiguous chunk of it. Under ZeRO-3 a bucket also closes where the next parameter
belongs to another gather unit (`unit_of`: a transformer block, or the weights before or after the blocks), so
that gathering a unit's weights gathers whole buckets and nothing of its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


@dataclass
class Bucket:
    start: int
    end: int
    """Padded end: (end - start) is a multiple of the DP size."""
    params: list[torch.nn.Parameter]
    pending: int = 0
    handle: dist.Work | None = None
    scattered: torch.Tensor | None = field(default=None, repr=False)
    storage: torch.Tensor | None = field(default=None, repr=False)
    """ZeRO 2: the transient full bucket gathering this micro-batch's gradients."""
    arrived: int = 0
    """ZeRO 2: gradients added to `storage` since it was last reduced."""

    def chunk(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """The buffer range this DP rank owns in this bucket."""
        size = (self.end - self.start) // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


def plan_buckets(
    params: list[torch.nn.Parameter],
    bucket_numel: int,
    dp_size: int,
    first_offset: int = 0,
    unit_of: Callable[[torch.nn.Parameter], Hashable] | None = None,
) -> tuple[dict, list[Bucket], int]:
    """(offset of each param, buckets, end) for params laid out in the given order from first_offset."""
    offsets, buckets, offset, start, members = {}, [], first_offset, first_offset, []
    for i, param in enumerate(params):
        offsets[param] = offset
        offset += param.numel()
        members.append(param)
        last = i == len(params) - 1
        unit_ends = unit_of is not None and not last and unit_of(params[i + 1]) != unit_of(param)
        if offset - start >= bucket_numel or last or unit_ends:
            end = start + -(-(offset - start) // dp_size) * dp_size
            buckets.append(Bucket(start, end, members))
            offset = start = end
            members = []
    return offsets, buckets, offset


@dataclass
class BufferLayout:
    """Where every gradient lives in a rank's buffer, and its buckets."""

    params: list
    """Backward's order (the model's reversed): the regular parameters, then the deferred ones."""
    deferred: list
    offsets: dict
    buckets: list[Bucket]
    """The regular parameters' buckets, then the deferred ones'."""
    deferred_buckets: list[Bucket]
    regular_end: int
    """Where the deferred range starts."""
    total: int


def plan_buffer(
    params: list,
    is_deferred: Callable[[Any], bool],
    bucket_numel: int,
    dp_size: int,
    unit_of: Callable[[Any], Hashable] | None = None,
) -> BufferLayout:
    """The gradient buffer of `params` (in the model's order): in reverse, as backward produces the gradients, the
    regular parameters' buckets (cut at gather units with `unit_of`, ZeRO-3), then from where they end the deferred
    ones' (their gradients are summed over a model-parallel group before they are reduced)."""
    ordered = list(reversed(params))
    deferred = [p for p in ordered if is_deferred(p)]
    regular = [p for p in ordered if not is_deferred(p)]
    offsets, buckets, end = plan_buckets(regular, bucket_numel, dp_size, unit_of=unit_of) if regular else ({}, [], 0)
    more, deferred_buckets, total = plan_buckets(deferred, bucket_numel, dp_size, end) if deferred else ({}, [], end)
    return BufferLayout(
        regular + deferred, deferred, {**offsets, **more}, buckets + deferred_buckets, deferred_buckets, end, total
    )

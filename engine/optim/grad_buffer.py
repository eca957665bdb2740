"""Data-parallel gradient reduction: one contiguous fp32 buffer, buckets, collectives overlapped with backward.

Every parameter's gradient accumulates into a view (`param.main_grad`) of one fp32 buffer, in
reverse construction order (roughly the order backward finishes them). The buffer is cut into
buckets; each bucket is padded to a multiple of the DP size, so every DP rank owns an equal
contiguous chunk of every bucket (what ZeRO-1 reduce-scatters and steps). On the last
micro-batch of a step, a backward hook counts the parameters whose gradient is final; when a
bucket is complete its collective starts asynchronously while backward goes on: an all-reduce
for plain data parallelism, a reduce-scatter for ZeRO-1. Gradients are *summed* over DP: the
loss is already normalised by the global batch's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom.engine.parallel.mappings import reduce_scatter_single


@dataclass
class Bucket:
    start: int
    end: int
    """Padded end: (end - start) is a multiple of the DP size."""
    params: list[torch.nn.Parameter]
    pending: int = 0
    handle: dist.Work | None = None
    scattered: torch.Tensor | None = field(default=None, repr=False)

    def chunk(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """The buffer range this DP rank owns in this bucket."""
        size = (self.end - self.start) // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


def plan_buckets(
    params: list[torch.nn.Parameter], bucket_numel: int, dp_size: int, first_offset: int = 0
) -> tuple[dict, list[Bucket], int]:
    """(offset of each param, buckets, end) for params laid out in the given order from first_offset."""
    offsets, buckets, offset, start, members = {}, [], first_offset, first_offset, []
    for i, param in enumerate(params):
        offsets[param] = offset
        offset += param.numel()
        members.append(param)
        if offset - start >= bucket_numel or i == len(params) - 1:
            end = start + -(-(offset - start) // dp_size) * dp_size
            buckets.append(Bucket(start, end, members))
            offset = start = end
            members = []
    return offsets, buckets, offset


class GradBuffer:
    """Owns the gradients of `params` and reduces them over `dp_group` bucket by bucket.

    `enabled` False (fp32 parameters, one DP rank, no ZeRO) leaves gradients where autograd puts
    them: nothing to reduce, nothing to copy. `deferred` parameters (those whose local gradients
    must first be summed over a model-parallel group) get buckets of their own, reduced in
    `finish` after `before_deferred` has done that sum.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dp_group,
        dp_size: int,
        dp_rank: int,
        bucket_bytes: int,
        overlap: bool = True,
        reduce_scatter: bool = False,
        enabled: bool = True,
        deferred: Callable[[torch.nn.Parameter], bool] = lambda p: False,
        before_deferred: Callable[[], None] = lambda: None,
    ):
        self.dp_group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.overlap, self.reduce_scatter, self.enabled = overlap, reduce_scatter, enabled
        self.before_deferred = before_deferred
        trainable = [p for p in reversed(params) if p.requires_grad]
        self.deferred = [p for p in trainable if deferred(p)]
        self.params = [p for p in trainable if not deferred(p)] + self.deferred
        self.last_microbatch = True
        self.buckets: list[Bucket] = []
        self._hooks: list = []
        if not enabled:
            return
        bucket_numel = max(1, bucket_bytes // 4)
        regular = self.params[: len(self.params) - len(self.deferred)]
        self.offsets, self.buckets, end = plan_buckets(regular, bucket_numel, dp_size) if regular else ({}, [], 0)
        offsets, self.deferred_buckets, total = (
            plan_buckets(self.deferred, bucket_numel, dp_size, end) if self.deferred else ({}, [], end)
        )
        self.offsets.update(offsets)
        self.buckets += self.deferred_buckets
        self.data = torch.zeros(total, dtype=torch.float32, device=self.params[0].device)
        self.bucket_of = {}
        for bucket in self.buckets:
            for param in bucket.params:
                self.bucket_of[param] = bucket
                param.main_grad = self.data[self.offsets[param] : self.offsets[param] + param.numel()].view_as(param)
        self.deferred_set = set(self.deferred)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.last_microbatch and self.overlap and param not in self.deferred_set:
            bucket = self.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.dp_size == 1:
            return
        view = self.data[bucket.start : bucket.end]
        if self.reduce_scatter:
            bucket.scattered = torch.empty(
                (bucket.end - bucket.start) // self.dp_size, dtype=view.dtype, device=view.device
            )
            bucket.handle = reduce_scatter_single(bucket.scattered, view, group=self.dp_group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(view, group=self.dp_group, async_op=True)

    def start_step(self) -> None:
        """Forget the previous step's gradients before the first micro-batch."""
        for p in self.params:
            p.grad = None
        if not self.enabled:
            return
        self.data.zero_()
        for bucket in self.buckets:
            bucket.pending, bucket.handle, bucket.scattered = len(bucket.params), None, None

    def finish(self) -> None:
        """Wait for (or start) every bucket's reduction. After it, without ZeRO, `main_grad` (and
        `grad` for fp32 params) is the DP sum; with ZeRO, only this rank's chunk of each bucket is."""
        if not self.enabled:
            self.before_deferred()
            return
        regular = self.buckets[: len(self.buckets) - len(self.deferred_buckets)]
        for bucket in regular:
            if bucket.handle is None:
                self._launch(bucket)
        self.before_deferred()
        for bucket in self.deferred_buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            if bucket.scattered is not None:
                start, end = bucket.chunk(self.dp_rank, self.dp_size)
                self.data[start:end].copy_(bucket.scattered)
            # Finished work objects must not outlive the process group (gloo aborts at exit).
            bucket.handle = bucket.scattered = None
        if not self.reduce_scatter:
            for p in self.params:
                if p.dtype == p.main_grad.dtype:  # low-precision params keep their fp32 grads in main_grad
                    p.grad = p.main_grad

    def owned_ranges(self) -> list[tuple[int, int]]:
        """Buffer ranges whose reduced gradient this rank holds and whose parameters it steps."""
        if self.reduce_scatter:
            return [b.chunk(self.dp_rank, self.dp_size) for b in self.buckets]
        return [(b.start, b.end) for b in self.buckets]

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()

"""Data-parallel gradient reduction: gradient buckets (fp32, or bf16 with optim.grad_dtype), collectives
overlapped with backward.

Parameters are laid out, in reverse construction order (roughly the order backward finishes
them), along one fp32 *buffer coordinate* space cut into buckets; each bucket is padded to a
multiple of the DP size, so every DP rank owns an equal contiguous chunk of every bucket (what
ZeRO reduce-scatters and steps). Gradients are *summed* over DP: the loss is already
normalised by the global batch's tokens.

ZeRO 0 and 1: the buffer exists in full and every gradient accumulates into a view of it
(`param.main_grad`). On the last micro-batch of a step a backward hook counts the parameters
whose gradient is final; a complete bucket's collective starts asynchronously while backward
goes on: an all-reduce (ZeRO 0) or a reduce-scatter (ZeRO 1).

ZeRO 2: only this rank's chunk of every bucket persists (`shard`, 1/DP of the buffer). Each
micro-batch, a bucket's gradients gather in a transient full-size bucket that is
reduce-scattered as soon as backward has filled it and then dropped; the rank adds the reduced
chunk into its shard. Accumulation therefore happens in the shard, after the reduction, at the
price of one reduce-scatter per bucket per micro-batch instead of per step (the same trade
DeepSpeed's ZeRO-2 makes; the alternative, a full buffer reduced once, is ZeRO-1's memory).
At most MAX_IN_FLIGHT transient buckets exist at a time. Parameters whose gradients must first
be summed over a model-parallel group (deferred: sequence-parallel norms, a tied embedding
under pp) keep a full buffer and are reduced once, at the end of the step.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Collection, Hashable

import torch
import torch.distributed as dist

from loom.engine.optim.buckets import Bucket, plan_buffer
from loom.engine.parallel.grad_fusion import FUSED
from loom.engine.parallel.mappings import all_gather_single, reduce_scatter_single

MAX_IN_FLIGHT = 2
"""ZeRO 2: reduce-scatters (each holding a transient bucket) allowed to run behind backward."""


def all_gather_bucket_chunks(buckets: list[torch.Tensor], rank: int, size: int, group) -> None:
    """Fill each whole bucket from its `size` equal chunks, this rank's already in place (after the optimizer has
    written its chunk of the weights, ZeRO 1 and 2, and ZeRO 3's whole buckets): all started, then all waited."""
    handles = []
    for bucket in buckets:
        chunk = bucket.numel() // size
        mine = bucket[rank * chunk : (rank + 1) * chunk].clone()
        handles.append(all_gather_single(bucket, mine, group=group, async_op=True))
    for handle in handles:
        handle.wait()


class GradBuffer:
    """Owns the gradients of `params` and reduces them over `dp_group` bucket by bucket.

    `zero` is the ZeRO stage (module docstring). `enabled` False (fp32 parameters, one DP rank,
    no ZeRO) leaves gradients where autograd puts them: nothing to reduce, nothing to copy.
    `deferred` parameters (those whose local gradients must first be summed over a
    model-parallel group) get buckets of their own, reduced in `finish` after `before_deferred`
    has done that sum. `unit_of` (ZeRO-3) cuts buckets where the gather unit changes (buckets.py); the
    gradients are then reduced as under ZeRO 2. Those of `fusable` that get a `main_grad` (ZeRO 0 and 1, deferred
    ones under 2 and 3) are FUSED: their layer's backward adds into it (engine/parallel/grad_fusion.py).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dp_group,
        dp_size: int,
        dp_rank: int,
        bucket_bytes: int,
        overlap: bool = True,
        zero: int = 0,
        enabled: bool = True,
        deferred: Callable[[torch.nn.Parameter], bool] = lambda p: False,
        before_deferred: Callable[[], None] = lambda: None,
        dtype: torch.dtype = torch.float32,
        unit_of: Callable[[torch.nn.Parameter], Hashable] | None = None,
        fusable: Collection[torch.nn.Parameter] = (),
    ):
        self.dp_group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.dtype = dtype
        self.overlap, self.zero, self.enabled = overlap, zero, enabled
        self.reduce_scatter = zero >= 1
        self.before_deferred = before_deferred
        self.bucket_numel = max(1, bucket_bytes // dtype.itemsize)
        layout = plan_buffer([p for p in params if p.requires_grad], deferred, self.bucket_numel, dp_size, unit_of)
        self.params, self.deferred = layout.params, layout.deferred
        self.last_microbatch = True
        self.buckets: list[Bucket] = []
        self._hooks: list = []
        self.fused: set[torch.nn.Parameter] = set()
        if not enabled:
            return
        self.offsets, self.buckets, self.deferred_buckets = layout.offsets, layout.buckets, layout.deferred_buckets
        self.total, self.regular_end = total, end = layout.total, layout.regular_end
        self.device = self.params[0].device
        self.deferred_set = set(self.deferred)
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.bucket_index = {id(bucket): i for i, bucket in enumerate(self.buckets)}
        self.in_flight: deque = deque()
        if zero >= 2:
            # Full storage only for the deferred range; the rest lives in transient buckets and the shard.
            self.data = torch.zeros(total - end, dtype=dtype, device=self.device)
            self.data_start = end
            chunks = [b.chunk(dp_rank, dp_size) for b in self.buckets]
            self.shard_starts = [lo for lo, _ in chunks]
            self.shard_offsets, size = [], 0
            for lo, hi in chunks:
                self.shard_offsets.append(size)
                size += hi - lo
            self.shard = torch.zeros(size, dtype=dtype, device=self.device)
        else:
            self.data = torch.zeros(total, dtype=dtype, device=self.device)
            self.data_start = 0
        self.buffered = self.params if zero < 2 else self.deferred
        """The parameters whose gradients accumulate in `data` (the rest, ZeRO 2 and 3, in transient buckets)."""
        self.unwritten: set[torch.nn.Parameter] = set()
        for param in self.buffered:
            start = self.offsets[param] - self.data_start
            param.main_grad = self.data[start : start + param.numel()].view_as(param)
        fusable = {id(p) for p in fusable}
        self.fused = {p for p in self.buffered if id(p) in fusable}
        for param in self.fused:
            setattr(param, FUSED, True)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def stored_bytes(self) -> int:
        """Bytes of gradient storage that persist through a step (transient ZeRO-2 buckets excluded)."""
        shard = self.shard.numel() if self.zero >= 2 else 0
        return (self.data.numel() + shard) * self.data.element_size() if self.enabled else 0

    def gradient(self, start: int, numel: int) -> torch.Tensor:
        """The reduced gradient at buffer coordinates [start, start + numel) after `finish`: a range this
        rank owns (within one bucket chunk under ZeRO 2)."""
        if self.zero < 2:
            return self.data[start : start + numel]
        i = bisect.bisect_right(self.shard_starts, start) - 1
        offset = self.shard_offsets[i] + start - self.shard_starts[i]
        return self.shard[offset : offset + numel]

    def add_gradient(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Accumulate `grad` into this step's gradient of `param`, a parameter whose gradient lives in `data`
        (what backward's hook does; a test may hand gradients in the same way). The first of a step is copied."""
        if param in self.unwritten:  # written over last step's: no zeroed buffer to read
            self.unwritten.discard(param)
            param.main_grad.copy_(grad)
        else:
            param.main_grad.add_(grad)

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self.zero >= 2 and param not in self.deferred_set:
            self._gather_for_scatter(param)
            return
        if param not in self.fused:  # a fused one's gradient is already in main_grad; its .grad is a placeholder
            self.add_gradient(param, param.grad)
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

    def _gather_for_scatter(self, param: torch.nn.Parameter) -> None:
        """ZeRO 2: add this micro-batch's gradient into its transient bucket; reduce the bucket once every
        member has arrived. Under interleaved schedules a bucket may see one member twice before another
        once; the sum is linear, so reducing whatever has arrived whenever the count is full is still exact,
        and every DP rank runs the same schedule, so their collectives match."""
        bucket = self.bucket_of[param]
        if bucket.storage is None:
            bucket.storage = torch.zeros(bucket.end - bucket.start, dtype=self.dtype, device=self.device)
        offset = self.offsets[param] - bucket.start
        bucket.storage[offset : offset + param.numel()].view_as(param).add_(param.grad)
        param.grad = None
        bucket.arrived += 1
        if bucket.arrived == len(bucket.params):
            self._scatter_into_shard(bucket)

    def _scatter_into_shard(self, bucket: Bucket) -> None:
        storage, bucket.storage, bucket.arrived = bucket.storage, None, 0
        index = self.bucket_index[id(bucket)]
        if self.dp_size == 1:
            self._add_to_shard(index, storage)
            return
        chunk = torch.empty((bucket.end - bucket.start) // self.dp_size, dtype=self.dtype, device=self.device)
        handle = reduce_scatter_single(chunk, storage, group=self.dp_group, async_op=True)
        # The transient bucket rides along so it lives until the collective that reads it is done.
        self.in_flight.append((index, handle, chunk, storage))
        while len(self.in_flight) > (MAX_IN_FLIGHT if self.overlap else 0):
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        index, handle, chunk, _storage = self.in_flight.popleft()
        handle.wait()
        self._add_to_shard(index, chunk)

    def _add_to_shard(self, index: int, chunk: torch.Tensor) -> None:
        offset = self.shard_offsets[index]
        self.shard[offset : offset + chunk.numel()].add_(chunk)

    def start_step(self) -> None:
        """Forget the previous step's gradients before the first micro-batch."""
        for p in self.params:
            p.grad = None
        if not self.enabled:
            return
        # Instead of zeroing the buffer (a pass over it, and a read of the zeros by the first micro-batch's adds),
        # each parameter's first gradient is copied in; `finish` zeroes those that got none. Bucket padding is never
        # written: it stays the zeros it was made with. Fused GEMMs can only add: then the buffer is zeroed.
        if self.fused:
            self.data.zero_()
            self.unwritten = set()
        else:
            self.unwritten = set(self.buffered)
        if self.zero >= 2:
            self.shard.zero_()
        for bucket in self.buckets:
            bucket.pending, bucket.handle, bucket.scattered = len(bucket.params), None, None
            bucket.storage, bucket.arrived = None, 0

    def finish(self) -> None:
        """Wait for (or start) every bucket's reduction. After it, without ZeRO, `main_grad` (and
        `grad` for fp32 params) is the DP sum; with ZeRO, only this rank's chunk of each bucket is."""
        if not self.enabled:
            self.before_deferred()
            return
        for param in self.unwritten:  # no gradient this step (a parameter this step did not use)
            param.main_grad.zero_()
        self.unwritten = set()
        if self.zero >= 2:
            self._finish_sharded()
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
                if p.dtype == p.main_grad.dtype == torch.float32:  # low-precision params keep theirs in main_grad
                    p.grad = p.main_grad

    def _finish_sharded(self) -> None:
        for bucket in self.buckets:
            if bucket.arrived:  # members that got no gradient this step: reduce what the others gave
                self._scatter_into_shard(bucket)
        while self.in_flight:
            self._retire_oldest()
        self.before_deferred()
        for bucket in self.deferred_buckets:
            index = self.bucket_index[id(bucket)]
            full = self.data[bucket.start - self.data_start : bucket.end - self.data_start]
            if self.dp_size == 1:
                self._add_to_shard(index, full)
                continue
            chunk = torch.empty(full.numel() // self.dp_size, dtype=self.dtype, device=self.device)
            reduce_scatter_single(chunk, full, group=self.dp_group)
            self._add_to_shard(index, chunk)

    def owned_ranges(self) -> list[tuple[int, int]]:
        """Buffer ranges whose reduced gradient this rank holds and whose parameters it steps."""
        if self.reduce_scatter:
            return [b.chunk(self.dp_rank, self.dp_size) for b in self.buckets]
        return [(b.start, b.end) for b in self.buckets]

    def remove_hooks(self) -> None:
        """Leave the parameters' gradients to autograd again (hooks and fusion off)."""
        for hook in self._hooks:
            hook.remove()
        for param in self.fused:
            delattr(param, FUSED)
        self.fused = set()

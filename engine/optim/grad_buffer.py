"""Data-parallel gradient reduction: one contiguous buffer, buckets, collectives overlapped with backward.

Every parameter's gradient accumulates into a view (`param.main_grad`) of one fp32 buffer. On the
last micro-batch of a step, a backward hook counts the parameters whose gradient is final; when
a bucket is complete its all-reduce starts asynchronously while backward goes on. The buffer is
padded so that it splits into equal contiguous shards per DP rank (what ZeRO-1 reduce-scatters).
Gradients are *summed* over DP: the loss is already normalised by the global batch's tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Bucket:
    def __init__(self, start: int, end: int, params: list[torch.nn.Parameter]):
        self.start, self.end, self.params = start, end, params
        self.pending = len(params)
        self.handle: dist.Work | None = None


class GradBuffer:
    """Owns the gradients of `params` and reduces them over `dp_group` in buckets of `bucket_bytes`."""

    def __init__(self, params: list[torch.nn.Parameter], dp_group, dp_size: int, bucket_bytes: int,
                 overlap: bool = True):
        self.dp_group, self.dp_size, self.overlap = dp_group, dp_size, overlap
        # Buckets follow the reverse of construction order: roughly the order backward finishes them.
        self.params = [p for p in reversed(params) if p.requires_grad]
        self.last_microbatch = True
        self.buckets: list[_Bucket] = []
        self._hooks: list = []
        if dp_size == 1:
            return  # nothing to reduce: gradients stay in param.grad, no copies
        device = self.params[0].device
        total = sum(p.numel() for p in self.params)
        self.data = torch.zeros(-(-total // dp_size) * dp_size, dtype=torch.float32, device=device)
        self.bucket_of: dict[torch.nn.Parameter, _Bucket] = {}
        offset, bucket_start, bucket_params = 0, 0, []
        for param in self.params:
            param.main_grad = self.data[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
            bucket_params.append(param)
            if (offset - bucket_start) * 4 >= bucket_bytes or param is self.params[-1]:
                self._add_bucket(bucket_start, offset, bucket_params)
                bucket_start, bucket_params = offset, []
        self.buckets[-1].end = self.data.numel()  # the last bucket carries the padding
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _add_bucket(self, start: int, end: int, params: list) -> None:
        bucket = _Bucket(start, end, list(params))
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[p] = bucket

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.last_microbatch and self.overlap:
            bucket = self.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.handle = dist.all_reduce(self.data[bucket.start:bucket.end], group=self.dp_group, async_op=True)

    def start_step(self) -> None:
        """Zero the gradients before the first micro-batch of a step."""
        for p in self.params:
            p.grad = None
        if self.dp_size == 1:
            return
        self.data.zero_()
        for bucket in self.buckets:
            bucket.pending, bucket.handle = len(bucket.params), None

    def finish(self) -> None:
        """Wait for (or start) every bucket's reduction, then expose the sums as `param.grad`."""
        if self.dp_size == 1:
            return
        for bucket in self.buckets:
            if bucket.handle is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
        for p in self.params:
            p.grad = p.main_grad

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()

"""ZeRO-3: each DP rank keeps 1/DP of the weights; a unit's weights are all-gathered just before use and freed after.

The weights live in the gradient buffer's coordinates (grad_buffer.py): every bucket has, on each DP rank, a
persistent shard (its chunk: the same range whose gradient the rank reduces and whose master weights it steps)
and a full tensor whose storage exists only while gathered. The model's parameters are views of the full
tensors for their whole life. Freeing resizes the storage to nothing; gathering gives it back and all-gathers
the shards into it without bumping the version counter, so the weights autograd saved in forward are, in
backward, the same values again (FSDP1's scheme; FSDP2 preserves the counter the same way).

A gather unit is a transformer block, or the weights before the blocks (embeddings) or after them (final norm,
output layer); buckets never straddle units (buckets.py). The model brackets each unit's forward with
`before_forward` / `after_forward` (engine/model/gpt.py, outside any compiled block):
- forward gathers the unit (waiting for its prefetch) and starts gathering the next one, and frees the unit
  after it; the weights outside the blocks stay gathered for the chunk's whole forward (the output layer and a
  tied embedding come at its end);
- if the unit's output needs a gradient, a hook on it gathers the unit again when backward reaches it and starts
  gathering the one before; full recompute re-runs the block inside that window, so it needs no gather of its
  own;
- once every parameter of the unit has its gradient for the micro-batch (post-accumulate hooks, after the
  gradient buffer's own), the unit is freed. Gradients are reduce-scattered per micro-batch as under ZeRO 2.

Buckets of deferred parameters (sequence-parallel norms, a tied embedding split over pipeline stages: their
gradients are summed over a model-parallel group first) stay whole on every rank and are all-gathered after
the optimizer step, as under ZeRO 1 and 2. With one DP rank nothing is freed: the shard is the whole bucket.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterator

import torch

from loom.engine.model import naming
from loom.engine.optim.buckets import Bucket, plan_buckets
from loom.engine.optim.grad_buffer import GradBuffer, all_gather_bucket_chunks
from loom.engine.parallel.mappings import all_gather_single
from loom.engine.parallel.param_info import param_info


def gather_unit(param: torch.nn.Parameter) -> Hashable:
    return naming.gather_unit(param_info(param).name)


class ShardedParameters:
    """The weights of `grads.params` held ZeRO-3 style (module docstring); built after the optimizer has copied
    its master weights from the full parameters."""

    def __init__(
        self,
        grads: GradBuffer,
        dp_group,
        dp_size: int,
        dp_rank: int,
        frozen: list[torch.nn.Parameter] = (),
        prefetch: bool = True,
    ):
        """`frozen`: weights without gradients (a LoRA run's base), sharded in buckets of their own, cut at units
        like the gradient buffer's."""
        self.grads, self.dp_group, self.dp_size, self.dp_rank, self.prefetch = (
            grads,
            dp_group,
            dp_size,
            dp_rank,
            prefetch,
        )
        frozen_offsets, frozen_buckets, _ = (
            plan_buckets(list(reversed(frozen)), grads.bucket_numel, dp_size, unit_of=gather_unit)
            if frozen
            else ({}, [], 0)
        )
        self.offsets = {**grads.offsets, **frozen_offsets}
        """Each parameter's place in its buckets' coordinates (the gradient buffer's, or the frozen weights')."""
        self.buckets = grads.buckets + frozen_buckets
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.starts = [b.start for b in grads.buckets]
        deferred = {id(b) for b in grads.deferred_buckets}
        self.whole = {id(b) for b in self.buckets if id(b) in deferred or dp_size == 1}
        """Buckets (ids) every rank holds whole throughout."""
        self.units: dict[Hashable, list[Bucket]] = {}
        for bucket in self.buckets:
            if id(bucket) not in self.whole:
                self.units.setdefault(gather_unit(bucket.params[0]), []).append(bucket)
        first = grads.params[0]
        self.full: dict[int, torch.Tensor] = {}
        self.shard: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            full = torch.zeros(bucket.end - bucket.start, dtype=first.dtype, device=first.device)
            for param in bucket.params:
                offset = self.offsets[param] - bucket.start
                view = full[offset : offset + param.numel()].view_as(param)
                view.copy_(param.detach())
                param.data = view
            lo, hi = bucket.chunk(dp_rank, dp_size)
            mine = full[lo - bucket.start : hi - bucket.start]
            self.full[id(bucket)] = full
            self.shard[id(bucket)] = mine if id(bucket) in self.whole else mine.clone()
        self.pending: dict[int, object] = {}
        """Bucket id -> the all-gather filling it (prefetched, not yet waited for)."""
        self.remaining: dict[Hashable, int] = {}
        """Units in backward -> what must still happen this micro-batch before they are freed: their parameters'
        gradients arriving, and for units with frozen weights the gradient of their input."""
        self.unit_params = {
            unit: [p for b in buckets for p in b.params if p.requires_grad] for unit, buckets in self.units.items()
        }
        frozen_ids = {id(b) for b in frozen_buckets}
        self.has_frozen = {unit for unit, buckets in self.units.items() if any(id(b) in frozen_ids for b in buckets)}
        """Units holding frozen weights: their gradients' arrival does not show that backward is done with them
        (the frozen weights still carry the input's gradient), so they also wait for the input's."""
        self.waits_for_input: set[Hashable] = set()
        unit_of_param = {p: unit for unit, params in self.unit_params.items() for p in params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._done(unit)) for p, unit in unit_of_param.items()]
        for unit in self.units:
            self.free(unit)

    # -- gather and free -----------------------------------------------------------------------
    def has(self, unit: Hashable) -> bool:
        return unit in self.units

    def _gathered(self, bucket: Bucket) -> bool:
        return self.full[id(bucket)].untyped_storage().nbytes() > 0

    def gather(self, unit: Hashable, wait: bool = True) -> None:
        """Give the unit's buckets their storage and all-gather the shards into them (asynchronously unless
        `wait`; a later gather of the same unit waits)."""
        for bucket in self.units.get(unit, ()):
            self._gather_bucket(bucket, wait)

    def _gather_bucket(self, bucket: Bucket, wait: bool) -> None:
        full = self.full[id(bucket)]
        if not self._gathered(bucket):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            with torch.autograd._unsafe_preserve_version_counter(full):
                self.pending[id(bucket)] = all_gather_single(
                    full, self.shard[id(bucket)], group=self.dp_group, async_op=True
                )
        if wait and id(bucket) in self.pending:
            self.pending.pop(id(bucket)).wait()

    def free(self, unit: Hashable) -> None:
        for bucket in self.units.get(unit, ()):
            self._free_bucket(bucket)

    def _free_bucket(self, bucket: Bucket) -> None:
        handle = self.pending.pop(id(bucket), None)
        if handle is not None:
            handle.wait()
        self.full[id(bucket)].untyped_storage().resize_(0)

    def free_all(self) -> None:
        """Between steps (and after a backward that left a unit's parameter without a gradient): nothing gathered."""
        self.remaining.clear()
        for unit in self.units:
            self.free(unit)

    # -- the model's calls around a unit ---------------------------------------------------------
    def before_forward(
        self, unit: Hashable, prefetch: Hashable | None = None, input: torch.Tensor | None = None
    ) -> None:
        self.gather(unit)
        if self.prefetch and prefetch is not None:
            self.gather(prefetch, wait=False)
        if unit in self.has_frozen and input is not None and torch.is_grad_enabled() and input.requires_grad:
            self.waits_for_input.add(unit)
            input.register_hook(lambda _grad: self._done(unit)(None))

    def after_forward(self, unit: Hashable, output: torch.Tensor, previous: Hashable | None = None) -> None:
        """Free the unit after its forward; if `output` will get a gradient, gather it again when backward
        reaches it (and prefetch `previous`, the unit whose backward comes next)."""
        if unit not in self.units:
            return
        self.free(unit)
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(self._backward_reaches(unit, previous))

    def _backward_reaches(self, unit: Hashable, previous: Hashable | None) -> Callable:
        def hook(_grad: torch.Tensor) -> None:
            waits = len(self.unit_params.get(unit, ())) + (unit in self.waits_for_input)
            if waits:  # else it stays gathered until its next forward ends or the step does
                self.remaining[unit] = waits
            self.gather(unit)
            if self.prefetch and previous is not None and previous not in self.remaining:
                self.gather(previous, wait=False)

        return hook

    def _done(self, unit: Hashable) -> Callable:
        """A hook counting one of the things the unit's backward waits for (module docstring)."""

        def hook(_param: torch.nn.Parameter | None) -> None:
            if unit not in self.remaining:
                return
            self.remaining[unit] -= 1
            if self.remaining[unit] == 0:
                del self.remaining[unit]
                self.free(unit)

        return hook

    # -- the optimizer's and the checkpoint's access -----------------------------------------------
    def _bucket_at(self, start: int) -> Bucket:
        """The gradient buffer's bucket holding buffer coordinate `start`."""
        return self.grads.buckets[bisect.bisect_right(self.starts, start) - 1]

    @torch.no_grad()
    def write(self, buffer_start: int, values: torch.Tensor) -> None:
        """Write updated weights at buffer coordinates this rank owns (one segment: within its bucket chunk)."""
        bucket = self._bucket_at(buffer_start)
        lo, _ = bucket.chunk(self.dp_rank, self.dp_size)
        shard = self.shard[id(bucket)]
        shard[buffer_start - lo : buffer_start - lo + values.numel()].copy_(values.reshape(-1))

    @torch.no_grad()
    def after_update(self) -> None:
        """All-gather the whole buckets after the optimizer has written every rank's part of them."""
        if self.dp_size == 1:
            return
        whole = [self.full[id(b)] for b in self.buckets if id(b) in self.whole]
        all_gather_bucket_chunks(whole, self.dp_rank, self.dp_size, self.dp_group)

    @torch.no_grad()
    def load(self, param: torch.nn.Parameter, values: torch.Tensor) -> None:
        """Set one parameter's weights (every rank has them whole, from a checkpoint): this rank's part goes
        into its shard, and a whole bucket gets all of it."""
        offset, bucket = self.offsets[param], self.bucket_of[param]
        flat = values.reshape(-1).to(self.full[id(bucket)].dtype)
        if id(bucket) in self.whole:
            start = offset - bucket.start
            self.full[id(bucket)][start : start + flat.numel()].copy_(flat)
            return
        lo, hi = bucket.chunk(self.dp_rank, self.dp_size)
        first, last = max(lo, offset), min(hi, offset + flat.numel())
        if first < last:
            self.shard[id(bucket)][first - lo : last - lo].copy_(flat[first - offset : last - offset])

    @torch.no_grad()
    def whole_weights(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Every parameter's full weights (frozen ones too), one bucket gathered at a time (a collective: every DP
        rank iterates); each tensor is valid until the next one is yielded."""
        for bucket in self.buckets:
            gathered_here = not self._gathered(bucket)
            if gathered_here:
                self._gather_bucket(bucket, wait=True)
            full = self.full[id(bucket)]
            for param in bucket.params:
                offset = self.offsets[param] - bucket.start
                yield param, full[offset : offset + param.numel()].view_as(param)
            if gathered_here:
                self._free_bucket(bucket)

    def stored_bytes(self) -> int:
        """Bytes of weights that persist through a step: the shards and the whole buckets."""
        kept = (self.full if id(b) in self.whole else self.shard for b in self.buckets)
        return sum(t[id(b)].numel() * t[id(b)].element_size() for b, t in zip(self.buckets, kept, strict=True))

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()

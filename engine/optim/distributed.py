"""DistributedOptimizer: fp32 master weights, mixed precision, ZeRO sharding and CPU offload.

The optimizer steps *segments*: pieces of parameters in fp32. Without ZeRO a segment is a
whole parameter, held by every DP rank (for fp32 parameters it is the parameter itself: no
copy). With ZeRO 1 or 2 each DP rank holds segments only for its chunk of every gradient
bucket, so master weights and optimizer state are split DP ways; after the step every rank
writes its updated chunk into a flat parameter buffer (the model's parameters are views of it)
and the buckets are all-gathered. ZeRO 2 differs only in where the reduced gradients come from
(the GradBuffer's shard). ZeRO 3 keeps the weights sharded too: the step writes each rank's chunk into
its shard of them (param_shards.py) and nothing is all-gathered until a layer is used. The global gradient
norm, the fp16 inf check and LAMB's per-parameter norms each take one collective over the ranks that own a
piece.

With `offload = "cpu"` every segment's master weights, gradient copy and optimizer state are in
host memory (pinned when the parameters are on a GPU) and the update runs there; the step copies
the reduced gradients down and the updated weights back up. The step is not overlapped with the
next forward: that forward needs the weights this step writes.

Supported: AdamW, SGD and LAMB with or without ZeRO and offload; Adafactor without either (its
factored moments need whole matrices, and its step talks to the TP group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.engine.config import OptimConfig
from loom.engine.cuda_env import exact_size_pinned_blocks
from loom.engine.model import naming
from loom.engine.model.kernels import build_adamw, default_adamw
from loom.engine.optim.algorithms import Adafactor, Lamb
from loom.engine.optim.grad_buffer import GradBuffer, all_gather_bucket_chunks
from loom.engine.optim.loss_scaler import LossScaler
from loom.engine.optim.model_parallel_grads import counted_once
from loom.engine.optim.param_shards import ShardedParameters
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.state import ParallelState


@dataclass
class Segment:
    param: torch.nn.Parameter
    start: int
    """First element of the segment in the flattened parameter."""
    end: int
    buffer_start: int
    """Where the segment's gradient sits in the gradient buffer (-1: in param.grad)."""
    master: torch.Tensor
    """fp32 weights the optimizer updates (the parameter itself when that needs no copy)."""
    grads: GradBuffer
    """The gradient buffer of the parameter: its ranks (dp_group) hold the same weights."""
    host_grad: torch.Tensor | None = None
    """Offload: the host copy of the segment's reduced gradient the update reads."""

    @property
    def aliases_param(self) -> bool:
        return self.master is self.param


class DistributedOptimizer:
    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        grads: GradBuffer | list[GradBuffer],
        config: OptimConfig,
        state: ParallelState,
        num_layers: int,
        loss_scaler: LossScaler | None = None,
        adamw_impl: str | None = None,
        frozen: list[torch.nn.Parameter] = (),
    ):
        """`grads`: the gradient buffer of every parameter, or several, each over its own ranks (the experts' over
        the ranks holding the same experts, under expert parallelism). `adamw_impl` is the AdamW kernels.py chose
        (None: torch's fused AdamW on CUDA, foreach on CPU); offloaded, the update runs on the host with torch's CPU
        AdamW instead. `frozen` weights (a LoRA base) are only sharded, under ZeRO-3."""
        self.buffers = [grads] if isinstance(grads, GradBuffer) else list(grads)
        grads = self.buffers[0]
        self.config, self.state, self.grads, self.loss_scaler = config, state, grads, loss_scaler
        self.sharded = config.zero >= 1
        """Each DP x CP rank holds only its share of master weights and optimizer state (ZeRO 1, 2 and 3; the
        weights themselves are sharded only under ZeRO 3: `sharded_params`)."""
        self.offload = config.offload == "cpu"
        self.device = grads.params[0].device
        if self.offload and self.device.type == "cuda":  # the host copies below are pinned: at their own size
            exact_size_pinned_blocks()
        self.adamw_impl = "torch.AdamW(foreach)" if self.offload else adamw_impl
        self.named_params = named_params
        self.param_index = {p: i for i, (_, p) in enumerate(named_params)}
        self._replicated = torch.tensor([param_info(p).shard_spec.is_replicated for _, p in named_params])
        self._experts = torch.tensor([float(param_info(p).expert_range is not None) for _, p in named_params])
        self.segments = [seg for buffer in self.buffers for seg in self._make_segments(buffer)]
        self.param_buffers = (
            [self._make_param_buffer(buffer) for buffer in self.buffers] if self.sharded and config.zero < 3 else None
        )
        """ZeRO 1 and 2: per gradient buffer, one flat tensor of the weights laid out like it (the parameters are
        views of it), whose chunks the ranks all-gather after each step."""
        self.sharded_params = (
            ShardedParameters(grads, state.grad_group, state.grad_size, state.grad_rank, frozen)
            if config.zero == 3
            else None
        )
        """ZeRO-3: the weights, 1/DP of them on this rank between uses (param_shards.py)."""
        self.inner = self._build_inner(num_layers)
        # Parameters keep their storage from here on (the flat buffer above is the last re-pointing), so the step's
        # per-segment views are made once: the step boundary is where a GPU waits for the host, and each view
        # costs a few microseconds of Python per segment and step.
        self._norm_segments = [seg for seg in self.segments if self._counts(seg)]
        # (ZeRO-3 writes into the weights' shards instead: the parameters have no storage between uses.)
        copied = [seg for seg in self.segments if not seg.aliases_param] if self.sharded_params is None else []
        self._copy_targets = [seg.param.detach().view(-1)[seg.start : seg.end] for seg in copied]
        self._copy_sources = [seg.master.detach().reshape(-1) for seg in copied]
        # Where the GradBuffer leaves each segment's reduced gradient (None: in param.grad); the buffer never moves.
        self._grad_views = [
            None
            if seg.buffer_start < 0
            else seg.grads.gradient(seg.buffer_start, seg.end - seg.start).view_as(seg.master)
            for seg in self.segments
        ]

    # -- construction -----------------------------------------------------------------------
    def _make_segments(self, grads: GradBuffer) -> list[Segment]:
        if not grads.enabled:  # fp32, one DP rank: step the parameters themselves
            if self.offload:
                return [Segment(p, 0, p.numel(), -1, self._on_host(p.detach()), grads) for p in grads.params]
            return [Segment(p, 0, p.numel(), -1, p, grads) for p in grads.params]
        segments = []
        for lo, hi in grads.owned_ranges():
            for param in grads.params:
                offset = grads.offsets[param]
                start, end = max(lo, offset), min(hi, offset + param.numel())
                if start >= end:
                    continue
                whole = end - start == param.numel()
                if whole and param.dtype == torch.float32 and not self.sharded and not self.offload:
                    master = param
                else:
                    flat = param.detach().reshape(-1)[start - offset : end - offset]
                    flat = self._on_host(flat) if self.offload else flat.float().clone()
                    master = flat.view_as(param) if whole else flat
                segments.append(Segment(param, start - offset, end - offset, start, master, grads))
        return segments

    def _on_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """An fp32 host copy, pinned when the device is a GPU (so the per-step copies can be asynchronous)."""
        pin = self.device.type == "cuda"
        host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=pin)
        host.copy_(tensor)
        return host

    def _make_param_buffer(self, grads: GradBuffer) -> torch.Tensor:
        """One flat tensor laid out like the gradient buffer; parameters become views of it."""
        first = grads.params[0]
        buffer = torch.zeros(grads.total, dtype=first.dtype, device=first.device)
        for param in grads.params:
            offset = grads.offsets[param]
            view = buffer[offset : offset + param.numel()].view_as(param)
            view.copy_(param.detach())
            param.data = view
        return buffer

    def _build_inner(self, num_layers: int) -> torch.optim.Optimizer:
        c = self.config
        groups: dict[tuple[float, float], list[torch.Tensor]] = {}
        for seg in self.segments:
            info = param_info(seg.param)
            decay = 0.0 if info.no_decay else c.weight_decay
            scale = c.layer_lr_decay ** (num_layers + 1 - naming.depth(info.name, num_layers))
            groups.setdefault((decay, scale), []).append(seg.master)
        param_groups = [{"params": ps, "weight_decay": wd, "lr_scale": s} for (wd, s), ps in groups.items()]
        if c.name == "adamw":
            impl = self.adamw_impl or default_adamw(self.segments[0].master.device)
            return build_adamw(param_groups, c.lr, (c.beta1, c.beta2), c.eps, impl)
        if c.name == "sgd":
            return torch.optim.SGD(param_groups, lr=c.lr, momentum=c.momentum)
        if c.name == "lamb":
            ids = {id(seg.master): self.param_index[seg.param] for seg in self.segments}
            return Lamb(
                param_groups,
                lr=c.lr,
                betas=(c.beta1, c.beta2),
                eps=c.eps,
                param_ids=ids,
                num_params=len(self.param_index),
                reduce=self._reduce_per_param,
            )
        if c.name == "adafactor":
            return Adafactor(
                param_groups,
                lr=c.lr,
                tp_group=self.state.tp_group,
                tp_rank=self.state.tp_rank,
                tp_size=self.state.tp_size,
                shard_specs={id(seg.master): param_info(seg.param).shard_spec for seg in self.segments},
            )
        raise ValueError(f"unknown optimizer {c.name!r}")

    # -- collectives over owners --------------------------------------------------------------
    def writes(self, seg: Segment) -> bool:
        """Whether this rank saves the segment's master weights and state: its owner under ZeRO, else the first of
        the ranks holding the same weights."""
        return self.sharded or seg.grads.dp_rank == 0

    def _counts(self, seg: Segment) -> bool:
        """Whether this rank's copy of the segment counts toward a global sum (each piece once):
        once over TP (counted_once), and over DP by its owner (every DP rank's own piece under ZeRO)."""
        return counted_once(seg.param, self.state.tp_rank) and self.writes(seg)

    def _reduce_per_param(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum per-parameter partial sums (rows indexed like named_params) over DP pieces and TP shards (and an
        expert weight's over the ranks holding its other experts)."""
        home = partial.device
        partial = partial.to(self.device)  # offloaded, the sums are on the host; NCCL needs the device
        if self.sharded and self.state.grad_size > 1:  # (an expert's pieces: over its ranks' experts too)
            dist.all_reduce(partial, group=self.state.grad_group)
        elif self.state.ep_size > 1:  # each rank's experts whole: theirs summed over the EP group
            experts = self._experts.to(partial.device)
            summed = partial * experts.unsqueeze(-1) if partial.dim() > 1 else partial * experts
            dist.all_reduce(summed, group=self.state.ep_group)
            partial = torch.where(experts.view(-1, *[1] * (partial.dim() - 1)).bool(), summed, partial)
        if self.state.tp_size > 1:
            if self.state.tp_rank != 0:
                partial[self._replicated.to(partial.device)] = 0
            dist.all_reduce(partial, group=self.state.tp_group)
        return partial.to(home)

    def _grads(self) -> list[torch.Tensor]:
        """Each segment's reduced gradient where the GradBuffer left it (on the device), in the master's dtype: a
        bf16 buffer's (optim.grad_dtype) is copied to fp32 for the step, as Megatron does."""
        return [
            seg.param.grad if view is None else view if view.dtype == seg.master.dtype else view.to(seg.master.dtype)
            for seg, view in zip(self.segments, self._grad_views, strict=True)
        ]

    def squared_grad_norm(self) -> torch.Tensor:
        """The global squared gradient norm, as a tensor on the device: reading it is the caller's one sync.
        torch's multi-tensor norm reads every gradient once, in a few kernels, where a per-segment square and sum
        launched three kernels per segment. It accumulates in fp64: CPU's norm kernel sums fp32 in order (1e-5 off
        at 500k elements; CUDA's multi-tensor kernel takes fp64 on its fast path too)."""
        counted = [seg.master.grad for seg in self._norm_segments]
        if counted:
            squares = torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float64)).pow(2).sum().float()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=self.segments[0].master.device)
        squares = squares.to(self.device)
        if self.state.world_size > 1:
            dist.all_reduce(squares)
        return squares

    # -- the step -----------------------------------------------------------------------------
    def prepare(self) -> torch.Tensor:
        """Point the master weights at this step's gradients and unscale them (fp16); returns the squared
        global gradient norm on the device, for the caller to read together with its loss in one transfer."""
        for seg, grad in zip(self.segments, self._grads(), strict=True):
            if self.offload:
                if seg.host_grad is None:  # pinned like the master: empty_like does not carry pinning, and a copy
                    # into pageable memory is neither asynchronous nor overlapped (a bounce buffer, one at a time)
                    pinned = seg.master.is_pinned()
                    seg.host_grad = torch.empty(seg.master.shape, dtype=seg.master.dtype, pin_memory=pinned)
                seg.master.grad = seg.host_grad.copy_(grad, non_blocking=True)
            elif not seg.aliases_param:
                seg.master.grad = grad
        if self.offload and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host reads what non_blocking copied
        if self.loss_scaler is not None:
            # train.py back-propagated scale x grad_size (the scale applies to each rank's own token mean)
            unscale = 1.0 / (self.loss_scaler.scale * self.state.grad_size)
            torch._foreach_mul_([s.master.grad for s in self.segments], unscale)
        return self.squared_grad_norm()

    def apply(self, lr: float, norm: float, skip: bool = False) -> dict:
        """Check, clip and apply the prepared gradients whose global norm is `norm`; returns grad_norm,
        skipped and nonfinite. A non-finite norm outside fp16 loss scaling, or `skip` (a non-finite loss),
        drops the update: applying it would turn every weight into NaN. Under fp16 an overflow alone is the loss
        scaler's to handle (not `nonfinite`), but a non-finite loss is one at any scale: the forward itself failed,
        which a lower scale cannot mend, so the scaler neither sees nor counts that step. No device-to-host transfer
        here."""
        if skip:
            return {"grad_norm": norm, "skipped": True, "nonfinite": True}
        if self.loss_scaler is not None and self.loss_scaler.update(found_inf=not math.isfinite(norm)):
            return {"grad_norm": norm, "skipped": True, "nonfinite": False}
        if not math.isfinite(norm):
            return {"grad_norm": norm, "skipped": True, "nonfinite": True}
        if self.config.clip_grad > 0 and norm > self.config.clip_grad:
            torch._foreach_mul_([s.master.grad for s in self.segments], self.config.clip_grad / (norm + 1e-6))
        for group in self.inner.param_groups:
            group["lr"] = lr * group["lr_scale"]
        self.inner.step()
        self._publish()
        return {"grad_norm": norm, "skipped": False, "nonfinite": False}

    def step(self, lr: float, skip: bool = False) -> dict:
        """prepare() and apply() with the norm read on its own (the trainer reads it with the loss)."""
        return self.apply(lr, math.sqrt(self.prepare().item()), skip)

    @torch.no_grad()
    def _publish(self) -> None:
        """Copy updated master weights into the model's parameters (all-gathering them under ZeRO-1; into this
        rank's shard of them under ZeRO-3, where the next use gathers them)."""
        if self.sharded_params is not None:
            for seg in self.segments:
                self.sharded_params.write(seg.buffer_start, seg.master)
            self.sharded_params.after_update()
            return
        if self._copy_targets:
            torch._foreach_copy_(self._copy_targets, self._copy_sources)
        for grads, weights in zip(self.buffers, self.param_buffers or (), strict=False):
            if grads.dp_size > 1:
                buckets = [weights[bucket.start : bucket.end] for bucket in grads.buckets]
                all_gather_bucket_chunks(buckets, grads.dp_rank, grads.dp_size, grads.dp_group)

    def state_bytes(self) -> int:
        """Bytes of master weights (copies only) and optimizer state this rank holds, wherever they are."""
        total = sum(s.master.numel() * s.master.element_size() for s in self.segments if not s.aliases_param)
        for state in self.inner.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return total

    def host_gradient_bytes(self) -> int:
        """Offload: the host copies of the reduced gradients the update reads (made at the first step)."""
        return sum(s.host_grad.numel() * s.host_grad.element_size() for s in self.segments if s.host_grad is not None)

    def device_state_bytes(self) -> int:
        """The part of state_bytes() on the accelerator: none when offloaded (the host copies of the
        gradients offload keeps are host memory too)."""
        return 0 if self.offload else self.state_bytes()

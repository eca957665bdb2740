"""Runs one rank's pipeline op list: forwards, backwards and the exchanges between them.

The model chunks of this rank (one per virtual stage it holds) are driven in the order the
schedule says. A forward keeps its input and output until its backward; once the output has
been sent to the next stage, its storage is released (only the autograd graph is kept, which is
all backward needs), like Megatron's deallocate_output_tensor. With P = 1 the op list is plain
gradient accumulation and no communication happens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from loom.engine.model.moe import router_loss_gradient
from loom.engine.parallel.state import ParallelState
from loom.engine.pipeline.p2p import run_exchange
from loom.engine.pipeline.schedules import Compute, Exchange, Op


def _free_storage(tensor: torch.Tensor) -> None:
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def _backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward through a graph whose output storage was freed (the shape check would refuse it)."""
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True
    )  # keep_graph, create_graph, inputs, allow_unreachable, accumulate


class PipelineExecutor:
    def __init__(
        self,
        chunks: list[torch.nn.Module],
        state: ParallelState,
        hidden_shape: tuple[int, ...],
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager],
        p2p_dtype: torch.dtype = torch.float32,
        router_losses: bool = False,
        expert_loads: bool = False,
    ):
        """`router_losses`: whether the chunks' blocks add router losses to the loss (ModelConfig.router_losses);
        `expert_loads`: whether they count their experts' loads (ModelConfig.moves_expert_biases)."""
        self.chunks, self.state, self.device, self.autocast = chunks, state, device, autocast
        self.router_losses, self.count_expert_loads = router_losses, expert_loads
        self.expert_loads: dict[str, torch.Tensor] = {}
        """The last run's token choices per expert on this rank, by MoE block name, summed over its micro-batches."""
        self.router_loss_sums: dict[str, torch.Tensor] = {}
        """This rank's share of the last run's router losses, by metric name: each micro-batch's (summed over this
        rank's blocks) by its share of the batch's tokens; summed over DP, CP and the pipeline, the mean per
        micro-batch."""
        self.hidden_shape = hidden_shape
        self.p2p_dtype = p2p_dtype
        """What crosses stage boundaries: the compute dtype, as Megatron sends (half the bytes of fp32 under bf16)."""
        self.num_stages = state.pp_size * len(chunks)
        self.peak_live = 0
        """Most forwards held at once awaiting their backward, in the last run (activation memory)."""
        self.timeline: list[tuple[str, int, int, float, float]] = []
        """(kind, microbatch, chunk, start, end) wall-clock times of the last run's compute ops, if recorded."""

    def _stage(self, chunk: int) -> int:
        return chunk * self.state.pp_size + self.state.pp_rank

    def run(
        self,
        ops: list[Op],
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        tokens_in_batch: int,
        on_last_backward: Callable[[bool], None] | None = None,
        record: bool = False,
        loss_scale: float = 1.0,
    ) -> torch.Tensor:
        """Execute the ops; returns this rank's share of the loss (nonzero on the last stage only).

        `on_last_backward(flag)` is told before each backward whether it is the chunk's last in
        this step (when gradient reduction may start). With `record`, the compute ops' wall-clock
        times replace `self.timeline`. The last stage back-propagates loss * loss_scale (fp16).
        """
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self.router_loss_sums, self.expert_loads = {}, {}
        inputs, outputs, outgoing, received = {}, {}, {}, {}
        share = microbatches[0][0].numel() / tokens_in_batch if microbatches else 0.0  # every micro-batch's
        if self.router_losses:
            weight = router_loss_gradient(share, loss_scale, self.state.tp_size)
            for chunk in self.chunks:
                chunk.set_router_loss_weight(weight)
        live = self.peak_live = 0
        last_microbatch = len(microbatches) - 1
        if record:
            self.timeline = []
        for op in ops:
            started = time.time()
            if isinstance(op, Exchange):
                received.update(
                    run_exchange(
                        op,
                        outgoing,
                        self.state.pp_ranks,
                        self.state.pp_group,
                        self.hidden_shape,
                        self.p2p_dtype,
                        self.device,
                    )
                )
                self._release_sent(op, outputs)
                continue
            key, stage = (op.microbatch, op.chunk), self._stage(op.chunk)
            if op.kind == "F":
                output, hidden = self._forward(op, stage, microbatches, received, tokens_in_batch)
                for name, value in (self.chunks[op.chunk].take_router_losses() if self.router_losses else {}).items():
                    self.router_loss_sums[name] = self.router_loss_sums.get(name, 0.0) + value * share
                for name, load in (
                    self.chunks[op.chunk].take_expert_loads() if self.count_expert_loads else {}
                ).items():
                    self.expert_loads[name] = self.expert_loads[name] + load if name in self.expert_loads else load
                if stage == self.num_stages - 1:
                    total += output.detach()
                else:
                    outgoing[("act", op.microbatch, stage)] = output.detach().to(self.p2p_dtype)
                inputs[key], outputs[key] = hidden, output
                live += 1
                self.peak_live = max(self.peak_live, live)
            elif op.kind == "B":
                if on_last_backward is not None:
                    on_last_backward(op.microbatch == last_microbatch)
                hidden, output = inputs.pop(key), outputs.pop(key)
                if stage == self.num_stages - 1:
                    (output * loss_scale if loss_scale != 1.0 else output).backward()
                else:
                    grad = received.pop(("grad", op.microbatch, stage + 1)).to(output.dtype)
                    _backward_from(output, grad)
                if stage > 0:
                    outgoing[("grad", op.microbatch, stage)] = hidden.grad.to(self.p2p_dtype)
                live -= 1
            if record:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.timeline.append((op.kind, op.microbatch, op.chunk, started, time.time()))
        return total

    def _forward(self, op: Compute, stage: int, microbatches, received: dict, tokens_in_batch: int):
        tokens, labels = microbatches[op.microbatch]
        hidden = None
        if stage > 0:
            hidden = received.pop(("act", op.microbatch, stage - 1)).requires_grad_()
        chunk = self.chunks[op.chunk]
        with self.autocast():
            if stage == self.num_stages - 1:
                output = chunk(tokens, labels, hidden=hidden).sum() / tokens_in_batch
            else:
                output = chunk(tokens, None, hidden=hidden)
        return output, hidden

    def _release_sent(self, exchange: Exchange, outputs: dict) -> None:
        """Free the storage of outputs the next stage now has; their graphs stay for backward."""
        for t in exchange.transfers:
            if t.direction == "send" and t.tensor == "act":
                _free_storage(outputs[(t.microbatch, t.virtual_stage // self.state.pp_size)])

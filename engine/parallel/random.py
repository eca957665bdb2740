"""Per-rank random streams, so dropout masks are right under tensor and sequence parallelism.

Replicated activations must see the same mask on every TP rank (the "replicated" stream, seeded
alike on all of them); split activations (TP shards, sequence-parallel slices) need different
masks per TP rank (the "tensor" stream). Recompute replays the streams of the original forward.
Seeds follow Megatron: the run's seed plus 100 x the pipeline rank (megatron/training's
_set_random_seed), so layers on different stages draw different masks; then the replicated stream
takes that seed and the tensor stream that seed + 2718 + the TP rank (megatron-core's
model_parallel_cuda_manual_seed).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

_TENSOR_STREAM_OFFSET = 2718
_PIPELINE_STAGE_OFFSET = 100
# The key of torch's default CPU generator in a state_dict, beside the streams' names.
_DEFAULT_GENERATOR = "torch"


class RNGStreams:
    """Named CPU/CUDA generator states that can be forked into for a region of code."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device, pp_rank: int = 0):
        self.device = device
        stage_seed = seed + _PIPELINE_STAGE_OFFSET * pp_rank
        self.seeds = {"replicated": stage_seed, "tensor": stage_seed + _TENSOR_STREAM_OFFSET + tp_rank}
        self.states: dict[str, torch.Tensor] = {}
        for name, stream_seed in self.seeds.items():
            generator = torch.Generator(device=device).manual_seed(stream_seed)
            self.states[name] = generator.get_state()

    def _get_rng(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set_rng(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        outside = self._get_rng()
        self._set_rng(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get_rng()
            self._set_rng(outside)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def restore(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's random state for a checkpoint: every stream and torch's default CPU generator."""
        return {_DEFAULT_GENERATOR: torch.get_rng_state(), **self.states}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what state_dict returned; every stream this object has must be in `state`."""
        torch.set_rng_state(state[_DEFAULT_GENERATOR])
        for name in self.states:
            self.states[name] = state[name]


def hidden_state_stream(sequence_parallel: bool) -> str:
    """The stream for dropout on the hidden states between blocks (the embedding's output, each residual branch):
    split along the sequence across the TP ranks under sequence parallelism, so each slice draws its own mask;
    replicated on every TP rank otherwise, so all of them drop the same elements (megatron-core's choice too)."""
    return "tensor" if sequence_parallel else "replicated"


def checkpointed(function: Callable, streams: RNGStreams | None, *args):
    """Activation checkpointing that replays the RNG streams of the first forward on recompute."""
    if streams is None:
        return checkpoint(function, *args, use_reentrant=False)
    before = streams.snapshot()
    calls = [0]

    def run(*inner):
        calls[0] += 1
        if calls[0] == 1:
            return function(*inner)
        after = streams.snapshot()
        streams.restore(before)
        try:
            return function(*inner)
        finally:
            streams.restore(after)

    return checkpoint(run, *args, use_reentrant=False)

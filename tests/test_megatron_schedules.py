"""loom's pipeline schedules against megatron-core's own: each rank's forward/backward order.

megatron-core's schedule functions (`get_forward_backward_func`: no pipelining, 1F1B, interleaved
1F1B) are run for real, one pipeline rank at a time on CPU, with a point-to-point communicator
whose transfers hand back zero tensors and with model chunks that record each forward and, through
autograd, each backward. Their order is then the order megatron-core computes in, warm-up counts,
schedule table and per-chunk queues included, without restating any of its logic here.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from loom.engine.pipeline.schedules import (
    Compute,
    ScheduleError,
    build_schedule,
    check_schedule,
    compute_units,
    warmup_forwards,
)
from loom.engine.pipeline.simulate import peak_in_flight

mcore_schedules = pytest.importorskip(
    "megatron.core.pipeline_parallel.schedules", reason="megatron-core is not installed"
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

# megatron-core warns that Apex and Transformer Engine are absent and about config defaults it is
# deprecating; the schedules depend on none of them.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron")


class _Group:
    """Stands in for a process group: megatron-core asks it only for its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _LoopbackCommunicator(P2PCommunicator):
    """megatron-core's communicator with the wire cut: every receive yields a zero tensor (needing
    a gradient, as a received activation does), every send goes nowhere. All of megatron-core's
    decisions about what to send and receive when stay in its own methods."""

    def __init__(self, pp_group: _Group, config: TransformerConfig) -> None:
        self.pp_group, self.config = pp_group, config
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size

    def _communicate(
        self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs=True
    ):
        def received():
            return torch.zeros(tensor_shape, requires_grad=True)

        return received() if recv_prev else None, received() if recv_next else None, None if wait_on_reqs else []


class _RecordBackward(torch.autograd.Function):
    """Identity whose backward appends (B, microbatch, chunk) to the log: the backward megatron-core
    runs is whichever graph it pops from its queues, so the log is read off autograd itself."""

    @staticmethod
    def forward(ctx, x, log, microbatch, chunk):
        ctx.log, ctx.key = log, (microbatch, chunk)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(Compute("B", *ctx.key))
        return grad, None, None, None


class _RecordingChunk(torch.nn.Module):
    def __init__(self, config: TransformerConfig, chunk: int, log: list[Compute]) -> None:
        super().__init__()
        self.config, self.chunk, self.log = config, chunk, log
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.ones(1, 1, 1))
        self.input_tensor = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]


def _forward_step(microbatch_ids, chunk: _RecordingChunk):
    # Each chunk's data iterator yields its microbatch ids in order, as megatron-core's data iterators do.
    microbatch = next(microbatch_ids)
    chunk.log.append(Compute("F", microbatch, chunk.chunk))
    x = chunk.weight if chunk.input_tensor is None else chunk.input_tensor * chunk.weight
    return _RecordBackward.apply(x, chunk.log, microbatch, chunk.chunk), lambda output: (output.sum(), {})


def megatron_order(rank: int, pp: int, vp: int, microbatches: int, forward_only: bool = False) -> list[Compute]:
    """The forwards and backwards megatron-core runs on pipeline rank `rank`, in its order."""
    log: list[Compute] = []
    config = TransformerConfig(
        num_layers=pp * vp,
        hidden_size=1,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        pipeline_dtype=torch.float32,
    )
    pp_group = _Group(rank, pp)
    groups = ProcessGroupCollection()
    groups.tp, groups.cp, groups.dp_cp, groups.pp = _Group(0, 1), _Group(0, 1), _Group(0, 1), pp_group
    groups.embd = groups.pos_embd = None
    chunks = [_RecordingChunk(config, c, log) for c in range(vp)]
    run = mcore_schedules.get_forward_backward_func(pp_size=pp, vp_size=vp if vp > 1 else None)
    zeros = torch.zeros
    # megatron-core reads ranks only once torch.distributed reports itself initialised, and keeps
    # its token count on "cuda"; neither matters to the order, so both are bent for this call.
    with (
        mock.patch("torch.distributed.is_initialized", lambda: True),
        mock.patch("torch.zeros", lambda *shape, device=None, **kwargs: zeros(*shape, **kwargs)),
    ):
        run(
            forward_step_func=_forward_step,
            data_iterator=[iter(range(microbatches)) for _ in chunks] if vp > 1 else iter(range(microbatches)),
            model=chunks if vp > 1 else chunks[0],
            num_microbatches=microbatches,
            seq_length=1,
            micro_batch_size=1,
            forward_only=forward_only,
            p2p_communicator=_LoopbackCommunicator(pp_group, config),
            pg_collection=groups,
        )
    return log


def loom_order(rank: int, pp: int, vp: int, microbatches: int, forward_only: bool = False) -> list[Compute]:
    return [op for unit in compute_units(rank, pp, vp, microbatches, forward_only) for op in unit]


def _grid():
    for pp in range(1, 9):
        for vp in range(1, 5):
            for microbatches in range(1, 3 * pp + 1):
                try:
                    check_schedule(pp, vp, microbatches)
                except ScheduleError:
                    continue
                yield pp, vp, microbatches


GRID = list(_grid())


def test_the_grid_has_the_cases_that_matter():
    assert len(GRID) == 171
    # microbatches == pp (every microbatch in flight at once) is where loom used to differ
    assert {(8, 2, 8), (4, 4, 4), (2, 2, 2), (8, 1, 8), (1, 1, 1)} <= set(GRID)


@pytest.mark.parametrize("pp, vp, microbatches", GRID)
def test_compute_order_equals_megatron_core(pp, vp, microbatches):
    for rank in range(pp):
        assert loom_order(rank, pp, vp, microbatches) == megatron_order(rank, pp, vp, microbatches), f"rank {rank}"


def test_warmup_forwards_are_megatron_cores_at_every_size():
    """The activations the planner counts per pipeline rank come from warmup_forwards: equal to megatron-core's
    get_pp_rank_microbatches well past the order grid (pp up to 64, vp up to 8), every rank."""
    from types import SimpleNamespace

    cases = 0
    for pp in (2, 3, 4, 8, 16, 64):
        for vp in (1, 2, 3, 8):
            for microbatches in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 1, 8 * pp} - {0}):
                try:
                    check_schedule(pp, vp, microbatches)
                except ScheduleError:
                    continue
                for rank in range(pp):
                    stage = SimpleNamespace(pp_group=_Group(rank, pp), virtual_pipeline_model_parallel_size=vp)
                    if vp == 1:
                        stage.virtual_pipeline_model_parallel_size = None
                    _, _, theirs, _ = mcore_schedules.get_pp_rank_microbatches(
                        microbatches, vp, pp, p2p_communicator=stage
                    )
                    assert warmup_forwards(rank, pp, vp, microbatches) == theirs, (rank, pp, vp, microbatches)
                    cases += 1
    assert cases > 1000


@pytest.mark.parametrize("pp, vp, microbatches", [(4, 1, 6), (4, 2, 8), (2, 4, 4), (8, 2, 8)])
def test_forward_only_order_equals_megatron_core(pp, vp, microbatches):
    for rank in range(pp):
        assert loom_order(rank, pp, vp, microbatches, forward_only=True) == megatron_order(
            rank, pp, vp, microbatches, forward_only=True
        )


def test_peak_activations_at_pp8_vp2_m8_are_megatron_cores():
    peaks_loom = [peak_in_flight(build_schedule(rank, 8, 2, 8)) for rank in range(8)]
    peaks_megatron = [peak_in_flight(megatron_order(rank, 8, 2, 8)) for rank in range(8)]
    assert peaks_loom == peaks_megatron
    # warm-up (8 - 1 - rank) * 2 + (2 - 1) * 8 capped at all 16, plus the forward of the first 1F1B step
    assert peaks_megatron == [16, 16, 16, 16, 15, 13, 11, 9]

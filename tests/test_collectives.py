"""Everything a bf16 step sends between ranks carries the compute dtype: every collective and p2p transfer of
activations or their gradients is recorded (at the dispatcher, where torch.distributed's ops pass) during one
training step and checked for dtype and count against the layer count. fp32 is left to what is fp32 by
design: the cross-entropy's per-token statistics, the sequence-parallel norm-weight gradients and the loss."""

import collections

import pytest
import torch
from dist_utils import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from training_runs import tiny_config

from loom.engine.config import ModelConfig
from loom.engine.model.transformer import Norm
from loom.engine.train import Trainer

HIDDEN, LAYERS, MICROBATCHES, SEQ, MICRO = 128, 4, 2, 32, 2


class CollectiveRecorder(TorchDispatchMode):
    """(op, dtype, shape) of every c10d op the dispatcher sees."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func):
            tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            self.calls.append((str(func).split(".")[1], str(tensors[0].dtype), tuple(tensors[0].shape)))
        return func(*args, **(kwargs or {}))


def _collectives_of_a_step(rank, world, dataset, run_dir, parallel):
    train = {"precision": "bf16", "steps": 2, "global_batch_size": MICROBATCHES * MICRO, "micro_batch_size": MICRO}
    config = tiny_config(dataset, run_dir, parallel=parallel, train={**train, "seq_length": SEQ})
    trainer = Trainer(config)
    trainer.train_step()
    with CollectiveRecorder() as recorder:
        trainer.train_step()
    trainer.close()
    return collections.Counter(recorder.calls)


@pytest.fixture(scope="module")
def dataset(markov_dataset):
    return markov_dataset(50)


def test_sequence_parallel_moves_bf16(dataset, tmp_path):
    tp = 2
    calls = run_ranks(_collectives_of_a_step, tp, dataset, str(tmp_path), {"tp": tp, "sequence_parallel": True})[0]
    activations = {call: n for call, n in calls.items() if call[2][-1:] == (HIDDEN,)}
    # Per layer and micro-batch: all-gathers before attention and MLP and reduce-scatters after them, the
    # same again in backward; plus the output layer's gather and the embedding's reduce-scatter (and backward).
    expected = MICROBATCHES * (4 * LAYERS + 2)
    assert activations == {
        ("_allgather_base_", "torch.bfloat16", (SEQ, MICRO, HIDDEN)): expected,
        ("_reduce_scatter_base_", "torch.bfloat16", (SEQ // tp, MICRO, HIDDEN)): expected,
    }
    fp32 = {call: n for call, n in calls.items() if call[1] == "torch.float32"}
    assert all(shape in {(SEQ, MICRO), ()} or len(shape) == 1 for _, _, shape in fp32), fp32


def test_pipeline_stages_exchange_bf16(dataset, tmp_path):
    calls = run_ranks(_collectives_of_a_step, 2, dataset, str(tmp_path), {"pp": 2})[0]
    p2p = {call: n for call, n in calls.items() if call[0] in ("send", "recv_")}
    # stage 0 sends each micro-batch's activations forward and receives their gradients back
    assert p2p == {
        ("send", "torch.bfloat16", (SEQ, MICRO, HIDDEN)): MICROBATCHES,
        ("recv_", "torch.bfloat16", (SEQ, MICRO, HIDDEN)): MICROBATCHES,
    }


def test_norm_output_is_in_the_compute_dtype():
    """CUDA's autocast computes norms in fp32 and returns fp32; an fp32 input does the same on CPU."""
    norm = Norm(ModelConfig(hidden_size=HIDDEN, num_heads=8, num_layers=1), 1, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(torch.randn(4, HIDDEN))
    assert out.dtype == torch.bfloat16


def _first_calls_per_group(rank, world):
    from loom.engine.parallel.state import ParallelState

    with CollectiveRecorder() as recorder:
        state = ParallelState.create(tp=2, dp=1, pp=2)
    every = (state.tp_group, state.dp_group, state.pp_group, state.embedding_group)
    groups = {id(g): g for g in every if g is not None}
    members = sum(1 for g in groups.values() if torch.distributed.get_world_size(g) > 1)
    return recorder.calls, members


def test_every_group_begins_with_a_collective_all_its_ranks_join():
    """The pipeline group's first call would otherwise be a batch_isend_irecv only some ranks join."""
    for calls, groups in run_ranks(_first_calls_per_group, 4):
        assert calls == [("allreduce_", "torch.float32", (1,))] * groups and groups == 3  # tp, pp, embedding

"""Activation memory of the pipeline executor, measured while training: a 1F1B stage never holds
more than P - rank micro-batches, the interleaved schedule what its warm-up implies."""

import pytest
from dist_utils import run_ranks
from training_runs import tiny_config

from loom.engine.pipeline.schedules import warmup_forwards
from loom.engine.train import Trainer


def _peak_live(rank, world, dataset, run_dir, pp, vp, microbatches):
    config = tiny_config(
        dataset,
        run_dir,
        parallel={"pp": pp, "vp": vp},
        model={"num_layers": 8},
        train={"steps": 2, "global_batch_size": microbatches, "micro_batch_size": 1, "seq_length": 32},
    )
    trainer = Trainer(config)
    trainer.train_step()
    peak = trainer.executor.peak_live
    trainer.close()
    return trainer.state.pp_rank, peak


@pytest.mark.parametrize("pp, vp, microbatches", [(4, 1, 8), (4, 2, 8), (2, 4, 6)])
def test_activations_held_per_stage(pp, vp, microbatches, markov_dataset, tmp_path):
    for rank, peak in run_ranks(_peak_live, pp, markov_dataset(50), str(tmp_path / "run"), pp, vp, microbatches):
        if vp == 1:
            assert peak == pp - rank
        else:
            assert peak == min(warmup_forwards(rank, pp, vp, microbatches) + 1, vp * microbatches)

"""ZeRO-1 against the plain distributed optimizer on the same config, and its memory, measured.

Both runs go through the real launcher; the per-step losses must agree within 1e-5 relative.
Memory: the bytes of master weights and optimizer state a rank holds, read off the optimizer.
"""

import pytest
from dist_utils import run_ranks
from training_runs import read_metrics, tiny_config

from loom.engine.train import Trainer
from loom.launch.local import launch_local

STEPS = 4  # the optimizer state is in play from step 2; four steps show any divergence


def losses(dataset, run_dir, nproc, zero1, optimizer="adamw", **parallel) -> list[float]:
    config = tiny_config(
        dataset,
        run_dir,
        parallel={**parallel, "grad_bucket_mb": 0.25},
        optim={"zero1": zero1, "name": optimizer},
        train={"steps": STEPS, "micro_batch_size": 1},
    )
    config.resolve_world(nproc)
    launch_local(config, nproc)
    return [row["loss"] for row in read_metrics(run_dir)]


@pytest.mark.parametrize(
    "nproc, optimizer, parallel",
    [
        (2, "adamw", {}),
        (4, "adamw", {"tp": 2}),
        (4, "lamb", {"pp": 2}),
        (8, "adamw", {"tp": 2, "pp": 2, "sequence_parallel": True}),
    ],
    ids=["dp2", "tp2-dp2", "pp2-dp2-lamb", "tp2-pp2-dp2"],
)
def test_zero1_matches_the_unsharded_optimizer(dataset, tmp_path, nproc, optimizer, parallel):
    plain = losses(dataset, tmp_path / "plain", nproc, False, optimizer, **parallel)
    sharded = losses(dataset, tmp_path / "zero1", nproc, True, optimizer, **parallel)
    assert len(plain) == STEPS and len(set(plain)) == STEPS, "the runs should be moving"
    for a, b in zip(plain, sharded, strict=True):
        assert abs(a - b) / a < 1e-5


def _state_bytes(rank, world, dataset, run_dir, zero1):
    config = tiny_config(
        dataset,
        run_dir,
        optim={"zero1": zero1},
        parallel={"grad_bucket_mb": 0.25},
        train={"steps": 1, "precision": "bf16"},
    )
    trainer = Trainer(config)
    trainer.train_step()  # optimizer state exists only after a step
    held = trainer.optimizer.state_bytes()
    params = sum(p.numel() for p in trainer.params)
    trainer.close()
    return held, params, trainer.grads.data.numel()


def test_optimizer_state_is_divided_by_dp(dataset, tmp_path):
    ((full, params, _),) = run_ranks(_state_bytes, 1, dataset, str(tmp_path / "r1"), False)
    assert full == 12 * params  # fp32 master + Adam m and v for bf16 parameters
    for dp in (2, 4):
        results = run_ranks(_state_bytes, dp, dataset, str(tmp_path / f"r{dp}"), True)
        for held, _, padded in results:
            # Each rank holds 1/DP of every (padded) bucket: at most one element of padding per bucket.
            assert abs(held - 12 * padded / dp) <= 12 * dp * 64
            assert held < full / dp * 1.01

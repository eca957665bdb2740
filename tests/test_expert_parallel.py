"""Expert parallelism (parallel.ep): each DP rank of an ep block holds 1/ep of every expert block's experts and
sends each token to the rank holding its expert. Against the same ranks without it (ep 1, where every rank holds
every expert): the same losses and gradient norms under ZeRO 0, 1 and 2, AdamW and LAMB; a checkpoint saved under
one resumes under the other. (Against one rank, with TP, PP, sequence parallelism and recompute:
test_layout_invariance's MoE row.)"""

import pytest
import torch
from dist_utils import run_ranks
from training_runs import tiny_config

EXPERTS = {"num_experts": 4, "moe_top_k": 2}
VARIANTS = [(1, 1, "adamw"), (2, 1, "adamw"), (2, 2, "adamw"), (1, 0, "lamb"), (2, 0, "lamb")]
"""(parallel.ep, optim.zero, optim.name) trained on the same four ranks."""
STEPS = 3


def _config(dataset, run_dir, ep, zero, optimizer, steps=STEPS):
    return tiny_config(
        dataset,
        run_dir,
        model=EXPERTS,
        parallel={"ep": ep, "grad_bucket_mb": 0.25},
        optim={"zero": zero, "name": optimizer},
        train={"steps": steps, "global_batch_size": 8, "micro_batch_size": 1, "seq_length": 32},
    )


def _runs(rank, world, dataset, run_dir):
    """Every variant from scratch; the ep 2 and ep 1 ZeRO-1 runs save at step 2, and each is resumed under the
    other's layout for its last step."""
    from loom.engine.parallel.param_info import param_info
    from loom.engine.train import Trainer

    result = {}
    for ep, zero, optimizer in VARIANTS:
        trainer = Trainer(_config(dataset, f"{run_dir}/ep{ep}-zero{zero}-{optimizer}", ep, zero, optimizer))
        held = {param_info(q).name: tuple(q.shape) for q in trainer.params if param_info(q).expert_range is not None}
        rows = []
        for step in range(STEPS):
            rows.append(trainer.train_step())
            if step == 1 and zero == 1:
                trainer.save()
        result[(ep, zero, optimizer)] = [(row["loss"], row["grad_norm"]) for row in rows], held
        trainer.close()
    for ep, other in ((2, 1), (1, 2)):  # each saved run's last step, resumed under the other's layout
        config = _config(dataset, f"{run_dir}/ep{other}-resumes-ep{ep}", other, 1, "adamw")
        config.checkpoint.load = f"{run_dir}/ep{ep}-zero1-adamw"
        resumed = Trainer(config)
        assert resumed.step == 2
        result[("resumed", ep)] = resumed.train_step()["loss"]
        resumed.close()
    return result


@pytest.fixture(scope="module")
def runs(markov_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("expert_parallel")
    return run_ranks(_runs, 4, markov_dataset(200), str(run_dir))[0], run_dir


def test_expert_parallel_training_equals_every_rank_holding_every_expert(runs):
    result, _ = runs
    reference = {optimizer: result[(1, zero, optimizer)][0] for _, zero, optimizer in VARIANTS if _ == 1}
    assert len({loss for loss, _ in reference["adamw"]}) == STEPS, "the runs should be moving"
    for (ep, zero, optimizer), (curve, held) in ((k, v) for k, v in result.items() if k[0] == 2):
        for (loss, norm), (want_loss, want_norm) in zip(curve, reference[optimizer], strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5), (ep, zero, optimizer)
            assert norm == pytest.approx(want_norm, rel=1e-5), (ep, zero, optimizer)
        # two of the four experts on each rank, each expert's FC1 (gate and up, 2 x 384) and FC2 whole
        assert held == {
            f"layers.{i}.mlp.experts.{fc}.weight": (2, 768, 128) if fc == "fc1" else (2, 128, 384)
            for i in range(4)
            for fc in ("fc1", "fc2")
        }


def test_a_checkpoint_saved_under_expert_parallelism_resumes_without_it_and_back(runs):
    """The last step resumed under the other layout gives the uninterrupted run's loss; the expert weights are saved
    as each rank's range of them (model/<name>/tp0/<start>-<end>) and read back whole."""
    from loom.engine.checkpoint.format import checkpoint_to_resume, read_metadata
    from loom.engine.checkpoint.load import PieceReader
    from loom.tools.ckpt import reshard

    result, run_dir = runs
    for ep in (1, 2):
        assert result[("resumed", ep)] == pytest.approx(result[(ep, 1, "adamw")][0][-1][0], rel=1e-6)
    readers = {}
    for ep in (1, 2):
        readers[ep] = PieceReader(*checkpoint_to_resume(run_dir / f"ep{ep}-zero1-adamw" / "checkpoints", None))
    name = "layers.0.mlp.experts.fc1.weight"
    assert sorted(k for k in readers[2].metadata.index if k.startswith(f"model/{name}/")) == [
        f"model/{name}/tp0/0-196608",
        f"model/{name}/tp0/196608-393216",
    ]
    torch.testing.assert_close(readers[2].model(name), readers[1].model(name), rtol=1e-4, atol=1e-6)
    # `loom ckpt reshard` reads the ranges too (and writes whole TP shards)
    resharded = reshard(readers[2].directory, run_dir / "resharded", tp=2, pp=1)
    back = PieceReader(resharded, read_metadata(resharded))
    assert back.metadata.layout.ep == 1 and readers[2].metadata.layout.ep == 2
    for state in ("master", "exp_avg"):
        assert torch.equal(back.optim(state, name), readers[2].optim(state, name))
    assert torch.equal(back.model(name), readers[2].model(name))

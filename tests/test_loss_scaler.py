"""fp16 dynamic loss scaling against megatron-core's DynamicGradScaler, step by step."""

import types

import numpy as np
import pytest
import torch

from loom.engine.optim.loss_scaler import LossScaler


@pytest.fixture
def megatron_scaler(monkeypatch):
    """megatron-core's DynamicGradScaler, its CUDA scale tensors kept on the CPU (the arithmetic is the same)."""
    grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler", reason="megatron-core is not installed")
    cpu_torch = types.SimpleNamespace(
        tensor=lambda data, dtype=None, device=None: torch.tensor(data, dtype=dtype),
        max=torch.max,
        float=torch.float,
    )
    monkeypatch.setattr(grad_scaler, "torch", cpu_torch)
    return grad_scaler.DynamicGradScaler


def test_eight_overflows_in_a_row_halve_like_megatron(megatron_scaler):
    ours = LossScaler(initial_scale=65536.0, growth_interval=1000, hysteresis=2)
    for _ in range(8):
        ours.update(found_inf=True)
    # The first halving needs `hysteresis` overflows; every further overflow halves again.
    assert ours.scale == 65536.0 / 2**7


@pytest.mark.parametrize("seed", range(6))
def test_random_overflow_sequences_give_megatrons_scale_at_every_step(megatron_scaler, seed):
    rng = np.random.default_rng(seed)
    hysteresis, interval = int(rng.integers(1, 4)), int(rng.integers(2, 6))
    ours = LossScaler(initial_scale=2.0**12, growth_interval=interval, hysteresis=hysteresis, min_scale=4.0)
    theirs = megatron_scaler(
        initial_scale=2.0**12,
        min_scale=4.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=interval,
        hysteresis=hysteresis,
    )
    # Runs of overflows and of clean steps, so both growth and repeated backoff (down to min_scale) happen;
    # 200 steps cannot grow the scale past float32 (megatron-core keeps it as a float32 tensor).
    for overflow in rng.random(200) < np.repeat(rng.random(20), 10):
        skipped = ours.update(found_inf=bool(overflow))
        theirs.update(bool(overflow))
        assert skipped == bool(overflow)
        assert ours.scale == theirs.scale.item()


def _fp16_gradients_of_a_dp2_step(rank, world, dataset, run_dir):
    """One fp16 step of a dp-2 run through the Trainer: the fp16 gradient its backward gives the final norm's weight
    on this rank, and autograd's gradient of scale x this rank's own token mean (Megatron-LM's per-rank loss),
    taken just before on the same micro-batch."""
    from training_runs import tiny_config

    from loom.engine.model.naming import FINAL_NORM_WEIGHT
    from loom.engine.train import Trainer

    train = {"precision": "fp16", "steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "seq_length": 32}
    config = tiny_config(dataset, run_dir, model={"num_layers": 1}, parallel={"dp": 2}, train=train)
    trainer = Trainer(config)
    model = trainer.chunks[0]
    weight = dict(model.named_parameters())[FINAL_NORM_WEIGHT]
    grads = {}
    next_step = trainer.train_batches.next_step

    def reference_first(device):
        microbatches = next_step(device)
        ((tokens, labels),) = microbatches
        with trainer._autocast():
            own_mean = model(tokens, labels).sum() / labels.numel()
        (grads["megatron"],) = torch.autograd.grad(own_mean * trainer.loss_scaler.scale, [weight])
        weight.register_hook(lambda grad: grads.setdefault("loom", grad.clone()))
        return microbatches

    trainer.train_batches.next_step = reference_first
    trainer.train_step()
    trainer.close()
    return grads


def test_an_fp16_scale_scales_each_rank_s_own_token_mean_as_in_megatron(dataset, tmp_path):
    """loom back-propagated scale x the rank's share of the global-batch mean: at dp x cp ranks its fp16 gradients
    were dp x cp times smaller than Megatron-LM's at the same scale (more underflow, the scale climbing higher)."""
    from dist_utils import run_ranks

    for grads in run_ranks(_fp16_gradients_of_a_dp2_step, 2, dataset, str(tmp_path)):
        assert grads["loom"].dtype == torch.float16 and grads["loom"].abs().max() > 0
        torch.testing.assert_close(grads["loom"], grads["megatron"], rtol=2e-3, atol=0)

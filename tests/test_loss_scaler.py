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

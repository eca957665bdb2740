"""Learning-rate schedule and batch-size ramp-up by hand and against megatron-core's (the `reference` extra), and
data-parallel gradient reduction against manual all-reduce."""

import math
import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from loom.engine.config import ModelConfig, OptimConfig
from loom.engine.config_io import load_config
from loom.engine.model.gpt import GPTModel
from loom.engine.optim.grad_buffer import GradBuffer
from loom.engine.optim.lr_schedule import learning_rate
from loom.engine.parallel.sharding import initialize_parameters


def test_warmup_then_cosine():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay="cosine")
    assert [learning_rate(s, optim, 104) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(4, optim, 104) == pytest.approx(1.0)
    assert learning_rate(54, optim, 104) == pytest.approx(0.55)  # half-way: (1 + 0.1) / 2
    assert learning_rate(104, optim, 104) == pytest.approx(0.1)
    assert learning_rate(500, optim, 104) == pytest.approx(0.1)


def test_linear_and_constant_decay():
    linear = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay="linear", decay_steps=10)
    assert [round(learning_rate(s, linear, 99), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    constant = OptimConfig(lr=0.3, min_lr=0.0, decay="constant")
    assert learning_rate(77, constant, 100) == 0.3


def _megatron_learning_rates(
    decay: str, lr: float, min_lr: float, warmup: int, decay_steps: int, steps: int = 0, increments: list[int] = ()
) -> list[float]:
    """megatron-core's OptimizerParamScheduler: the rate after 0, 1, ..., steps calls of step(1) (or of
    step(increment) for each of `increments`: global batches, under which it counts samples), from init_lr 0."""
    scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler", reason="needs loom[reference]")
    optimizer = types.SimpleNamespace(param_groups=[{}])
    schedule = scheduler.OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=decay,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    rates = [optimizer.param_groups[0]["lr"]]
    for increment in list(increments) or [1] * steps:
        schedule.step(increment)
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_learning_rate_equals_megatron_cores_scheduler(decay, warmup):
    """Equal to megatron-core's at every step but one offset, by design: Megatron's first iteration runs at
    init_lr (0), so during warmup loom's step s takes Megatron's rate after s + 1 steps; after warmup, after s."""
    decay_steps, steps = 50, 70
    optim = OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=warmup, decay=decay)
    theirs = _megatron_learning_rates(decay, 3e-4, 3e-5, warmup, decay_steps, steps)
    for step in range(steps):
        megatron_step = step + 1 if step < warmup else step
        assert learning_rate(step, optim, decay_steps) == pytest.approx(theirs[megatron_step], rel=1e-12, abs=1e-15)
    if warmup:
        assert theirs[0] == 0.0 and learning_rate(0, optim, decay_steps) == 3e-4 / warmup


@pytest.mark.parametrize(
    "ramp, global_batch, micro_batch, dp", [((8, 8, 96), 32, 2, 2), ((4, 4, 1000), 64, 1, 4), ((16, 16, 50), 64, 4, 1)]
)
def test_batch_size_ramp_up_equals_megatron_cores_calculator(ramp, global_batch, micro_batch, dp):
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator", reason="needs loom[reference]")
    train = {"global_batch_size": global_batch, "micro_batch_size": micro_batch, "rampup_batch_size": list(ramp)}
    config = load_config("tiny", {"train": train})
    config.resolve_world(dp)
    theirs = calculators.RampupBatchsizeNumMicroBatchesCalculator(global_batch, micro_batch, dp, False, 0, *ramp)
    for consumed in [*range(2 * ramp[2] + 3), 10**6]:
        theirs.update(consumed, consistency_check=True)
        if consumed == ramp[2]:
            # At exactly the ramp's samples Megatron tests `consumed > ramp` and steps by int(consumed / (ramp /
            # increments)), which float rounding can leave one increment short (1000 / (1000 / 15) = 14.99...:
            # 60, not 64); loom takes the full batch from the ramp's end on.
            assert config.train.global_batch_size_at(consumed) == global_batch
            continue
        assert config.train.global_batch_size_at(consumed) == theirs.get_current_global_batch_size(), consumed


def test_learning_rate_under_a_batch_ramp_up_counts_samples_as_megatron_cores_scheduler():
    """Under a ramp Megatron's scheduler is stepped by each iteration's global batch, so warmup and decay count
    samples; loom's counted steps, the ramp's small ones too, and ended them early. Now the rates are Megatron's
    with the offset of test_learning_rate_equals_megatron_cores_scheduler: a step wholly inside warmup takes
    Megatron's rate once its samples are counted, a later one Megatron's rate before them; the one step that
    straddles the warmup's end takes the peak."""
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator", reason="needs loom[reference]")
    train = {"steps": 14, "global_batch_size": 16, "micro_batch_size": 1, "rampup_batch_size": [4, 4, 40]}
    config = load_config("tiny", {"train": train})
    config.resolve_world(1)
    batches = calculators.RampupBatchsizeNumMicroBatchesCalculator(16, 1, 1, False, 0, 4, 4, 40)
    consumed, sizes = 0, []
    for _ in range(14):
        batches.update(consumed, consistency_check=True)
        sizes.append(batches.get_current_global_batch_size())
        consumed += sizes[-1]
    assert sizes == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16, 16, 16, 16, 16]
    assert config.train.schedule_length() == consumed / 16 == 9.75  # the decay ends with the run
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=3, decay="cosine")  # warmup: 48 samples
    theirs = _megatron_learning_rates("cosine", 1.0, 0.1, 48, consumed, increments=sizes)
    position, shares = 0.0, config.train.ramp_shares()
    assert shares == [size / 16 for size in sizes[:7]]
    samples = 0
    for step, size in enumerate(sizes):
        ours = learning_rate(position, optim, config.train.schedule_length(), size / 16)
        if samples + size <= 48:
            assert ours == pytest.approx(theirs[step + 1], rel=1e-12), step
        elif samples >= 48:
            assert ours == pytest.approx(theirs[step], rel=1e-12), step
        else:
            assert (samples, ours) == (44, 1.0)  # 44 -> 60 straddles 48
        position, samples = position + size / 16, samples + size
    # counting steps, the fourth (16 samples in) took the peak; counting samples, a third of it
    assert learning_rate(3, optim, 14) == 1.0 and learning_rate(0.75, optim, 9.75, 0.25) == 1 / 3


def _bucketed_reduction(rank, world, overlap):
    config = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=97, make_vocab_divisible_by=8)
    model = GPTModel(config, None)
    reference = GPTModel(config, None)
    for m in (model, reference):
        initialize_parameters(m, seed=3, tp_rank=0, tp_size=1)
    generator = torch.Generator().manual_seed(100 + rank)
    microbatches = [torch.randint(0, 97, (2, 9), generator=generator) for _ in range(3)]

    buffer = GradBuffer(list(model.parameters()), dist.group.WORLD, world, rank, bucket_bytes=4096, overlap=overlap)
    buffer.start_step()
    launched_before_finish = 0
    for i, batch in enumerate(microbatches):
        buffer.last_microbatch = i == len(microbatches) - 1
        model(batch[:, :-1], batch[:, 1:]).sum().backward()
        reference(batch[:, :-1], batch[:, 1:]).sum().backward()
    launched_before_finish = sum(b.handle is not None for b in buffer.buckets)
    buffer.finish()
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        expected = q.grad.clone()
        dist.all_reduce(expected)
        worst = max(worst, (p.grad - expected).abs().max().item())
    return worst, launched_before_finish, len(buffer.buckets)


@pytest.mark.parametrize("overlap", [True, False])
def test_bucketed_dp_reduction_equals_manual_all_reduce(overlap):
    for worst, launched, buckets in run_ranks(_bucketed_reduction, 2, overlap):
        assert worst < 1e-5
        assert buckets > 3
        # With overlap every bucket's all-reduce starts inside backward; without, none does.
        assert launched == (buckets if overlap else 0)


def test_cosine_is_monotonic_after_warmup():
    optim = OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=10)
    values = [learning_rate(s, optim, 200) for s in range(10, 200)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert math.isclose(values[0], 3e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_step_starts_from_no_gradient(dtype):
    """The buffer is not zeroed between steps: a parameter's first gradient of a step is copied over the last
    step's. One that gets none in a step must read zero, the others exactly this step's sum, by hand."""
    used, unused = torch.nn.Parameter(torch.ones(3, dtype=dtype)), torch.nn.Parameter(torch.ones(5, dtype=dtype))
    buffer = GradBuffer([used, unused], None, 1, 0, bucket_bytes=16, dtype=torch.float32)
    buffer.start_step()
    for scale in (1.0, 2.0):  # two micro-batches: 3 + 3 * 2 of each
        ((used * 3 * scale).sum() + (unused * 3 * scale).sum()).backward()
    buffer.finish()
    assert torch.equal(used.main_grad, torch.full((3,), 9.0)) and torch.equal(unused.main_grad, torch.full((5,), 9.0))
    buffer.start_step()
    (used * 4).sum().backward()
    buffer.finish()
    assert torch.equal(used.main_grad, torch.full((3,), 4.0)) and torch.equal(unused.main_grad, torch.zeros(5))
    assert torch.count_nonzero(buffer.data) == 3  # nothing else written: padding stays zero


def test_a_resume_names_a_changed_learning_rate_schedule():
    """Extending a finished run (train.steps 10 -> 20) stretched its cosine over 20 steps without a word: the lr
    jumped from the saved schedule's end back up to near its peak."""
    from loom.engine.checkpoint.saved_settings import changed_schedule
    from loom.engine.config import LoomConfig
    from loom.engine.config_io import config_to_dict

    def config(steps: int, **optim) -> LoomConfig:
        c = LoomConfig()
        c.train.steps = steps
        c.optim = OptimConfig(**{"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, **optim})
        return c

    saved = config_to_dict(config(10))
    warning = changed_schedule(10, saved, config(20))
    stretched, ended = learning_rate(10, config(20).optim, 20), learning_rate(10, config(10).optim, 10)
    assert ended == 1e-4 and stretched > 6e-4
    assert warning == (
        "the learning-rate schedule is not the one this run trained with (the decay's length: 10 -> 20 steps "
        f"(optim.decay_steps, else train.steps)): step 11 takes lr {stretched:.3g} where the saved schedule gives "
        "0.0001; pass --optim.decay_steps 10 to keep it, unless the change is intended"
    )
    assert changed_schedule(10, saved, config(20, decay_steps=10)) is None  # what the warning advises
    assert changed_schedule(5, config_to_dict(config(10, decay_steps=8)), config(20, decay_steps=8)) is None
    assert changed_schedule(4, config_to_dict(config(10, decay="constant")), config(20, decay="constant")) is None
    # mid-run, a new peak: named with the saved value
    warning = changed_schedule(4, saved, config(10, lr=2e-3))
    assert warning.startswith("the learning-rate schedule is not the one this run trained with (optim.lr: 0.001 -> ")
    assert "step 5 takes lr" in warning and warning.endswith(
        "pass --optim.lr 0.001 to keep it, unless the change is intended"
    )
    # decay_steps set where it was not, with more steps: the saved length is what keeps the schedule (not 'unset')
    assert changed_schedule(6, config_to_dict(config(6)), config(12, decay_steps=10)).endswith(
        "pass --optim.decay_steps 6 to keep it, unless the change is intended"
    )
    # a constant schedule has no decay to lengthen: only the new peak is named
    warning = changed_schedule(4, config_to_dict(config(8, decay="constant")), config(9, decay="constant", lr=2e-3))
    assert "length" not in warning and warning.endswith(
        "pass --optim.lr 0.001 to keep it, unless the change is intended"
    )
    # two skipped updates hold the schedule two steps behind: step 11 takes the lr of position 8, still decaying
    warning = changed_schedule(10, saved, config(20), position=8)
    assert f"step 11 takes lr {learning_rate(8, config(20).optim, 20):.3g} where the saved schedule gives " in warning
    # and three put step 13 at position 9, inside the decay, where a new peak differs (without them: past its end)
    assert changed_schedule(12, config_to_dict(config(12, decay_steps=10)), config(20, decay_steps=10, lr=2e-3), 9)
    # past the decay's end both give min_lr: nothing this run trains differs
    assert changed_schedule(12, config_to_dict(config(12, decay_steps=10)), config(20, decay_steps=10, lr=2e-3)) is None


def test_a_resume_under_a_batch_ramp_up_names_the_schedule_in_samples():
    """Under a ramp the schedule's length is fractional (the run's samples over the full batch): an extended run
    is told the saved length, which optim.decay_steps can only round; a resume inside the ramp probes the steps at
    the positions their batches give them."""
    from loom.engine.checkpoint.saved_settings import changed_schedule
    from loom.engine.config import LoomConfig
    from loom.engine.config_io import config_to_dict

    def config(steps: int, **optim) -> LoomConfig:
        c = LoomConfig()
        c.train.steps, c.train.global_batch_size, c.train.rampup_batch_size = steps, 16, [4, 4, 40]
        c.optim = OptimConfig(**{"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, **optim})
        return c

    saved = config_to_dict(config(14))  # 156 samples: 9.75 full batches
    warning = changed_schedule(14, saved, config(20), position=9.75, consumed_samples=156)
    stretched = learning_rate(9.75, config(20).optim, 15.75)
    assert (
        "the decay's length: 9.75 -> 15.75 steps (optim.decay_steps, else train.steps)): step 15 takes lr " in warning
    )
    assert (
        f"lr {stretched:.3g} where the saved schedule gives 0.0001; pass --optim.decay_steps 10 (the saved 9.75 "
        in warning
    )
    # step 4 (0-based 3), 12 samples in: position 0.75 plus its quarter batch is half of warmup's 2: half the peak
    warning = changed_schedule(3, saved, config(14, lr=2e-3), position=0.75, consumed_samples=12)
    assert "step 4 takes lr 0.001 where the saved schedule gives 0.0005;" in warning

"""ZeRO 1 and 2 and CPU offload against the plain distributed optimizer on the same config, resumes
from one to another under other layouts, and the memory each holds, measured.

The per-step losses must agree within 1e-5 relative. Memory: the bytes of parameters, gradients,
master weights and optimizer state a rank holds, read off the tensors, against the ZeRO paper's
formulas (bf16 parameters, fp32 gradients, fp32 master weights and Adam moments).
"""

import pytest
from dist_utils import run_ranks
from training_runs import read_metrics, tiny_config

from loom.engine.train import Trainer
from loom.launch.local import launch_local
from loom.tools.plan_bytes import Layout, zero3_gathered_elements

STEPS = 4  # the optimizer state is in play from step 2; four steps show any divergence


def losses(dataset, run_dir, nproc, zero, optimizer="adamw", **parallel) -> list[float]:
    config = tiny_config(
        dataset,
        run_dir,
        parallel={**parallel, "grad_bucket_mb": 0.25},
        optim={"zero": zero, "name": optimizer},
        train={"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 1, "seq_length": 64},
    )
    config.resolve_world(nproc)
    launch_local(config, nproc)
    return [row["loss"] for row in read_metrics(run_dir)]


@pytest.mark.parametrize(
    "nproc, optimizer, parallel",
    [(4, "lamb", {"pp": 2}), (8, "adamw", {"tp": 2, "pp": 2, "sequence_parallel": True})],
    ids=["pp2-dp2-lamb", "tp2-pp2-dp2"],
)
def test_zero1_matches_the_unsharded_optimizer(dataset, tmp_path, nproc, optimizer, parallel):
    """Through the real launcher; test_zero_stages_and_offload_agree covers more layouts in-process."""
    plain = losses(dataset, tmp_path / "plain", nproc, 0, optimizer, **parallel)
    sharded = losses(dataset, tmp_path / "zero1", nproc, 1, optimizer, **parallel)
    assert len(plain) == STEPS and len(set(plain)) == STEPS, "the runs should be moving"
    for a, b in zip(plain, sharded, strict=True):
        assert abs(a - b) / a < 1e-5


VARIANTS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu")]
"""(optim.zero, optim.offload) pairs compared with each other (ZeRO-3 with offload: the resume test below)."""


def _held_bytes(trainer: Trainer) -> dict:
    """Bytes a rank holds by kind, read off the tensors (after a step: optimizer state exists only then)."""
    sharded = trainer.optimizer.sharded_params
    return {
        "params": sharded.stored_bytes() if sharded else sum(p.numel() * p.element_size() for p in trainer.params),
        "grads": trainer.grads.stored_bytes(),
        "state": trainer.optimizer.state_bytes(),
        "device_state": trainer.optimizer.device_state_bytes(),
        "buffer": trainer.grads.total,
        "count": sum(p.numel() for p in trainer.params),
    }


def _train_variants(rank, world, dataset, run_dir, parallel, precision, optimizer, steps, model=None):
    """Every variant trained from scratch on these ranks, one after another: {variant: (losses, bytes held)}."""
    result = {}
    for zero, offload in VARIANTS:
        config = tiny_config(
            dataset,
            f"{run_dir}/zero{zero}-{offload}",
            parallel={**parallel, "grad_bucket_mb": 0.25},
            optim={"zero": zero, "offload": offload, "name": optimizer},
            model=model or {},
            # 8 samples in micro-batches of 2: gradients accumulate over 4 / dp micro-batches. Sequences of 32
            # tokens: the variants are compared with each other, and fp16 matmuls are slow on a CPU.
            train={
                "steps": steps,
                "global_batch_size": 8,
                "micro_batch_size": 2,
                "precision": precision,
                "seq_length": 32,
            },
        )
        trainer = Trainer(config)
        rows = [trainer.train_step() for _ in range(steps)]
        result[(zero, offload)] = [(row["loss"], row["grad_norm"]) for row in rows], _held_bytes(trainer)
        trainer.close()
    return result


def _assert_bytes_follow_the_formulas(per_variant: dict, dp: int) -> None:
    """bf16 AdamW: ZeRO 0 18 B/param, ZeRO 1 6 + 12/d, ZeRO 2 2 + 16/d, ZeRO 3 18/d; offloaded, master weights and
    moments (12 B, or 12/d sharded) leave the device. Exact, up to the padding of buckets to multiples of d."""
    for (zero, offload), (_, held) in per_variant.items():
        padded, params = held["buffer"], held["count"]
        assert abs(padded - params) < dp * 64, "padding is at most dp - 1 elements per bucket"
        assert held["params"] == (2 * padded // dp if zero == 3 else 2 * params)
        assert held["grads"] == (4 * padded // dp if zero >= 2 else 4 * padded)
        state = 12 * padded // dp if zero else 12 * params
        assert held["state"] == state
        assert held["device_state"] == (0 if offload == "cpu" else state)


@pytest.mark.parametrize(
    "nproc, parallel, precision, optimizer, model",
    [
        (2, {}, "bf16", "adamw", {}),
        # Qwen3's and Phi's pieces: query/key norms (their weights shared over TP, sharded by ZeRO), half of each
        # head rotated
        (4, {"tp": 2, "sequence_parallel": True}, "fp32", "adamw", {"qk_norm": True, "rotary_percent": 0.5}),
        (4, {"pp": 2, "vp": 2}, "fp16", "lamb", {}),
    ],
    ids=["dp2-bf16", "tp2-sp-dp2-fp32-qk_norm", "pp2-vp2-dp2-fp16-lamb"],
)
def test_zero_stages_and_offload_agree(dataset, tmp_path, nproc, parallel, precision, optimizer, model):
    ranks = run_ranks(_train_variants, nproc, dataset, str(tmp_path), parallel, precision, optimizer, 3, model)
    per_variant = ranks[-1]
    reference = per_variant[(0, "none")][0]
    assert len(set(reference)) == len(reference), "the runs should be moving"
    # the loss and the clipped gradient norm: the norm is summed over gradient shards under ZeRO 2 and 3
    for variant, (rows, _) in per_variant.items():
        for step, (a, b) in enumerate(zip(reference, rows, strict=True)):
            assert a == pytest.approx(b, rel=1e-5), (variant, step, "(loss, grad_norm)")
    if not parallel:
        for rank_variants in ranks:
            _assert_bytes_follow_the_formulas(rank_variants, nproc)


# At dp 4 the bytes each ZeRO stage allocates are checked against the planner's formulas, layout by layout, in
# test_plan_bytes.py::test_weights_gradients_and_optimizer_state_equal_what_loom_allocates[4].


def _train_save_resume(rank, world, dataset, run_dir, first, second):
    """(losses of steps 3-4 resumed under `second` from a step-2 checkpoint of `first`, the same steps of
    an uninterrupted `second` run); each is (parallel, zero, offload)."""

    def trainer(name, setting, **checkpoint):
        parallel, zero, offload = setting
        config = tiny_config(
            dataset,
            f"{run_dir}/{name}",
            parallel={**parallel, "grad_bucket_mb": 0.25},
            optim={"zero": zero, "offload": offload},
            train={"steps": 4},
            checkpoint=checkpoint,
        )
        return Trainer(config)

    saving = trainer("saved", first)
    for _ in range(2):
        saving.train_step()
    saved = saving.save()
    saving.close()
    resumed = trainer("resumed", second, load=str(saved))
    after_resume = [resumed.train_step()["loss"] for _ in range(2)]
    resumed.close()
    whole = trainer("whole", second)
    uninterrupted = [whole.train_step()["loss"] for _ in range(4)][2:]
    whole.close()
    return after_resume, uninterrupted


@pytest.mark.parametrize(
    "first, second",
    [
        (({"tp": 2}, 2, "cpu"), ({"pp": 2}, 0, "none")),
        (({"pp": 2, "vp": 2}, 0, "none"), ({"tp": 2}, 2, "cpu")),
        (({"tp": 2, "sequence_parallel": True}, 3, "none"), ({"pp": 2}, 1, "none")),
        (({"pp": 2}, 2, "none"), ({"tp": 2}, 3, "cpu")),
    ],
    ids=[
        "zero2-offload-tp2-to-zero0-pp2",
        "zero0-pp2vp2-to-zero2-offload-tp2",
        "zero3-tp2sp-to-zero1-pp2",
        "zero2-pp2-to-zero3-offload-tp2",
    ],
)
def test_resume_across_zero_stages_offload_and_layouts(dataset, tmp_path, first, second):
    after_resume, uninterrupted = run_ranks(_train_save_resume, 4, dataset, str(tmp_path), first, second)[-1]
    for a, b in zip(after_resume, uninterrupted, strict=True):
        assert abs(a - b) / b < 1e-5


def _grad_dtype_runs(rank, world, dataset, run_dir):
    """Losses of 4 bf16 steps: one rank with fp32 and with bf16 gradients; bf16 gradients at dp2 (ZeRO 0, 1, 2),
    tp2 with SP and pp2 (each on both ranks); and a bf16-gradient run resumed at step 2 from an fp32-gradient
    checkpoint, with the same steps of an uninterrupted one."""

    def losses(name, parallel, optim, steps=4, save=False, **checkpoint):
        config = tiny_config(
            dataset,
            f"{run_dir}/{name}",
            parallel={**parallel, "grad_bucket_mb": 0.25},
            optim=optim,
            train={"steps": 4, "global_batch_size": 8, "micro_batch_size": 2, "precision": "bf16", "seq_length": 32},
            checkpoint=checkpoint,
        )
        trainer = Trainer(config)
        out = [trainer.train_step()["loss"] for _ in range(steps)]
        saved = trainer.save() if save else None
        trainer.close()
        return out, saved

    bf16 = {"grad_dtype": "bf16"}
    result = {}
    for name, parallel, optim in (
        ("dp2-zero0", {}, {"zero": 0, **bf16}),
        ("dp2-zero1", {}, {"zero": 1, **bf16}),
        ("dp2-zero2", {}, {"zero": 2, **bf16}),
        ("tp2-sp", {"tp": 2, "sequence_parallel": True}, bf16),
        ("pp2", {"pp": 2}, bf16),
    ):
        result[name] = losses(name, parallel, optim)[0]
    _, saved = losses("fp32-grads", {}, {"zero": 1}, steps=2, save=True)
    result["resumed"] = losses("resumed", {}, {"zero": 1, **bf16}, steps=2, load=str(saved))[0]
    return result


def test_bf16_gradients_follow_fp32_gradients_under_every_layout_and_resume_from_them(dataset, tmp_path):
    """optim.grad_dtype = bf16 (Megatron's --grad-reduce-in-bf16): micro-batches accumulate and DP reduces in bf16,
    2 bytes per parameter. The losses stay within bf16's rounding of the fp32-gradient run, the same under DP with
    each ZeRO stage, TP with SP and PP, and a resume switches gradient dtype freely (gradients are not checkpointed).
    Measured: bf16 gradients move the losses by at most 2.5e-5 (relative); dropping the bf16 DP reduction moves
    them by 1.5e-4 to 8e-4, so 1e-4 tells the two apart."""
    ranks = run_ranks(_grad_dtype_runs, 2, dataset, str(tmp_path))
    one_rank = {g: run_ranks(_one_rank_losses, 1, dataset, str(tmp_path / g), g)[0] for g in ("fp32", "bf16")}
    assert one_rank["bf16"] != one_rank["fp32"], "bf16 gradients should change the arithmetic"
    for results in ranks:
        for name, got in {"one rank": one_rank["bf16"], **{k: v for k, v in results.items() if k != "resumed"}}.items():
            for a, b in zip(one_rank["fp32"], got, strict=True):
                assert abs(a - b) / a < 1e-4, name
        for a, b in zip(one_rank["fp32"][2:], results["resumed"], strict=True):
            assert abs(a - b) / a < 1e-4, "resumed with bf16 gradients from an fp32-gradient checkpoint"


def _one_rank_losses(rank, world, dataset, run_dir, grad_dtype):
    config = tiny_config(
        dataset,
        run_dir,
        parallel={"grad_bucket_mb": 0.25},
        optim={"grad_dtype": grad_dtype},
        train={"steps": 4, "global_batch_size": 8, "micro_batch_size": 2, "precision": "bf16", "seq_length": 32},
    )
    trainer = Trainer(config)
    losses = [trainer.train_step()["loss"] for _ in range(4)]
    trainer.close()
    return losses


def _zero3_against_zero1(rank, world, dataset, run_dir):
    """{layout: (ZeRO-1 (loss, grad_norm)s, ZeRO-3's, units gathered after the last step)} on 4 ranks, fp32."""
    layouts = {"dp4": ({}, {}), "pp2-dp2-full-recompute": ({"pp": 2}, {"recompute": "full"})}
    out = {}
    for name, (parallel, model) in layouts.items():
        losses = {}
        for zero in (1, 3):
            config = tiny_config(
                dataset,
                f"{run_dir}/{name}-zero{zero}",
                parallel={**parallel, "grad_bucket_mb": 0.25},
                model=model,
                optim={"zero": zero},
                train={"steps": 3, "global_batch_size": 8, "micro_batch_size": 1, "seq_length": 32},  # 8 / dp per step
            )
            trainer = Trainer(config)
            sharded = trainer.optimizer.sharded_params
            peak = _track_gathered_bytes(sharded) if sharded is not None else None
            losses[zero] = [(row["loss"], row["grad_norm"]) for row in (trainer.train_step() for _ in range(3))]
            if sharded is not None:
                gathered = [u for u, buckets in sharded.units.items() if any(sharded._gathered(b) for b in buckets)]
                p = config.parallel
                layout = Layout(p.tp, p.pp, p.vp, p.dp, 1, "none", 3, "none", p.sequence_parallel)
                planned = 4 * zero3_gathered_elements(config.model, layout, trainer.state.pp_rank, 2**16)
            trainer.close()
        out[name] = losses[1], losses[3], gathered, peak[0], planned
    return out


def _track_gathered_bytes(sharded) -> list[int]:
    """[most bytes of weights held gathered at once], updated as the run gathers and frees buckets."""
    now, peak = [0], [0]
    gather, free = sharded._gather_bucket, sharded._free_bucket

    def gathering(bucket, wait):
        if not sharded._gathered(bucket):
            now[0] += sharded.full[id(bucket)].numel() * sharded.full[id(bucket)].element_size()
            peak[0] = max(peak[0], now[0])
        gather(bucket, wait)

    def freeing(bucket):
        if sharded._gathered(bucket):
            now[0] -= sharded.full[id(bucket)].numel() * sharded.full[id(bucket)].element_size()
        free(bucket)

    sharded._gather_bucket, sharded._free_bucket = gathering, freeing
    return peak


def test_zero3_gives_the_zero1_losses_on_dp4_and_pipelined_with_full_recompute(dataset, tmp_path):
    """The weights are gathered around each use and freed after (none is left gathered after a step; at most
    what the planner counts at once: two blocks and the weights outside them), and the losses are ZeRO-1's to
    1e-5 (fp32, gradients accumulated over micro-batches)."""
    for rank in run_ranks(_zero3_against_zero1, 4, dataset, str(tmp_path)):
        for name, (zero1, zero3, gathered, peak, planned) in rank.items():
            assert len(set(zero1)) == len(zero1), "the runs should be moving"
            for a, b in zip(zero1, zero3, strict=True):  # (loss, grad_norm): ZeRO-3's norm sums gradient shards
                assert a == pytest.approx(b, rel=1e-5), name
            assert gathered == [], name
            assert peak == planned, name


def test_offloaded_masters_ask_for_pinned_blocks_at_their_own_size(monkeypatch):
    """torch's pinned allocator rounds each block up to a power of two: a 1.1 GB offloaded master took 2 GB of host
    memory, where the planner counts 1.1. On a torch whose allocator takes `pinned_max_round_threshold_mb`, loom
    sets it (once, keeping the other settings and a threshold the user set); on one without it (2.11), it says so.
    Whether the pinned blocks then come at their size needs a GPU (docs/architecture.md)."""
    import torch

    from loom.engine import cuda_env

    calls = []
    settings = {"value": "expandable_segments:True"}
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings["value"], raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    assert cuda_env.exact_size_pinned_blocks()
    assert calls == ["expandable_segments:True,pinned_max_round_threshold_mb:1"]
    settings["value"] = "pinned_max_round_threshold_mb:64"  # the user's own threshold stays
    assert cuda_env.exact_size_pinned_blocks() and len(calls) == 1

    def refuses(text):
        raise ValueError("Unrecognized key 'pinned_max_round_threshold_mb' in Accelerator allocator config.")

    settings["value"] = ""
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuses)
    assert not cuda_env.exact_size_pinned_blocks()
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")  # torch 2.11 has no getter
    assert not cuda_env.exact_size_pinned_blocks()


def test_this_torch_takes_the_pinned_threshold_loom_sets():
    """The setting as loom composes it parses in the torch CI runs (2.13) after what was set before it. This torch
    takes unknown keys without a word but parses the values of those it knows: a bad value of loom's key is refused,
    so the key is one this torch knows."""
    import torch

    from loom.engine.cuda_env import PINNED_ROUND_THRESHOLD, exact_size_pinned_blocks

    get_settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get_settings is None:
        pytest.skip(f"torch {torch.__version__}'s allocator settings cannot be read")
    before = get_settings()
    try:
        with pytest.raises(ValueError):
            torch._C._accelerator_setAllocatorSettings(PINNED_ROUND_THRESHOLD.replace(":1", ":x"))
        torch._C._accelerator_setAllocatorSettings("pinned_max_cached_size_mb:64")
        assert exact_size_pinned_blocks()
        assert get_settings() == f"pinned_max_cached_size_mb:64,{PINNED_ROUND_THRESHOLD}"
    finally:
        torch._C._accelerator_setAllocatorSettings(before)

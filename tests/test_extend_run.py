"""User story: a run is extended. A shorter run is the prefix of a longer one with the same LR schedule,
and a finished run resumed with more steps continues exactly as if it had been asked for them at once."""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from training_runs import read_metrics, tiny_config

from loom.launch.local import launch_local

SMALL_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128}


def losses(dataset: str, run_dir: Path, steps: int, interval: int = 0) -> dict[int, float]:
    config = tiny_config(
        dataset,
        run_dir,
        model=SMALL_MODEL,
        # The schedule is fixed by decay_steps, not by train.steps, so runs of any length share it.
        optim={"decay_steps": 6, "warmup_steps": 1},
        checkpoint={"interval": interval},
        # The preset's eval_interval: each run also evaluates at its last step, which must not disturb the resume.
        train={"steps": steps, "eval_interval": 25},
    )
    config.resolve_world(1)
    launch_local(config, 1)
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def test_a_shorter_run_is_the_prefix_of_a_longer_one_and_resuming_with_more_steps_continues_it(dataset, tmp_path):
    straight = losses(dataset, tmp_path / "six", steps=6)
    short = losses(dataset, tmp_path / "extended", steps=3, interval=3)
    assert sorted(short) == [1, 2, 3]
    for step, loss in short.items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step
    extended = losses(dataset, tmp_path / "extended", steps=6, interval=3)  # resumes from its step-3 checkpoint
    assert sorted(extended) == [1, 2, 3, 4, 5, 6]
    for step, loss in extended.items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step
    # Asked for fewer steps than it has, the run trains nothing and its config.toml still says what it trained
    # (it was rewritten with steps = 3 beside a step-6 checkpoint)
    recorded = (tmp_path / "extended" / "config.toml").read_text()
    assert losses(dataset, tmp_path / "extended", steps=3, interval=3) == extended
    assert (tmp_path / "extended" / "config.toml").read_text() == recorded


def test_tokens_keep_counting_when_a_resume_changes_the_sequence_length(dataset, tmp_path, capfd):
    """`tokens` was consumed_samples x the current seq_length: resumed at half the length it went backwards
    (8192 at step 4, 5120 at step 5) in metrics.jsonl and in the next checkpoint's metadata. The resume says
    that the data order changed (it changed silently)."""
    from loom.engine.checkpoint.format import read_metadata

    def run(steps: int, seq_length: int) -> None:
        config = tiny_config(
            dataset,
            tmp_path,
            model=SMALL_MODEL,
            checkpoint={"interval": 2, "save_at_end": True},
            train={"steps": steps, "seq_length": seq_length},
        )
        config.resolve_world(1)
        launch_local(config, 1)

    run(2, 128)
    capfd.readouterr()
    run(3, 64)
    said = capfd.readouterr().out
    assert (
        "warning: from step 2 on this run reads its data in another order than it did (train.seq_length: 128 -> 64)"
        in said
    )
    rows = {row["step"]: row for row in read_metrics(tmp_path) if "loss" in row}
    batch = rows[3]["global_batch_size"]
    assert rows[2]["tokens"] == 2 * batch * 128 and rows[3]["tokens"] == 2 * batch * 128 + batch * 64
    assert read_metadata(tmp_path / "checkpoints" / "iter_0000003").tokens == rows[3]["tokens"]


def test_a_resume_at_a_smaller_global_batch_reads_on_where_the_larger_one_stopped(dataset, tmp_path):
    """The training dataset was sized train.steps x today's global batch, which a checkpoint trained with larger
    batches had already read past: `IndexError: sample 64 outside a dataset of 24` from a rank, mid-run. It is
    sized from the checkpoint's consumed samples on."""
    from loom.engine.checkpoint.format import read_metadata

    def run(run_dir: Path, steps: int, batch: int, **checkpoint) -> dict[int, dict]:
        config = tiny_config(
            dataset,
            run_dir,
            model=SMALL_MODEL,
            checkpoint={"interval": 2, **checkpoint},
            train={"steps": steps, "global_batch_size": batch, "micro_batch_size": 2},
        )
        config.resolve_world(1)
        launch_local(config, 1)
        return {row["step"]: row for row in read_metrics(run_dir) if "loss" in row}

    run(tmp_path / "large", 2, 16)
    checkpoint = tmp_path / "large" / "checkpoints" / "iter_0000002"
    resumed = run(tmp_path / "small", 6, 4, load=str(checkpoint))  # 32 read; 6 x 4 = 24 was the dataset's size
    assert sorted(resumed) == [3, 4, 5, 6]
    assert read_metadata(tmp_path / "small" / "checkpoints" / "iter_0000006").consumed_samples == 32 + 4 * 4


def test_a_resume_compares_the_data_it_reads_not_how_its_path_is_spelled(tmp_path, monkeypatch):
    """data.paths were compared as strings: a run resumed from another working directory with `../d` was warned
    that its data order changed (the same files), and one resumed where `d` names other data was not."""
    from loom.engine.checkpoint.saved_settings import changed_data_order
    from loom.engine.config_io import config_to_dict
    from loom.engine.data.indexed import dataset_record
    from loom.tools.synthetic_data import write_markov_dataset

    first, second = tmp_path / "first", tmp_path / "second"
    for folder, documents in ((first, 40), (second, 60)):
        folder.mkdir()
        write_markov_dataset(folder / "d", vocab_size=512, num_documents=documents)
    monkeypatch.chdir(first)
    saved = config_to_dict(tiny_config("d", tmp_path / "run"))
    recorded = [dataset_record("d")]
    assert changed_data_order(saved, tiny_config("d", tmp_path / "run"), recorded) == []
    monkeypatch.chdir(second)
    assert changed_data_order(saved, tiny_config("../first/d", tmp_path / "run"), recorded) == []
    (change,) = changed_data_order(saved, tiny_config("d", tmp_path / "run"), recorded)
    assert change.startswith(f"data.paths: {first / 'd'} (") and f"-> {second / 'd'} (" in change
    # copied elsewhere (a new write time, the same bytes: a copy to a node's local disk) is the same data; it was
    # warned as another order
    (tmp_path / "copy").mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copyfile(first / f"d{suffix}", tmp_path / "copy" / f"d{suffix}")
    assert dataset_record(str(tmp_path / "copy" / "d"))["idx_written_ns"] != recorded[0]["idx_written_ns"]
    assert changed_data_order(saved, tiny_config(str(tmp_path / "copy" / "d"), tmp_path / "run"), recorded) == []
    # rebuilt in place at the same size (the same documents in another order): other data all the same
    monkeypatch.chdir(first)
    tokens = np.memmap("d.bin", dtype=np.uint16, mode="r+")
    tokens[:] = tokens[::-1].copy()
    tokens.flush()
    os.utime("d.idx", ns=(recorded[0]["idx_written_ns"] + 10**9,) * 2)
    (change,) = changed_data_order(saved, tiny_config("d", tmp_path / "run"), recorded)
    assert change.startswith(f"data.paths: {first / 'd'} (") and change.count(f"{first / 'd'} (") == 2
    # a checkpoint from before loom recorded its datasets: compared as written, as before
    assert changed_data_order(saved, tiny_config("../first/d", tmp_path / "run")) == [
        "data.paths: ['d'] -> ['../first/d']"
    ]


def test_a_resume_is_told_what_it_changes_and_not_what_it_does_not(tmp_path):
    """Settings of the optimizer step, loss and batch a rerun lost or changed trained on silently (weight decay,
    clipping, betas, dropout, precision: only the schedule, the data order and RoPE were said); blend weights that
    give the same shares ([1, 1], [2, 2], none) were said to reorder the data; the schedule's warning could show
    both rates as 0.001."""
    from loom.engine.checkpoint.saved_settings import (
        _told_apart,
        changed_data_order,
        changed_training_settings,
        resume_warnings,
    )
    from loom.engine.config_io import config_to_dict

    def config(**sections):
        return tiny_config("d", tmp_path / "run", **sections)

    saved = config_to_dict(config(optim={"weight_decay": 0.0, "clip_grad": 0.3}, model={"dropout": 0.1}))
    assert changed_training_settings(saved, config()) == [
        ("optim.weight_decay", 0.0, 0.1),
        ("optim.clip_grad", 0.3, 1.0),
        ("model.dropout", 0.1, 0.0),
    ]
    sgd = config(optim={"name": "sgd", "weight_decay": 0.0, "clip_grad": 0.3, "beta2": 0.99}, model={"dropout": 0.1})
    assert changed_training_settings(saved, sgd) == []  # SGD reads no betas
    momentum = changed_training_settings(config_to_dict(sgd), config(optim={"name": "sgd", "momentum": 0.5}))
    assert ("optim.momentum", 0.9, 0.5) in momentum  # read by SGD
    # fp16's scaler resumes its scale and counters, and reads its rules from the config; its initial scale it does
    # not read on a resume (a changed one was taken for used)
    fp16 = {"train": {"precision": "fp16"}, "optim": {"initial_loss_scale": 1024.0, "loss_scale_window": 100}}
    saved_fp16 = config_to_dict(config(**fp16))
    rescaled = config(train={"precision": "fp16"}, optim={"initial_loss_scale": 4096.0, "loss_scale_window": 50})
    assert changed_training_settings(saved_fp16, rescaled) == [("optim.loss_scale_window", 100, 50)]
    assert changed_training_settings(saved_fp16, config()) == [("train.precision", "fp16", "fp32")]  # no scaler read
    from_bf16 = config_to_dict(config(train={"precision": "bf16"}, optim={"loss_scale_window": 100}))
    assert changed_training_settings(from_bf16, rescaled) == [("train.precision", "bf16", "fp16")]  # none saved
    metadata = SimpleNamespace(
        config=saved_fp16,
        loss_scaler={"scale": 256.0},
        step=3,
        schedule_position=3.0,
        consumed_samples=3 * 16,
        datasets=None,
        layout=SimpleNamespace(optimizer=None),
    )
    (training, scaler) = resume_warnings(Path("iter_3"), metadata, rescaled, continues_run=True)
    assert scaler.startswith("optim.initial_loss_scale = 4096.0 is not used: this run continues the loss scale 256 ")
    assert "(optim.loss_scale_window: 100 -> 50); pass --optim.loss_scale_window 100" in training
    assert resume_warnings(Path("iter_3"), metadata, rescaled, continues_run=False) == []  # a fine-tune starts anew
    two = {"data": {"paths": ["a", "b"], "weights": [1.0, 1.0]}}
    blend = config_to_dict(tiny_config("a", tmp_path / "run", **two))
    for same in ([2.0, 2.0], None, [0.5, 0.5]):
        assert (
            changed_data_order(blend, tiny_config("a", tmp_path / "run", data={"paths": ["a", "b"], "weights": same}))
            == []
        )
    (change,) = changed_data_order(
        blend, tiny_config("a", tmp_path / "run", data={"paths": ["a", "b"], "weights": [1.0, 3.0]})
    )
    assert change == "data.weights: [1.0, 1.0] -> [1.0, 3.0]"
    unweighted = config_to_dict(tiny_config("a", tmp_path / "run", data={"paths": ["a", "b"]}))
    del unweighted["data"]["weights"]  # as config.toml keeps none (TOML has no null): it was never compared
    reweighted = tiny_config("a", tmp_path / "run", data={"paths": ["a", "b"], "weights": [1.0, 3.0]})
    assert changed_data_order(unweighted, reweighted) == ["data.weights: None -> [1.0, 3.0]"]
    third = tiny_config("a", tmp_path / "run", data={"paths": ["a", "b", "c"]})
    assert changed_data_order(unweighted, third) == ["data.paths: ['a', 'b'] -> ['a', 'b', 'c']"]
    assert _told_apart(0.001, 0.0010004) == ("0.001", "0.0010004") and _told_apart(2.5e-4, 1e-4) == (
        "0.00025",
        "0.0001",
    )

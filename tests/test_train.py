"""Trainer behaviour beyond layout invariance: bf16 autocast, early stopping, the demo end to end."""

import json
from pathlib import Path

import pytest
from training_runs import loom_here, read_metrics, tiny_config

from loom.launch.local import launch_local

REPO = Path(__file__).resolve().parents[1]


def train(dataset, run_dir, nproc=1, **sections) -> list[dict]:
    config = tiny_config(dataset, run_dir, **sections)
    config.resolve_world(nproc)
    launch_local(config, nproc)
    return read_metrics(run_dir)


def test_bf16_autocast_tracks_fp32(dataset, tmp_path):
    short = {"steps": 6, "seq_length": 64}  # bf16 matmuls are slow on CPU
    fp32 = [r["loss"] for r in train(dataset, tmp_path / "fp32", train=short)]
    bf16 = [r["loss"] for r in train(dataset, tmp_path / "bf16", train={**short, "precision": "bf16"})]
    assert bf16 != fp32, "bf16 autocast should change the arithmetic"
    for a, b in zip(fp32, bf16):
        assert abs(a - b) / a < 2e-2
    assert bf16[-1] < bf16[0]


def test_fp16_overflow_skips_are_said_on_the_console(dataset, tmp_path, capfd):
    """A loss scale past fp16's range overflows every step: each skipped update is said with the scale it halves
    to (only metrics.jsonl's skipped_steps told, beside a console 'grad norm nan'), and holds the learning rate
    where it was, as Megatron-LM's and DeepSpeed's schedulers do (warmup's first lr, lr / 2, twice)."""
    optim = {"initial_loss_scale": 2.0**32, "loss_scale_hysteresis": 1, "warmup_steps": 2, "lr": 1e-3}
    short = {"steps": 2, "precision": "fp16", "seq_length": 32, "global_batch_size": 2, "micro_batch_size": 2}
    rows = train(dataset, tmp_path, model={"num_layers": 1}, optim=optim, train=short)
    assert [r["skipped_steps"] for r in rows] == [1, 2]
    assert [r["lr"] for r in rows] == [5e-4, 5e-4]
    out = capfd.readouterr().out
    assert (
        "step 1: fp16 gradients overflowed at loss scale 4.29497e+09; update skipped (the scale is now 2.14748e+09"
        in out
    )
    assert "step 2: fp16 gradients overflowed at loss scale 2.14748e+09; update skipped" in out


def test_a_job_train_exit_after_ends_always_saves_and_so_does_the_last_step_of_a_run_with_an_interval(
    dataset, tmp_path
):
    """With save_at_end false and no interval, a job that exit_after ended saved nothing (the same command then
    trained steps 1-3 again, forever); with an interval the run's last step is saved whatever save_at_end says
    (else the steps after the last interval save were trained again on every rerun)."""
    short = {"steps": 6, "seq_length": 32, "global_batch_size": 2, "micro_batch_size": 2, "exit_after": 3}
    for _ in range(2):
        rows = train(dataset, tmp_path / "chained", model={"num_layers": 1}, train=short)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the second job went on from step 3
    assert sorted(p.name for p in (tmp_path / "chained/checkpoints").glob("iter_*")) == ["iter_0000003"]
    train(dataset, tmp_path / "interval", model={"num_layers": 1}, train={**short, "exit_after": 0},
          checkpoint={"interval": 4, "save_at_end": False})  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "interval/checkpoints").glob("iter_*")) == [
        "iter_0000004",
        "iter_0000006",
    ]


def test_early_stopping_when_validation_stops_improving(dataset, tmp_path, capfd):
    """It stops after `early_stop_patience` evaluations without a gain; the checkpoint keeps that state, so the
    same command again does not train on (it trained on, with its best validation loss forgotten)."""
    # A learning rate too small to move fp32 weights keeps the validation loss exactly flat.
    flat = {"name": "sgd", "lr": 1e-30, "min_lr": 0.0, "momentum": 0.0}

    def run(patience: int) -> list[dict]:
        checkpoint = {"interval": 2, "save_at_end": True}
        train_settings = {"steps": 20, "eval_interval": 1, "early_stop_patience": patience}
        return train(dataset, tmp_path, optim=flat, checkpoint=checkpoint, train=train_settings)

    rows = run(patience=2)
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [1, 2, 3]
    assert len({r["val_loss"] for r in val}) == 1
    assert "early stop at step 3" in capfd.readouterr().out
    assert (tmp_path / "checkpoints" / "iter_0000003").is_dir()  # saved where it stopped
    assert run(patience=2) == rows and "nothing to train: the run in" in capfd.readouterr().out
    # More patience trains on from the saved count: two evaluations without a gain already, so one more step
    run(patience=3)
    assert "early stop at step 4: validation loss has not improved for 3 evaluations" in capfd.readouterr().out


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, monkeypatch, capfd):
    """`loom demo` as the README runs it (through loom's entry point, in this process), on 80 documents."""
    monkeypatch.chdir(tmp_path)
    demo = ["--max-docs", "80", "--train.steps", "4", "--nproc", "4", "--parallel.tp", "1", "--parallel.pp", "2"]
    result = loom_here(capfd, "demo", "--workdir", str(tmp_path), *demo, "--parallel.vp", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "== summary" in result.stdout and "validation   loss" in result.stdout
    assert "the same reshard into the run's own checkpoints is refused: --output" in result.stdout
    assert "sample       'def " in result.stdout  # what the trained model writes, decoded
    assert "exact and 0 near duplicates removed" in result.stdout  # 80 stdlib files hold no near duplicates
    assert "corpus.jsonl: 80 documents of 80 files (0 not UTF-8, skipped)" in result.stdout
    assert "2 sample indices (2 built, 0 found)" in result.stdout  # built offline before training
    rows = [json.loads(line) for line in (tmp_path / "runs/tiny/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 4
    training = [row for row in rows if "loss" in row]  # a short demo logs every step: the summary's loss moves
    assert [row["step"] for row in training] == [1, 2, 3, 4]
    assert f"loss {training[0]['loss']:.3f} at step 1 -> {training[-1]['loss']:.3f} at step 4" in result.stdout
    resumed = [json.loads(line) for line in (tmp_path / "runs/tiny-resumed/metrics.jsonl").read_text().splitlines()]
    assert resumed[-1]["step"] == 6
    assert (tmp_path / "hf/config.json").exists() and (tmp_path / "hf/model.safetensors").exists()
    weights = len(
        json.loads(next((tmp_path / "runs/tiny-resumed/checkpoints").glob("iter_*/metadata.json")).read_text())["specs"]
    )
    assert f"import-megatron reads it back: {weights} of {weights} weights identical" in result.stdout
    finetuned = [json.loads(line) for line in (tmp_path / "runs/tiny-finetuned/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in finetuned if "loss" in row] == [1, 2]  # its weights, from step 1
    assert "fine-tune    the resumed weights from step 1 (checkpoint.finetune), bf16, ZeRO-2 over dp=2: loss" in (
        result.stdout
    )
    moe = [json.loads(line) for line in (tmp_path / "runs/tiny-moe/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in moe if "loss" in row] == [1, 2] and all(row["moe_aux_loss"] > 0 for row in moe)
    assert json.loads((tmp_path / "hf-moe/config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    assert "experts      4 a block, top 2, tp=2 SP: loss " in result.stdout
    assert "DeepSeek-V3's routing at ep 2: experts' biases -" in result.stdout  # the biases moved, some down
    biased = json.loads(next((tmp_path / "runs/tiny-moe-biased/checkpoints").glob("iter_*/metadata.json")).read_text())
    assert biased["layout"]["ep"] == 2 and biased["config"]["model"]["moe_router_groups"] == 2
    assert (tmp_path / "hf/tokenizer.model").read_bytes() == (tmp_path / "data/tokenizer.model").read_bytes()
    assert (tmp_path / "data/stdlib_text_document.idx").exists()
    assert json.loads((tmp_path / "data/clean/stats.json").read_text())["kept"] > 70
    assert (tmp_path / "runs/tiny/pipeline_schedule.png").exists()
    assert (tmp_path / ".loom-demo").exists()  # its next run here may replace these


def test_the_demo_replaces_only_its_own_outputs(tmp_path, capfd):
    """`loom demo --workdir D` deleted D/runs, D/hf and D/hf-lora-adapter whatever they held (a user's runs too)."""
    from loom.launch.demo import _claim_workdir

    user = tmp_path / "user"
    (user / "runs/tiny").mkdir(parents=True)  # what the README's `loom train --config configs/tiny.toml` writes
    (user / "runs/tiny/metrics.jsonl").write_text("precious\n")
    refused = loom_here(capfd, "demo", "--workdir", str(user))
    assert refused.returncode == 2 and "holds runs/tiny, which no demo wrote there" in refused.stderr
    assert (user / "runs/tiny/metrics.jsonl").read_text() == "precious\n" and not (user / "data").exists()
    cleaned = tmp_path / "cleaned"  # a user's own cleaned data where the demo's clean step writes (it removed it)
    (cleaned / "data/clean").mkdir(parents=True)
    refused = loom_here(capfd, "demo", "--workdir", str(cleaned))
    assert refused.returncode == 2 and "holds data/clean, which no demo wrote there" in refused.stderr
    demo = tmp_path / "demo"  # an earlier demo's workdir, and a run of the user's beside its runs
    for name in ("runs/tiny/checkpoints", "runs/tiny-lora", "hf", "runs/mine"):
        (demo / name).mkdir(parents=True)
    (demo / ".loom-demo").write_text("")
    _claim_workdir(demo)
    assert sorted(str(p.relative_to(demo)) for p in demo.rglob("*")) == [".loom-demo", "runs", "runs/mine"]
    older = tmp_path / "older"  # one from before the mark: its runs/tiny trained on its own data/
    (older / "runs/tiny").mkdir(parents=True)
    (older / "runs/tiny/config.toml").write_text(f"[data]\npaths = [{str(older / 'data/stdlib_text_document')!r}]\n")
    _claim_workdir(older)
    assert not (older / "runs/tiny").exists()


def test_batch_size_ramp_up_is_layout_invariant(dataset, tmp_path):
    """The ramp's batches, its learning rates counted in samples (Megatron's; tests/test_optim.py compares the
    schedule with megatron-core's), the same under another layout, and the same after a resume inside the ramp."""
    ramp = {"steps": 5, "global_batch_size": 16, "micro_batch_size": 2, "rampup_batch_size": [4, 4, 24]}
    optim = {"lr": 1e-3, "warmup_steps": 2, "decay_steps": 6}
    single = train(dataset, tmp_path / "one", train=ramp, optim=optim)
    # 8 samples per increment: consumed 0, 4 -> 4; 8 -> 8; 16 -> 12; 28 -> 16
    assert [r["global_batch_size"] for r in single] == [4, 4, 8, 12, 16]
    assert [r["tokens"] for r in single] == [128 * n for n in (4, 8, 16, 28, 44)]
    # warmup of 2 full batches (32 samples): the rate at 4, 8, 16, 28 samples; then 44, past it: the peak
    assert [r["lr"] for r in single] == pytest.approx([1e-3 * n / 32 for n in (4, 8, 16, 28, 32)], rel=1e-12)
    split = train(dataset, tmp_path / "two", nproc=2, train=ramp, optim=optim, parallel={"pp": 2})
    for a, b in zip(single, split, strict=True):
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5
    train(dataset, tmp_path / "resumed", train={**ramp, "steps": 3}, optim=optim)
    resumed = train(dataset, tmp_path / "resumed", train=ramp, optim=optim)
    assert [(r["lr"], r["global_batch_size"]) for r in resumed[3:]] == [
        (r["lr"], r["global_batch_size"]) for r in single[3:]
    ]
    for a, b in zip(single[3:], resumed[3:], strict=True):
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5


def test_two_datasets_blend_by_weight(dataset, markov_dataset, tmp_path):
    second = markov_dataset(200, seed=7)
    rows = train(
        dataset,
        tmp_path / "run",
        data={"paths": [dataset, second], "weights": [0.75, 0.25]},
        train={"steps": 2, "eval_interval": 2},
    )
    assert [r["step"] for r in rows] == [1, 2, 2] and "val_loss" in rows[-1]


def test_a_nan_validation_loss_is_never_the_best():
    """A NaN first validation loss was kept as the best: nothing compares below NaN, so every later evaluation
    counted as no gain and early stopping ended a run that had recovered ("best nan")."""
    import math
    import types

    from loom.engine.train import Trainer

    trainer = types.SimpleNamespace(validation={"best_loss": None, "evals_without_gain": 0})
    Trainer._record_validation(trainer, math.nan)
    assert trainer.validation == {"best_loss": None, "evals_without_gain": 1}
    assert Trainer._no_gain_in_validation(trainer) == "no evaluation in 1 has given a finite validation loss"
    Trainer._record_validation(trainer, 2.5)
    assert trainer.validation == {"best_loss": 2.5, "evals_without_gain": 0}
    Trainer._record_validation(trainer, math.inf)
    assert trainer.validation == {"best_loss": 2.5, "evals_without_gain": 1}
    assert Trainer._no_gain_in_validation(trainer) == "validation loss has not improved for 1 evaluations (best 2.5000)"


def test_a_run_that_reads_its_data_more_than_once_says_so(markov_dataset, tmp_path):
    """A small dataset was read again and again without a word (Megatron prints its epochs)."""
    from training_runs import tiny_config

    from loom.engine.data.loader import build_datasets, repeated_data

    small, large = markov_dataset(40), markov_dataset(300)
    config = tiny_config(small, tmp_path, train={"steps": 2, "eval_interval": 0})
    config.data.cache_dir = str(tmp_path / "cache")
    train, _ = build_datasets(config, True, True, None)
    assert repeated_data(train) == []
    config.train.steps = 40
    train, _ = build_datasets(config, True, True, None)
    samples, per_epoch = 40 * config.train.global_batch_size, train.epoch.samples
    assert repeated_data(train) == [
        f"{small} {samples / per_epoch:.1f} times ({samples:,} samples of the {per_epoch:,} an epoch of its training "
        "split holds; each epoch shuffled anew)"
    ]
    config.data.paths, config.data.weights = [small, large], [1.0, 1.0]
    blend, _ = build_datasets(config, True, True, None)
    (said,) = repeated_data(blend)  # half the samples from each: more than the small one holds, not the large one
    assert said.startswith(f"{small} ") and f"({samples // 2:,} samples of the {per_epoch:,} an epoch" in said
    config.data.paths, config.data.weights = [small], None
    config.train.eval_interval, config.train.eval_iters = 1, 20
    _, valid = build_datasets(config, True, True, None)  # each evaluation averages the same samples several times
    samples, per_epoch = 20 * config.train.global_batch_size, valid.epoch.samples
    assert repeated_data(valid, "validation") == [
        f"{small} {samples / per_epoch:.1f} times ({samples:,} samples of the {per_epoch:,} an epoch of its validation "
        "split holds; each epoch shuffled anew)"
    ]


def test_a_resumed_run_drops_a_row_its_killed_job_cut_short(tmp_path):
    """metrics.jsonl and the comm ledger keep the rows up to the resumed step; a last line cut short by a kill or a
    full disk made the resume fail (JSONDecodeError, the file unnamed). A damaged line before it is named."""
    from loom.engine.config import ConfigError
    from loom.engine.metrics import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "val_loss": 1.7}, {"step": 3, "loss": 1}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 4, "lo')
    drop_rows_after(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    path.write_text(path.read_text() + "not json\n" + json.dumps(rows[3]) + "\n")
    with pytest.raises(ConfigError, match=f"{path}, line 4, is not a row of steps"):
        drop_rows_after(path, 3)

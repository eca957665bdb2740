"""Mistakes a new user makes are one line before any rank starts: data tokenized with a larger vocabulary,
a sequence longer than the model's positions, a rank count below one, a config that is not UTF-8 or is a
directory, a dataset folder where a prefix belongs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from training_runs import loom, loom_here, one_line_error, read_metrics, tiny_train_args

from loom.engine.data.indexed import IndexedDataset, IndexedDatasetWriter
from loom.engine.data.token_range import token_id_range


@pytest.fixture
def out_of_vocabulary(tmp_path):
    """A .bin tokenized with a 5000-piece vocabulary, for the tiny model's 4096."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "wide", np.dtype(np.uint16)) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(0, 4096, 300))
        writer.add_document(np.array([4999, 7, 8]))
    return str(tmp_path / "wide")


def test_token_ids_beyond_the_vocabulary_are_refused_under_tp2(out_of_vocabulary, tmp_path, capfd):
    """At tp = 2 this data used to train to exit 0 at loss ln(V): the vocabulary-parallel embedding masks it."""
    result = loom_here(
        capfd, "train", *tiny_train_args(out_of_vocabulary, tmp_path / "run", "--nproc", "2", "--parallel.tp", "2")
    )
    one_line_error(result, "holds token id 4999", "model.vocab_size = 4096", "--model.vocab_size 5000")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_token_range_is_cached_and_follows_the_file(out_of_vocabulary):
    dataset = IndexedDataset(out_of_vocabulary)
    smallest, largest = token_id_range(dataset)
    assert largest == 4999 and smallest == int(min(dataset[i].min() for i in range(len(dataset))))
    caches = list((dataset.bin_path.parent / "wide_cache").glob("token-range-*.json"))
    assert len(caches) == 1 and json.loads(caches[0].read_text())["largest_token_id"] == 4999
    with IndexedDatasetWriter(out_of_vocabulary, np.dtype(np.uint16)) as writer:  # rebuilt: another file
        writer.add_document(np.array([3, 4, 5]))
    assert token_id_range(IndexedDataset(out_of_vocabulary)) == (3, 5)


def test_sequence_longer_than_the_positions_is_refused(dataset, tmp_path, capfd):
    result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.seq_length", "100000"))
    one_line_error(result, "train.seq_length = 100000 exceeds model.max_position_embeddings = 4096")


@pytest.mark.parametrize("count", ["0", "-2"])
def test_rank_counts_below_one_are_refused(dataset, tmp_path, count, capfd):
    result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--nproc", count))
    assert result.returncode == 2
    assert f"argument --nproc: must be at least 1, got {count}" in result.stderr


def test_a_config_that_is_not_utf8_is_one_line(dataset, tmp_path, capfd):
    config = tmp_path / "latin1.toml"
    config.write_bytes("[train]\n# caf\xe9\nsteps = 2\n".encode("latin-1"))
    one_line_error(loom_here(capfd, "train", "--config", str(config), "--data.paths", dataset), "is not UTF-8 text")


def test_directories_where_files_belong_are_named_as_such(dataset, tmp_path, capfd):
    one_line_error(loom_here(capfd, "train", "--config", str(tmp_path)), f"config {tmp_path} is a directory")
    folder = str(Path(dataset).parent)
    result = loom_here(capfd, "train", *tiny_train_args(folder, tmp_path / "run"))
    one_line_error(result, f"{folder} is a directory; give the prefix P of P.bin/P.idx", dataset)
    (tmp_path / "docs.jsonl").write_text('{"text": "x"}\n')
    result = loom_here(capfd, "data", "clean", "--input", str(tmp_path), "--output", str(tmp_path / "out"))
    one_line_error(result, f"input {tmp_path} is a directory; give its JSONL files (here: docs.jsonl)")
    # and a file where a folder belongs (it was "is not writable: File exists")
    result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path / "docs.jsonl"))
    one_line_error(result, f"run directory {tmp_path / 'docs.jsonl'} is a file; give a folder")


def test_a_run_directory_belongs_to_one_run(dataset, tmp_path, capfd):
    """The README's commands used to share runs/tiny, each truncating the last one's metrics."""
    first = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "2"))
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "metrics.jsonl").read_text()

    other = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "3", "--parallel.tp", "1"))
    one_line_error(other, f"run directory {tmp_path} holds another run's metrics (train.steps: 2 there, 3 now)")
    assert (tmp_path / "metrics.jsonl").read_text() == before
    saved = (tmp_path / "config.toml").read_bytes()
    (tmp_path / "config.toml").unlink()  # it named the first field of an empty config instead
    result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "3"))
    one_line_error(result, "holds another run's metrics (and no readable config.toml)")
    (tmp_path / "config.toml").write_bytes(saved)

    again = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "2"))
    assert again.returncode == 0, again.stderr  # the same run, started again, and it says so
    assert f"{tmp_path} holds this run's metrics but no checkpoint to resume from: it trains again from" in again.stdout
    # as a job of it that stops after one step: train.exit_after is the job's, not the run's
    job = loom_here(
        capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "2", "--train.exit_after", "1")
    )
    assert job.returncode == 0, job.stderr
    before = (tmp_path / "metrics.jsonl").read_text()
    shutil.rmtree(tmp_path / "checkpoints")  # the job's, for the next job: with it the run below would resume

    replaced = loom_here(
        capfd, "train", *tiny_train_args(dataset, tmp_path, "--train.steps", "3", "--train.overwrite", "true")
    )
    assert replaced.returncode == 0, replaced.stderr
    [aside] = (tmp_path / "replaced").iterdir()
    assert (aside / "metrics.jsonl").read_text() == before
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]


def test_overwrite_says_it_resumes_a_run_that_has_a_checkpoint(dataset, tmp_path, capfd):
    """train.overwrite replaces only a run with nothing to resume: a checkpoint is resumed (a requeued Slurm job
    given the flag must not throw its progress away), and the flag's being ignored is said."""
    args = tiny_train_args(dataset, tmp_path, "--train.steps", "2", "--checkpoint.interval", "2")
    assert loom_here(capfd, "train", *args).returncode == 0
    again = loom_here(capfd, "train", *args, "--train.overwrite", "true")
    assert again.returncode == 0, again.stderr
    assert f"warning: train.overwrite: {tmp_path} has a checkpoint, so this run resumes it" in again.stdout
    assert not (tmp_path / "replaced").exists()


def test_a_checkpoint_to_load_that_holds_none_is_refused_before_any_rank(dataset, tmp_path, capfd):
    """An empty folder or a file as --checkpoint.load failed inside rank 0 (exit 1, after the plan and kernels
    lines) and left an empty run directory behind."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for load in (tmp_path / "empty", tmp_path / "notes.txt"):
        result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path / "run", "--checkpoint.load", str(load)))
        one_line_error(result, f"checkpoint.load = {load} holds no checkpoint")
    assert not (tmp_path / "run").exists()
    # another run's checkpoint at or past train.steps: "the run in RUN is complete" (about the new run) and exit 0
    saved = tmp_path / "saved"
    assert (
        loom_here(
            capfd, "train", *tiny_train_args(dataset, saved, "--train.steps", "2", "--checkpoint.interval", "2")
        ).returncode
        == 0
    )
    result = loom_here(
        capfd,
        "train",
        *tiny_train_args(dataset, tmp_path / "run", "--train.steps", "2", "--checkpoint.load", str(saved)),
    )
    one_line_error(result, f"checkpoint.load = {saved} is at step 2, and train.steps = 2: nothing would train")
    # a truncated one was "holds no checkpoint" too, while eval and the ckpt tools named the short file
    cut = tmp_path / "cut"
    shutil.copytree(saved / "checkpoints", cut)
    [piece] = (cut / "iter_0000002").glob("rank*.safetensors")
    piece.write_bytes(piece.read_bytes()[:-1000])
    result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path / "run", "--checkpoint.load", str(cut)))
    one_line_error(
        result,
        f"checkpoint.load = {cut} holds no intact checkpoint (the newest: ",
        "(truncated? copy it again whole, or load an earlier iter_N))",
    )
    assert not (tmp_path / "run").exists()
    # Another architecture: a smaller model loaded a 4-layer checkpoint (layer 3 dropped, exit 0); resuming with
    # another width failed inside rank 0 (exit 1, an empty run folder left)
    fewer = tiny_train_args(dataset, tmp_path / "run", "--train.steps", "3", "--model.num_layers", "3")
    result = loom_here(capfd, "train", *fewer, "--checkpoint.load", str(saved))
    one_line_error(result, "is of another model: model.num_layers = 4 there, 3 here", "--model.num_layers 4")
    narrower = tiny_train_args(dataset, saved, "--train.steps", "3", "--model.hidden_size", "64")
    one_line_error(loom_here(capfd, "train", *narrower), "model.hidden_size = 128 there, 64 here")
    assert not (tmp_path / "run").exists()
    # Rerunning (or extending, or requeueing) a run that started from --checkpoint.load went back to the loaded
    # checkpoint, training its steps again; it continues from its own now
    started = tiny_train_args(dataset, tmp_path / "B", "--checkpoint.load", str(saved), "--checkpoint.interval", "1")
    first = loom_here(capfd, "train", *started, "--train.steps", "3")
    assert first.returncode == 0 and "(checkpoint.load) at step 2, sample 32 of its data: this run trains on from" in (
        first.stdout
    ), first.stdout
    again = loom_here(capfd, "train", *started, "--train.steps", "4")
    assert again.returncode == 0, again.stderr
    own = tmp_path / "B" / "checkpoints" / "iter_0000003"
    assert f"resumed from {own} at step 3 (this run's own; checkpoint.load = {saved} is where" in again.stdout
    assert [row["step"] for row in read_metrics(tmp_path / "B")] == [3, 4]
    # a checkpoint.load added since is not where the run started (it said so), and is not used; a setting of the
    # optimizer step the rerun lost (or changed) is said with the flag that keeps it
    other = saved / "checkpoints" / "iter_0000002"
    elsewhere = tiny_train_args(dataset, tmp_path / "B", "--checkpoint.load", str(other), "--checkpoint.interval", "1")
    moved = loom_here(capfd, "train", *elsewhere, "--train.steps", "5", "--optim.weight_decay", "0.05")
    assert moved.returncode == 0, moved.stderr
    assert (
        f"(this run's own: checkpoint.load = {other} is not used, as a run with checkpoints of its own" in moved.stdout
    )
    assert (
        "warning: this run trains on from step 4 with other settings than "
        f"{tmp_path / 'B' / 'checkpoints' / 'iter_0000004'} was saved with (optim.weight_decay: 0.1 -> 0.05); pass "
        "--optim.weight_decay 0.1 to keep them" in moved.stdout
    ), moved.stdout
    # a run trained into a folder a ckpt tool wrote (an import, a reshard) took those checkpoints for its own and
    # rotated them away after keep saves: refused, with the flags that start from them
    from loom.tools.ckpt import reshard

    reshard(saved, tmp_path / "T" / "checkpoints", tp=1, pp=1)
    into_it = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path / "T", "--train.steps", "3"))
    one_line_error(into_it, f"{tmp_path / 'T' / 'checkpoints'} holds checkpoints no training run wrote (iter_0000002")
    assert sorted(p.name for p in (tmp_path / "T" / "checkpoints").iterdir()) == ["iter_0000002", "latest"]
    # the run's record keeps where it started: the unused load is not taken for its start on the next rerun
    moved_again = loom_here(capfd, "train", *elsewhere, "--train.steps", "6", "--optim.weight_decay", "0.05")
    assert f"(this run's own: checkpoint.load = {other} is not used" in moved_again.stdout, moved_again.stdout
    # nor is a finetune given since (its record would read a fine-tune from where it never started)
    finetuned = loom_here(capfd, "train", *elsewhere, "--train.steps", "7", "--checkpoint.finetune", "true")
    assert finetuned.returncode == 0 and "is not used" in finetuned.stdout, finetuned.stderr
    recorded = (tmp_path / "B" / "config.toml").read_text()
    assert f'load = "{saved}"' in recorded and "finetune = false" in recorded, recorded


def test_check_same_model_names_the_flag_that_continues_the_saved_model(tmp_path):
    from loom.engine.checkpoint.format import CheckpointError
    from loom.engine.checkpoint.saved_settings import check_same_model
    from loom.engine.config import LoomConfig, LoraConfig, ModelConfig

    def config(lora: dict | None = None, **model) -> LoomConfig:
        return LoomConfig(model=ModelConfig(**{**saved, **model}), lora=LoraConfig(**(lora or {})))

    saved = vars(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, tie_embeddings=True))
    check_same_model(tmp_path, {"model": saved}, config(rope_theta=5e5))  # functional: the trainer warns
    with pytest.raises(CheckpointError, match="model.tie_embeddings = True there, False here; pass --model.tie_emb"):
        check_same_model(tmp_path, {"model": saved}, config(tie_embeddings=False))
    learned = {**saved, "position_embedding": "learned", "max_position_embeddings": 128}
    with pytest.raises(CheckpointError, match="model.max_position_embeddings = 128 there, 256 here"):
        check_same_model(
            tmp_path, {"model": learned}, config(position_embedding="learned", max_position_embeddings=256)
        )
    check_same_model(tmp_path, {"model": saved}, config(max_position_embeddings=8192))  # RoPE: no shape
    # every difference at once, with one line of flags (a fine-tune under another preset took a try per field)
    with pytest.raises(CheckpointError) as refused:
        check_same_model(tmp_path, {"model": saved}, config(num_layers=4, hidden_size=128, tie_embeddings=False))
    said = str(refused.value)
    for difference in ("model.num_layers = 2 there, 4 here", "model.hidden_size = 64 there, 128 here"):
        assert difference in said, said
    flags = said.split("; pass ")[1].split(" to load it")[0].split(" --")
    assert sorted(flags) == sorted(["--model.num_layers 2", "model.hidden_size 64", "model.tie_embeddings true"])
    # A LoRA checkpoint's adapters: other targets left the trained ones unloaded, another alpha rescaled them
    adapters = {"model": saved, "lora": {"rank": 4, "alpha": 16.0, "targets": ["qkv", "fc1"]}}
    check_same_model(tmp_path, adapters, config({"rank": 4, "targets": ["qkv", "fc1"], "base": "b"}))
    with pytest.raises(CheckpointError, match="lora.targets = .'qkv', 'fc1'. there, .'qkv'. here; pass --lora.tar"):
        check_same_model(tmp_path, adapters, config({"rank": 4, "targets": ["qkv"], "base": "b"}))
    with pytest.raises(CheckpointError, match="lora.alpha = 16.0 there, 64.0 here; pass --lora.alpha 16.0"):
        check_same_model(tmp_path, adapters, config({"rank": 4, "alpha": 64.0, "targets": ["qkv", "fc1"], "base": "b"}))


def test_a_yarn_factor_given_over_a_checkpoint_s_takes_its_own_cos_sin_factor(tmp_path):
    """A fine-tune of a YaRN checkpoint (factor 4) with --model.rope_scaling_factor 8 computed factor 8's
    frequencies with factor 4's cos/sin factor, the checkpoint's; it derives 8's, as Hugging Face does. Without the
    flag the checkpoint's pair stays; a cos/sin factor the flags give stays too."""
    import math
    from types import SimpleNamespace

    from loom.engine.config_io import config_to_dict, load_config
    from loom.engine.preflight import adopt_saved_model_settings

    yarn = ["--model.rope_scaling", "yarn", "--model.rope_scaling_factor", "4"]
    found = (tmp_path, SimpleNamespace(config=config_to_dict(load_config("tiny", yarn))))
    for flags, factor, attention in (
        (["--model.rope_scaling_factor", "8"], 8.0, 1 + 0.1 * math.log(8)),
        ([], 4.0, 1 + 0.1 * math.log(4)),
        (["--model.rope_scaling_factor", "8", "--model.rope_attention_factor", "1.5"], 8.0, 1.5),
    ):
        config = load_config("tiny", ["--checkpoint.load", str(tmp_path), *flags])
        adopt_saved_model_settings(config, found, say=False)
        model = config.model
        assert (model.rope_scaling, model.rope_scaling_factor, model.rope_attention_factor) == (
            "yarn",
            factor,
            attention,
        )


def test_data_settings_that_failed_inside_a_rank_are_refused_before_any(dataset, tmp_path, capfd):
    """A split leaving no validation documents while the run evaluates, and a cache_dir that is a file, failed in
    rank 0 after the plan and kernels lines (exit 1) and left an empty run folder."""
    run = tmp_path / "run"
    evaluating = tiny_train_args(dataset, run, "--train.eval_interval", "2", "--data.split", "1,0,0")
    one_line_error(loom_here(capfd, "train", *evaluating), "leaves", "no validation documents", "eval_interval 0")
    no_training = tiny_train_args(dataset, run, "--data.split", "0,1,0")
    one_line_error(loom_here(capfd, "train", *no_training), "the training split '0,1,0' leaves it no documents")
    (tmp_path / "cache").write_text("")
    in_a_file = tiny_train_args(dataset, run, "--data.cache_dir", str(tmp_path / "cache"))
    one_line_error(loom_here(capfd, "train", *in_a_file), f"data.cache_dir {tmp_path / 'cache'} is a file")
    assert not run.exists()


def test_the_demo_refuses_a_layout_before_its_data_steps(tmp_path, capfd):
    """`loom demo --parallel.tp 3 --nproc 8` ran the whole data pipeline first, then refused the layout."""
    result = loom_here(capfd, "demo", "--parallel.tp", "3", "--nproc", "8", "--workdir", str(tmp_path / "demo"))
    one_line_error(result, "world size 8 is not divisible by tp*pp = 3*2")
    assert not (tmp_path / "demo").exists()


def test_a_run_directory_in_use_is_refused_until_its_run_ends(dataset, tmp_path, capfd):
    """Two runs in one directory wrote over each other's metrics and checkpoints (a job submitted twice, a `loom
    train` beside its Slurm job), and --train.overwrite moved a live run's files aside."""
    import os
    import socket

    from training_runs import loom

    from loom.engine.parallel.rendezvous import free_port
    from loom.engine.run_lock import RunLock

    args = tiny_train_args(dataset, tmp_path, "--train.steps", "2")
    assert loom_here(capfd, "train", *args).returncode == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    held = RunLock(tmp_path)  # as a live run's rank 0 holds it
    in_use = f"run directory {tmp_path} is in use by a running loom run (pid {os.getpid()} on {socket.gethostname()}"
    one_line_error(loom_here(capfd, "train", *args), in_use)
    overwrite = tiny_train_args(dataset, tmp_path, "--train.steps", "3", "--train.overwrite", "true")
    one_line_error(loom_here(capfd, "train", *overwrite), in_use)
    assert (tmp_path / "metrics.jsonl").read_text() == before and not (tmp_path / "replaced").exists()
    rank = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    one_line_error(loom("train", *args, env=rank), in_use)  # a rank of torchrun or srun takes the lock itself
    with pytest.raises(Exception, match="is in use"):
        RunLock(tmp_path)
    held.close()  # the lock goes with its holder (or its process)
    assert loom_here(capfd, "train", *args).returncode == 0


def test_a_refused_launch_leaves_the_lock_of_the_run_it_met(tmp_path):
    """Two launches into a new directory both saw it made by themselves; the one refused removed the lock file on
    its way out, from under the live run, and a third launch then trained beside that run in the same directory."""
    from loom.engine.config import ConfigError
    from loom.engine.preflight import removed_if_left_empty
    from loom.engine.run_lock import LOCK_FILE, RunLock, holder_of

    run_dir = tmp_path / "new"
    with pytest.raises(ConfigError, match="is in use"), removed_if_left_empty(run_dir):
        held = RunLock(run_dir)  # the other launch's rank 0, after this one looked
        RunLock(run_dir)
    assert (run_dir / LOCK_FILE).is_file() and holder_of(run_dir) is not None
    held.close()
    with pytest.raises(ConfigError, match="refused"), removed_if_left_empty(run_dir / "later"):
        RunLock(run_dir / "later").close()  # a launch that failed after its lock was free again
        raise ConfigError("refused")
    assert not (run_dir / "later").exists()  # left as it was found


def test_a_rank_environment_left_in_the_shell_is_named(dataset, tmp_path, capfd, monkeypatch):
    """RANK and WORLD_SIZE left from another job made `loom train` one rank of a launch that does not exist: a
    traceback about MASTER_ADDR, or silence until the rendezvous timed out (then a traceback); a port another
    process holds was a traceback too."""
    import socket

    from loom.engine.parallel.rendezvous import free_port

    args = tiny_train_args(dataset, tmp_path, "--train.steps", "1", "--parallel.timeout_minutes", "0.02")
    from loom.launch import cli

    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")  # `srun -n 2 loom train`: each task trained a run of its own
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setattr(cli, "_parent_command", lambda: "slurmstepd")
    one_line_error(loom_here(capfd, "train", *args), "this is task 1 of 2 of an srun step, and each task would start")
    monkeypatch.setattr(cli, "_parent_command", lambda: "bash")  # a shell srun started: `srun --pty bash`, then this
    assert loom_here(capfd, "train", *args, "--nproc", "2", "--print-config").returncode == 0
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    one_line_error(loom_here(capfd, "train", *args), "RANK=0, WORLD_SIZE=2 in the environment make this process one "
                   "rank of a torchrun/srun launch, but MASTER_ADDR is not set")  # fmt: skip
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        monkeypatch.setenv("WORLD_SIZE", "1")
        one_line_error(loom_here(capfd, "train", *args), "another process took the port")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    result = loom_here(capfd, "train", *args)
    assert result.stdout.startswith("loom train: rank 0 of 2 (RANK, WORLD_SIZE from the environment), meeting the")
    one_line_error(result, "rank 0 of WORLD_SIZE = 2 waited ", " s at 127.0.0.1:", "(parallel.timeout_minutes = 0.02)")
    monkeypatch.setenv("RANK", "1")  # the others connect to rank 0, and time out as clients (torch's C++ says so too)
    from loom.launch import env

    monkeypatch.setattr(env, "WAITING_NOTICE_S", 0.2)  # else silent until the timeout
    result = loom_here(capfd, "train", *args)
    assert "loom: rank 1 of 2 has waited 0.2 s at 127.0.0.1:" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.startswith("error: rank 1 of WORLD_SIZE = 2 waited "), last
    assert "(parallel.timeout_minutes = 0.02)" in last
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_non_ascii_argument_under_an_ascii_locale_is_refused_up_front(dataset, tmp_path):
    """With LC_ALL=POSIX and Python's UTF-8 mode off, a non-ASCII run name reached the ranks as undecodable bytes:
    TensorBoard's writer crashed at the first step (a traceback), and config.toml's writer without TensorBoard."""
    ascii_locale = {**os.environ, "LC_ALL": "POSIX", "PYTHONUTF8": "0"}
    args = tiny_train_args(dataset, tmp_path / "runé", "--train.steps", "1", "--train.tensorboard", "true")
    result = loom("train", *args, env=ascii_locale)
    one_line_error(
        result, "run\\xe9' is not ASCII, and this locale's filesystem encoding is ascii"
    )  # stderr escapes it
    assert not (tmp_path / "runé").exists()


def test_text_printed_under_an_ascii_locale_is_escaped_and_a_closed_pipe_is_quiet():
    """With LC_ALL=POSIX and Python's UTF-8 mode off, `loom data inspect`, `preview` and `generate` ended in a
    UnicodeEncodeError traceback when the text they print was not ASCII; `loom ... | head` in a BrokenPipeError."""
    ascii_locale = {**os.environ, "LC_ALL": "POSIX", "PYTHONUTF8": "0"}
    prints = "from loom.launch import cli; cli._run_command = lambda argv: print('caf\\xe9'); cli.main([])"
    result = subprocess.run([sys.executable, "-c", prints], capture_output=True, text=True, env=ascii_locale)
    assert (result.returncode, result.stdout, result.stderr) == (0, "caf\\xe9\n", "")
    floods = (
        "from loom.launch import cli; cli._run_command = lambda argv: [print(i) for i in range(10**6)]; cli.main([])"
    )
    reader = subprocess.Popen([sys.executable, "-c", floods], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout.readline() == b"0\n"
    reader.stdout.close()  # what `| head -1` does
    assert reader.wait(timeout=60) == 141 and reader.stderr.read() == b""


def test_python_dash_m_loom_is_the_loom_command():
    """`python -m loom` (and so `torchrun ... -m loom train`) said 'No module named loom.__main__'."""
    result = subprocess.run([sys.executable, "-m", "loom", "train", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("usage: loom train"), result.stderr


def test_an_inductor_cache_that_cannot_be_made_is_named(dataset, tmp_path, capfd, monkeypatch):
    """torch makes TORCHINDUCTOR_CACHE_DIR on import: an unwritable one failed training as 'X: No such file or
    directory' (the variable unnamed), with a traceback of the rank server after it."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "file" / "cache"))
    result = loom_here(capfd, "train", *tiny_train_args(dataset, tmp_path / "run"))
    one_line_error(result, f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'file' / 'cache'} cannot be made (Not a directory)")


def test_a_run_lock_taken_on_a_removed_lock_file_takes_the_new_one(tmp_path, monkeypatch):
    """A failed launch's cleanup may unlink the lock file between another launch's open and its lock: that launch
    then held a lock on a file no one else could see, and a third took the new one beside it."""
    from loom.engine import run_lock

    real_try_lock, removed = run_lock._try_lock, []

    def unlinked_first(fd: int):
        if not removed:
            removed.append((tmp_path / run_lock.LOCK_FILE).unlink())
        return real_try_lock(fd)

    monkeypatch.setattr(run_lock, "_try_lock", unlinked_first)
    held = run_lock.RunLock(tmp_path)
    monkeypatch.setattr(run_lock, "_try_lock", real_try_lock)
    assert removed and run_lock.holder_of(tmp_path) is not None  # the file that is there now is the one held
    with pytest.raises(run_lock.RunDirectoryInUse):
        run_lock.RunLock(tmp_path)
    held.close()


def test_what_needs_a_gpu_is_refused_only_where_the_ranks_have_none(dataset, tmp_path):
    """`loom submit` runs the checks on a login node, often without GPUs, for ranks that run on GPU nodes: FP8 and
    an SDPA backend are refused only when the ranks will have no GPU (here: this machine, or a CPU partition),
    and FP8's shapes are checked either way."""
    from training_runs import tiny_config

    from loom.engine.config import ConfigError
    from loom.engine.preflight import preflight

    def config(**train):
        return tiny_config(dataset, tmp_path / "run", train={"precision": "bf16", "fp8": "current", **train})

    preflight(config(), 1, ranks_have_cuda=True)  # a GPU partition: nothing to refuse from here
    for ranks_have_cuda in (None, False):  # this CPU machine's own ranks; a partition without GPUs
        with pytest.raises(ConfigError, match="train.fp8 = current is unavailable: fp8: no CUDA device"):
            preflight(config(), 1, ranks_have_cuda=ranks_have_cuda)
    with pytest.raises(ConfigError, match=r"tokens per micro-batch \(seq_length \* micro_batch_size\) = 120"):
        preflight(config(seq_length=120, micro_batch_size=1), 1, ranks_have_cuda=True)

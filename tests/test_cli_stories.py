"""A new user's careless commands after training (issue #30), each as the command line a user types: settings that
would silently train the wrong model, commands that would write into another run's checkpoints, generation that
stops short without a word, files that are not what they claim, and the rough edges around them. Each asserts
the one-line refusal (exit 2) or the stated outcome, and that nothing was overwritten.

One small run (2 layers, 64 positions, a recorded tokenizer) and one LoRA run on it serve every story; the
argument sweep of every command is tests/test_cli_sweep.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from training_runs import loom, loom_here, one_line_error, read_metrics, tiny_train_args

from loom.engine.checkpoint.format import find_loadable, read_metadata
from loom.engine.data.indexed import index_paths
from loom.launch.cli import main
from loom.launch.local import SIGNAL_CAUSES

POSITIONS = 64


def run(capfd, *argv: str) -> tuple[int, str, str]:
    """`loom ARGV` in this process (training_runs.loom_here): (exit status, stdout, stderr)."""
    result = loom_here(capfd, *argv)
    return result.returncode, result.stdout, result.stderr


def refused(capfd, argv: list[str], *fragments: str) -> None:
    """`loom ARGV` (in this process) fails as the user's mistake: exit 2, one line `error: ...` with each fragment."""
    code, out, err = run(capfd, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out + err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def checkpoints_of(run_dir: Path) -> dict[str, str]:
    """What a run's checkpoints folder holds: entry names, and `latest`'s text."""
    folder = run_dir / "checkpoints"
    return {p.name: (p.read_text() if p.is_file() else "dir") for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def world(tmp_path_factory, markov_dataset):
    """A 2-layer run of 2 steps with a tokenizer recorded, a checkpoint at each step; a LoRA run on it; its
    Hugging Face export; and a second tokenizer that the model never saw."""
    from loom.data_tools.tokenizer import train_tokenizer
    from loom.tools.hf import export_hf

    root = tmp_path_factory.mktemp("stories")
    docs = root / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "line {i}: def f(x): return x * {i} + 1"}}\n' for i in range(300)))
    train_tokenizer([docs], root / "tok", vocab_size=300, progress=False)
    train_tokenizer([docs], root / "other", vocab_size=320, progress=False)
    dataset = markov_dataset(50, vocab_size=300)  # token ids tok.model has (training checks they fit it)
    model = ["--model.num_layers", "2", "--model.max_position_embeddings", str(POSITIONS)]
    shape = ["--train.seq_length", "32", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]
    base = root / "base"
    main(
        [
            "train",
            *tiny_train_args(dataset, base, *model, *shape, "--train.steps", "2", "--checkpoint.interval", "1"),
            "--data.tokenizer",
            str(root / "tok.model"),
        ]
    )
    lora = root / "lora"
    lora_args = ["--lora.rank", "4", "--lora.base", str(base)]
    main(
        [
            "train",
            *tiny_train_args(dataset, lora, *shape, "--train.steps", "2", "--checkpoint.interval", "2"),
            *lora_args,
        ]
    )
    export_hf(base, root / "hf")
    return {"root": root, "dataset": dataset, "base": base, "lora": lora, "hf": root / "hf", "shape": shape}


def test_lora_settings_without_a_rank_are_refused_before_anything_runs(world, capfd, tmp_path):
    """`--lora.base` alone used to train a fresh model (step-1 loss ln V) and exit 0."""
    result = loom("train", *tiny_train_args(world["dataset"], tmp_path / "run"), "--lora.base", str(world["base"]))
    one_line_error(result, "lora.base is set but lora.rank is 0 (no adapters): add --lora.rank R")
    assert not (tmp_path / "run").exists()
    # a setting given at its default value changes nothing the config can see, and trained a fresh model too
    refused(
        capfd,
        ["train", *tiny_train_args(world["dataset"], tmp_path / "run"), "--lora.alpha", "16"],
        "--lora.alpha is given",
    )
    huge = ["--lora.rank", "100000", "--lora.base", str(world["base"])]
    refused(
        capfd,
        ["train", *tiny_train_args(world["dataset"], tmp_path / "run"), *huge],
        "lora.rank = 100000 exceeds the adapted layers' smallest side (model.hidden_size = 128)",
    )


def test_a_lora_runs_printed_config_is_the_bases_model_with_the_positions_asked_for(world, capfd, tmp_path):
    """--print-config showed the preset's 4 layers for a 2-layer base, and an explicit
    --model.max_position_embeddings was replaced by the base's (RoPE has no position weights to keep)."""
    args = tiny_train_args(world["dataset"], tmp_path / "run", "--lora.rank", "4", "--lora.base", str(world["base"]))
    longer = ["--model.max_position_embeddings", "256", "--train.seq_length", "128"]
    code, out, _ = run(capfd, "train", *args, *longer, "--print-config")
    assert code == 0
    assert "num_layers = 2" in out and "max_position_embeddings = 256" in out and "seq_length = 128" in out


def test_checkpoint_writers_refuse_another_runs_folder_unless_told_to_replace_it(world, capfd, tmp_path):
    """merge-lora and import-hf into RUN/checkpoints used to write iter_0000000 and repoint `latest` (the run then
    resumed at step 0 of another model); an iter_N written into RUN itself was found before RUN's checkpoints."""
    base, lora, hf = world["base"], world["lora"], world["hf"]
    before = checkpoints_of(base)
    into_checkpoints, into_run = ["--output", str(base / "checkpoints")], ["--output", str(base)]
    for args, message in (
        (["ckpt", "merge-lora", "--checkpoint", str(lora), *into_checkpoints], "is training run"),
        (["ckpt", "import-hf", "--input", str(hf), *into_checkpoints], "is training run"),
        (["ckpt", "merge-lora", "--checkpoint", str(lora), *into_run], "is a training run's directory"),
        (
            ["ckpt", "reshard", "--checkpoint", str(lora), *into_run, "--parallel.tp", "2", "--parallel.pp", "1"],
            "is a training run's directory",
        ),
        (["ckpt", "export-hf", "--checkpoint", str(lora), *into_run], "is a training run's directory"),
        # nested in an iter_N, the new checkpoint was shadowed by the outer one; merged beside an HF export
        (
            ["ckpt", "merge-lora", "--checkpoint", str(lora), "--output", str(base / "checkpoints/iter_0000001")],
            "is inside the checkpoint",
        ),
        (["ckpt", "merge-lora", "--checkpoint", str(lora), "--output", str(hf)], "holds a Hugging Face model"),
    ):
        refused(capfd, args, message)
    one_line_error(loom("ckpt", "merge-lora", "--checkpoint", str(lora), *into_checkpoints), "is training run")
    # --overwrite moved a live run's checkpoints aside and repointed its `latest`; its retention then deleted ours
    from loom.engine.run_lock import RunLock

    importing_into_link = ["ckpt", "import-hf", "--input", str(hf), "--output", str(tmp_path / "link")]
    live = RunLock(base)
    (tmp_path / "link").symlink_to(base / "checkpoints")  # the same folder by another name
    try:
        for args in (["ckpt", "merge-lora", "--checkpoint", str(lora)], ["ckpt", "import-hf", "--input", str(hf)]):
            refused(capfd, [*args, *into_checkpoints, "--overwrite"], f"{base}, in use by a running loom run (pid")
        refused(capfd, [*importing_into_link, "--overwrite"], f"{base.resolve()}, in use by a running loom run")
    finally:
        live.close(remove_if_created=True)
    assert checkpoints_of(base) == before
    assert "iter_0000000" not in before and before["latest"] == "iter_0000002\n"

    imported = tmp_path / "imported"
    importing = ["ckpt", "import-hf", "--input", str(hf), "--output", str(imported)]
    assert run(capfd, *importing)[0] == 0
    first = (imported / "iter_0000000" / "metadata.json").read_text()
    refused(capfd, importing, "holds checkpoints")
    code, out, err = run(capfd, *importing, "--overwrite")
    assert code == 0 and "--overwrite: the checkpoints in" in out, err
    (aside,) = (imported / "replaced").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000000", "latest"]
    assert (aside / "iter_0000000" / "metadata.json").read_text() == first  # kept, not deleted
    assert find_loadable(imported)[0] == imported / "iter_0000000"
    assert read_metadata(imported / "iter_0000000").hf_source == str(hf.resolve())
    # a folder whose checkpoints/ a tool wrote is no training run (it was called one)
    tool_written = tmp_path / "tool-written" / "checkpoints"
    assert run(capfd, "ckpt", "import-hf", "--input", str(hf), "--output", str(tool_written))[0] == 0
    refused(capfd, [*importing[:-1], str(tool_written)], f"--output {tool_written} is {tool_written.parent}'s checkpo")


def test_generate_says_how_many_tokens_and_why_it_stopped(world, capfd):
    """A prompt near the model's positions used to give a few tokens (or none, past them) without a word."""
    base = str(world["base"])
    prompt = " ".join(str(i) for i in range(1, 61))
    code, out, err = run(capfd, "generate", "--checkpoint", base, "--prompt-ids", prompt, "--max-new-tokens", "50")
    assert code == 0 and out  # decoded with the tokenizer training recorded
    assert err.strip() == (
        f"generated 5 of up to 50 tokens after a 60-token prompt; stopped at the model's {POSITIONS} positions "
        "(model.max_position_embeddings)"
    )
    code, out, err = run(capfd, "generate", "--checkpoint", base, "--prompt-ids", "1,2,3", "--max-new-tokens", "4")
    assert code == 0 and err.startswith("generated 4 of up to 4 tokens after a 3-token prompt; stopped at --max-new")
    # a tiny temperature samples what greedy picks (it was a traceback: logits / 1e-40 overflowed to inf)
    greedy = out
    code, out, err = run(
        capfd,
        "generate",
        "--checkpoint",
        base,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
        "--temperature",
        "1e-40",
    )
    assert code == 0 and out == greedy, err
    # smaller still, 0 in fp32: the logits were divided by 0 (a traceback: 'probability tensor contains nan')
    code, out, err = run(capfd, *["generate", "--checkpoint", base, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"],
                         "--temperature", "5e-324")  # fmt: skip
    assert code == 0 and out == greedy, err
    refused(
        capfd,
        ["generate", "--checkpoint", base, "--prompt-ids", "1", "--nproc", "3", "--parallel.tp", "3"],
        "parallel.tp = 3 must divide model.num_heads = 8",
    )
    code, _, err = run(capfd, "generate", "--checkpoint", base, "--prompt-ids", " ".join(["5"] * (POSITIONS + 1)))
    assert code == 2 and err.startswith(f"error: the prompt has {POSITIONS + 1} tokens but the model has {POSITIONS}")


def test_small_things_the_after_training_sweep_found(world, capfd, tmp_path):
    """An empty --prompt-ids said "the token ids must lie in [0, V); got []"; a file as --checkpoint "no intact
    checkpoint"; reshard needed both --parallel.tp and --parallel.pp (either alone defaults the other to 1)."""
    base = str(world["base"])
    refused(capfd, ["generate", "--checkpoint", base, "--prompt-ids", " , "], "--prompt-ids is empty")
    notes = tmp_path / "notes.toml"
    notes.write_text("")
    refused(
        capfd, ["generate", "--checkpoint", str(notes), "--prompt-ids", "1"], f"{notes} is a file; give a checkpoint"
    )
    code, out, err = run(capfd, "ckpt", "reshard", "--checkpoint", base, "--output", str(tmp_path / "pp1"))
    assert code == 0 and "for tp=1 pp=1 vp=1" in out, err


def test_generate_on_ranks_names_a_killed_rank_and_leaves_none_behind(world, capfd, monkeypatch):
    """A rank the OOM killer ends reports nothing: `loom generate --nproc` waited for it forever (all ranks killed),
    or printed its peer's 'connection closed' traceback (one killed)."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    monkeypatch.setenv("LOOM_INJECT_KILL", "1:2")  # rank 1 SIGKILLs itself before its third token
    argv = ["generate", "--checkpoint", str(world["base"]), "--prompt-ids", "1 2", "--nproc", "2", "--parallel.tp", "2"]
    code, _, err = run(capfd, *argv)
    assert code == 1 and err.strip().splitlines() == [
        f"error: rank 1 failed: killed by SIGKILL{SIGNAL_CAUSES['SIGKILL']}"
    ], err
    assert set(multiprocessing.active_children()) <= before
    # a stop sent to one rank is a stop, not a failure (it was each rank's traceback, then 'interrupted')
    for name in ("INT", "TERM"):
        monkeypatch.setenv("LOOM_INJECT_KILL", f"1:2:{name}")
        code, _, err = run(capfd, *argv)
        number = getattr(signal, f"SIG{name}")
        assert (code, err) == (128 + number, f"stopped by SIG{name} (sent to rank 1) before the generation finished\n")
        assert set(multiprocessing.active_children()) <= before


def test_generate_on_ranks_checks_the_checkpoint_once_and_leaves_the_model_to_them(
    world, capfd, monkeypatch, live_tensors
):
    """`loom generate --nproc N` built the whole model in the launching process before the ranks loaded their parts
    (a model split because it does not fit one process), and the launcher hashed its files twice (and every rank
    again: the ranks, forked from the rank server, are beyond this test's count; they read without hashing)."""
    from loom.engine.checkpoint import format as checkpoint_format
    from loom.tools.lora import ModelWeights

    hash_file, hashed = checkpoint_format.sha256_of, []
    monkeypatch.setattr(checkpoint_format, "sha256_of", lambda path: hashed.append(path.name) or hash_file(path))
    built = live_tensors(ModelWeights, "__getitem__")
    argv = ["generate", "--checkpoint", str(world["base"]), "--prompt-ids", "1 2", "--nproc", "2", "--parallel.tp", "2"]
    code, _, err = run(capfd, *argv)
    directory = checkpoint_format.find_loadable(world["base"], verify_hashes=False)[0]
    assert code == 0 and err.startswith("generated "), err
    checked = sorted(name for name in hashed if name.endswith(".safetensors"))
    assert checked == sorted(checkpoint_format.read_metadata(directory, verify_hashes=False).files)
    assert built.made == 0


def test_generate_on_ranks_ends_a_rank_whose_stop_was_lost(world, capfd, monkeypatch):
    """A SIGTERM that reaches a rank before Python's fork handling has run in it is dropped: the command then waited
    for that rank forever (here rank 0 sleeps where its peer failed, and every SIGTERM to a rank is lost)."""
    import multiprocessing

    from loom.engine.faults import InjectedFault
    from loom.engine.parallel import rendezvous

    before = set(multiprocessing.active_children())
    monkeypatch.setattr(rendezvous.rank_context().Process, "terminate", lambda process: None)
    monkeypatch.setenv("LOOM_INJECT_FAULT", "1:2")
    monkeypatch.setenv("LOOM_INJECT_HANG", "0:2")
    argv = ["generate", "--checkpoint", str(world["base"]), "--prompt-ids", "1 2", "--nproc", "2", "--parallel.tp", "2"]
    with pytest.raises(InjectedFault, match="at step 2"):  # a bug's exception, raised as it is
        run(capfd, *argv)
    assert set(multiprocessing.active_children()) <= before


def test_eval_from_another_directory_finds_the_tokenizer_the_checkpoint_recorded(world, capfd, tmp_path, monkeypatch):
    """A run trained with a relative --data.tokenizer could not be evaluated from elsewhere ('data.tokenizer tok.model
    does not exist', or another tok.model there was taken for it), though its checkpoint records where that file is."""
    import shutil

    monkeypatch.chdir(world["root"])
    args = tiny_train_args(world["dataset"], tmp_path / "run", "--model.num_layers", "2", *world["shape"])
    code, out, err = run(capfd, "train", *args, "--train.steps", "1", "--checkpoint.save_at_end", "true",
                         "--data.tokenizer", "tok.model")  # fmt: skip
    saved = tmp_path / "run" / "checkpoints" / "iter_0000001"
    size = sum(path.stat().st_size for path in saved.glob("rank*.safetensors")) / 1e6
    assert code == 0 and f"checkpoint: step 1 saved to {saved} ({size:.1f} MB in " in out, err  # a save said nothing
    monkeypatch.chdir(tmp_path)
    shutil.copy(world["root"] / "other.model", tmp_path / "tok.model")  # another tokenizer of that name here
    code, out, err = run(
        capfd, "eval", "--checkpoint", str(tmp_path / "run"), "--data", world["dataset"], "--iters", "1"
    )
    assert code == 0 and "validation loss" in out, err


def test_eval_checks_the_checkpoint_s_hashes_once(world, capfd, monkeypatch):
    """`loom eval` checked the checkpoint's files (open_checkpoint), then its evaluating rank 0 checked them again
    (checkpoint.verify): an 8B training checkpoint's minute, twice."""
    from loom.launch import local

    evaluated = []
    monkeypatch.setattr(local, "launch_local", lambda config, nproc, mode: evaluated.append(config))
    code, _, err = run(capfd, "eval", "--checkpoint", str(world["base"]), "--data", world["dataset"], "--iters", "1")
    assert code == 0 and [config.checkpoint.verify for config in evaluated] == [False], err


def test_eval_takes_the_data_spellings_training_takes(world, capfd, monkeypatch):
    """The README's one spelling per idea (--data.paths, --data.split) was refused by `loom eval`, which required
    its older --data."""
    from loom.launch import local

    evaluated = []
    monkeypatch.setattr(local, "launch_local", lambda config, nproc, mode: evaluated.append(config.data))
    for spelling in (["--data", world["dataset"], "--split", "0,1,0"], ["--data.paths", world["dataset"],
                                                                       "--data.split", "0,1,0"]):  # fmt: skip
        code, _, err = run(capfd, "eval", "--checkpoint", str(world["base"]), *spelling, "--iters", "1")
        assert code == 0, err
    assert evaluated[0] == evaluated[1] and evaluated[0].split == "0,1,0"


def test_eval_of_a_live_run_whose_retention_removes_its_checkpoint(world, capfd, tmp_path, monkeypatch):
    """`loom eval` of a run that trains on (checkpoint.keep) failed most times, the checkpoint deleted under it, as
    'checkpoint.load = ... does not exist' (never given) or a missing rank file: it evaluates the newest again."""
    import shutil

    from loom.launch import local

    run_dir = tmp_path / "live"
    shutil.copytree(world["base"], run_dir)
    real = local.launch_local

    def retention_first(config, nproc, **kwargs):
        newest = run_dir / "checkpoints" / "iter_0000002"
        pieces = sorted(newest.glob("*.safetensors"))
        if pieces and config.checkpoint.load == str(newest):  # the run's next save meanwhile: its rmtree underway
            pieces[0].unlink()
            (run_dir / "checkpoints" / "latest").write_text("iter_0000001\n")
            raise local.RankFailed(0, "No such file or directory: rank00000.safetensors", "")
        return real(config, nproc, **kwargs)

    monkeypatch.setattr(local, "launch_local", retention_first)
    evaluate = ["eval", "--data", world["dataset"], "--iters", "1", "--checkpoint"]
    code, out, err = run(capfd, *evaluate, str(run_dir))
    assert code == 0, err
    assert f"checkpoint {run_dir / 'checkpoints' / 'iter_0000002'} was removed while it was read" in out
    assert "evaluating the newest one again" in out and "step 1: validation loss" in out
    shutil.rmtree(run_dir / "checkpoints" / "iter_0000002")
    shutil.copytree(world["base"] / "checkpoints" / "iter_0000002", run_dir / "checkpoints" / "iter_0000002")
    refused(capfd, [*evaluate, str(run_dir / "checkpoints" / "iter_0000002")], "evaluate a copy of it, or when")


def test_generate_refuses_a_tokenizer_the_model_was_not_trained_with(world, capfd):
    """Another tokenizer's text used to come out as newlines; the checkpoint now records its tokenizer's sha256."""
    root, base = world["root"], str(world["base"])
    code, _, err = run(
        capfd, "generate", "--checkpoint", base, "--tokenizer", str(root / "other.model"), "--prompt", "x"
    )
    assert code == 2 and "is not the one this model was trained with" in err and err.count("\n") == 1
    # eval too: --data.tokenizer with a dataset of that tokenizer's ids scored the model on a vocabulary it never saw
    eval_other = [
        "eval",
        "--checkpoint",
        base,
        "--data",
        world["dataset"],
        "--data.tokenizer",
        str(root / "other.model"),
    ]
    refused(capfd, eval_other, "is not the one this model was trained with", "another vocabulary's ids")
    code, out, _ = run(capfd, "generate", "--checkpoint", base, "--prompt", "def f", "--max-new-tokens", "2")
    assert code == 0 and out.startswith("def f")  # its own tokenizer, found where training read it
    # --prompt-ids needs no tokenizer: with the training one gone, the output stays token ids.
    (root / "tok.model").rename(root / "tok.moved")
    try:
        code, out, _ = run(capfd, "generate", "--checkpoint", base, "--prompt-ids", "7 8", "--max-new-tokens", "2")
        assert code == 0 and out.split()[:2] == ["7", "8"] and len(out.split()) == 4
        code, _, err = run(capfd, "generate", "--checkpoint", base, "--prompt", "x")
        assert code == 2 and "is not there; pass --tokenizer T.model" in err
    finally:
        (root / "tok.moved").rename(root / "tok.model")


def test_a_moved_lora_base_is_named_with_lora_base(world, capfd, tmp_path):
    """A LoRA checkpoint points to its base's path; after a move, --lora.base says where it went (checked by sha256)."""
    base, lora = world["base"], str(world["lora"])
    moved = base.with_name("base-moved")
    base.rename(moved)
    try:
        code, _, err = run(capfd, "generate", "--checkpoint", lora, "--prompt-ids", "1 2", "--max-new-tokens", "2")
        assert code == 2 and "is gone; its adapters need it (moved? pass --lora.base NEW_PLACE)" in err
        code, out, _ = run(
            capfd,
            "generate",
            "--checkpoint",
            lora,
            "--prompt-ids",
            "1 2",
            "--max-new-tokens",
            "2",
            "--lora.base",
            str(moved),
        )
        assert code == 0 and len(out.split()) == 4
        out_dir = tmp_path / "adapter"
        code, out, _ = run(
            capfd, "ckpt", "export-hf", "--checkpoint", lora, "--adapter-only", "--output", str(out_dir),
            "--lora.base", str(moved), "--base-model", "org/tiny",
        )  # fmt: skip
        assert (
            code == 0
            and json.loads((out_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/tiny"
        )
        code, _, err = run(
            capfd,
            "ckpt",
            "merge-lora",
            "--checkpoint",
            lora,
            "--output",
            str(tmp_path / "m"),
            "--lora.base",
            str(world["hf"]),
        )
        assert code == 2 and "holds no intact checkpoint" in err
    finally:
        moved.rename(base)


def test_a_merged_fine_tune_exports_with_the_tokenizer_its_base_trained_with(world, capfd, tmp_path):
    """export-hf wrote no tokenizer: AutoTokenizer could not load the folder (test_hf checks its encoding)."""
    merged, out = tmp_path / "merged", tmp_path / "hf"
    assert run(capfd, "ckpt", "merge-lora", "--checkpoint", str(world["lora"]), "--output", str(merged))[0] == 0
    code, said, _ = run(capfd, "ckpt", "export-hf", "--checkpoint", str(merged), "--output", str(out))
    assert code == 0 and "+ the tokenizer (AutoTokenizer loads it)" in said, said
    assert (out / "tokenizer.model").read_bytes() == (world["root"] / "tok.model").read_bytes()
    # the tokenizer moved since: the export says so, and --tokenizer gives its new place (checked by its sha256)
    trained_with, moved = world["root"] / "tok.model", world["root"] / "tok-moved.model"
    trained_with.rename(moved)
    try:
        code, _, err = run(capfd, "ckpt", "export-hf", "--checkpoint", str(merged), "--output", str(tmp_path / "a"))
        assert code == 0 and "is gone or has changed (moved? give its new place with --tokenizer)" in err, err
        told = ["ckpt", "export-hf", "--checkpoint", str(merged), "--output", str(tmp_path / "b"), "--tokenizer"]
        assert run(capfd, *told, str(moved))[0] == 0 and (tmp_path / "b/tokenizer.model").exists()
        refused(capfd, [*told, str(world["root"] / "other.model")], "is not the tokenizer this model was trained with")
    finally:
        moved.rename(trained_with)


def test_a_checkpoint_from_before_tokenizer_records_exports_its_configs_tokenizer(world, capfd, tmp_path):
    """Checkpoints written before loom recorded their tokenizer (its path and sha256) name it only in their config's
    data.tokenizer: export-hf wrote no tokenizer and said nothing, and refused --tokenizer ('records no tokenizer
    to check it against ... drop --tokenizer'). It exports the config's, saying it could not be checked."""
    old = tmp_path / "old"
    shutil.copytree(world["base"] / "checkpoints", old)
    for metadata_file in old.glob("iter_*/metadata.json"):
        metadata = json.loads(metadata_file.read_text())
        assert metadata.pop("tokenizer")["path"] == metadata["config"]["data"]["tokenizer"]
        metadata_file.write_text(json.dumps(metadata))
    code, said, err = run(capfd, "ckpt", "export-hf", "--checkpoint", str(old), "--output", str(tmp_path / "hf"))
    assert code == 0 and "+ the tokenizer (AutoTokenizer loads it)" in said, said + err
    assert "records no checksum of its tokenizer" in err and "unchecked" in err, err
    assert (tmp_path / "hf/tokenizer.model").read_bytes() == (world["root"] / "tok.model").read_bytes()
    told = ["ckpt", "export-hf", "--checkpoint", str(old), "--output", str(tmp_path / "b"), "--tokenizer"]
    code, _, err = run(capfd, *told, str(world["root"] / "tok.model"))
    assert code == 0 and (tmp_path / "b/tokenizer.model").exists() and "unchecked" in err, err
    # unchecked, yet not any tokenizer: one with more pieces than the model has ids is not the one it trained with
    from loom.tools.hf_tokenizer import unfit_tokenizer

    said = unfit_tokenizer(world["root"] / "other.model", 300)  # a small corpus gave it 316 of the 320 asked
    assert said.endswith("pieces exceed the model's vocab_size 300: not the tokenizer it trained with"), said
    assert unfit_tokenizer(world["root"] / "tok.model", 300) is None


def _hf_copy(world, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(world["hf"], copy)
    return copy


def test_a_hugging_face_folder_given_as_a_checkpoint_says_to_import_it(world, capfd):
    hint = f"it is a Hugging Face model: import it first, loom ckpt import-hf --input {world['hf']} --output DIR"
    refused(capfd, ["generate", "--checkpoint", str(world["hf"]), "--prompt-ids", "1 2"], "no intact checkpoint", hint)
    refused(capfd, ["ckpt", "inspect", str(world["hf"])], hint)


def test_import_hf_names_what_is_wrong_with_the_folder(world, capfd, tmp_path):
    truncated = _hf_copy(world, tmp_path, "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    malformed = _hf_copy(world, tmp_path, "malformed")
    (malformed / "config.json").write_text('{"model_type": "llama",')
    no_weights = _hf_copy(world, tmp_path, "no-weights")
    (no_weights / "model.safetensors").rename(no_weights / "pytorch_model.bin")
    missing_key = _hf_copy(world, tmp_path, "missing-key")
    config = json.loads((missing_key / "config.json").read_text())
    del config["hidden_size"]
    (missing_key / "config.json").write_text(json.dumps(config))
    fewer_layers = _hf_copy(world, tmp_path, "fewer-layers")  # imported as a 1-layer model, layer 1 dropped
    config = json.loads((fewer_layers / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (fewer_layers / "config.json").write_text(json.dumps(config))
    for folder, message in (
        (truncated, "is not a readable safetensors file (truncated?)"),
        (malformed, "config.json is not valid JSON"),
        (no_weights, "holds no *.safetensors weights (found pytorch_model.bin"),
        (missing_key, "config.json has no 'hidden_size'"),
        (fewer_layers, "does not describe (model.layers.1.input_layernorm.weight, "),
    ):
        refused(capfd, ["ckpt", "import-hf", "--input", str(folder), "--output", str(tmp_path / "out")], message)
        assert not (tmp_path / "out").exists()


def test_import_hf_reads_rope_settings_as_transformers_does(world, capfd, tmp_path):
    """A config with rope_scaling beside rope_parameters: transformers takes rope_scaling whole, so loom does too
    (llama3 and yarn scaling are imported; dynamic NTK, which loom lacks, is refused instead of imported as default
    RoPE)."""
    transformers = pytest.importorskip("transformers")
    from loom.tools.hf import import_hf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # fmt: skip
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    for name, rope_scaling in (("llama3", scaling), ("yarn", yarn), ("dynamic", {"rope_type": "dynamic", "factor": 4})):
        folder = _hf_copy(world, tmp_path, name)
        config = json.loads((folder / "config.json").read_text())
        config.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_scaling=rope_scaling)
        (folder / "config.json").write_text(json.dumps(config))
        theirs = transformers.AutoConfig.from_pretrained(folder).rope_parameters
        capfd.readouterr()  # transformers' own warning about yarn's factor (once a process): not loom's output
        assert theirs["rope_type"] == name
        if name in ("llama3", "yarn"):
            model = read_metadata(import_hf(folder, tmp_path / f"out-{name}")).config["model"]
            assert model["rope_scaling"] == name and model["rope_scaling_factor"] == theirs["factor"]
        else:
            refused(
                capfd,
                ["ckpt", "import-hf", "--input", str(folder), "--output", str(tmp_path / "out")],
                "rope_type 'dynamic' is not supported",
            )


def test_data_commands_refuse_what_training_would(world, capfd, tmp_path):
    dataset = world["dataset"]
    code, _, err = run(capfd, "data", "index", "--config", "tiny", "--data.paths", dataset, "--parallel.tp", "3")
    assert code == 2 and err.startswith("error: parallel.tp = 3 must divide model.num_heads = 8")
    context = ["data", "index", "--config", "tiny", "--data.paths", dataset, "--parallel.cp", "2"]
    code, _, err = run(capfd, *context, "--train.seq_length", "16")  # was refused: its world left cp out
    assert code == 0, err
    unwritable = str(Path(world["hf"]) / "config.json" / "cache")
    code, _, err = run(
        capfd, "data", "index", "--config", "tiny", "--data.paths", dataset, "--data.cache_dir", unwritable
    )
    assert code == 2 and err.count("\n") == 1 and "cannot write the GPTDataset index cache" in err
    code, out, _ = run(capfd, "data", "preview", "--help")
    assert "default: the config's, 2048 without one" in " ".join(out.split())
    shown = [
        run(capfd, "data", "preview", "--data", dataset, flag, "16", "--samples", "2")[1]
        for flag in ("--seq-length", "--train.seq_length")
    ]
    assert shown[0] == shown[1] and "seq_length 16" in shown[0]


def test_a_run_saves_its_last_step_says_the_time_left_and_names_an_optimizer_switch(world, capfd, tmp_path):
    """With the default checkpoint settings a run used to end with no checkpoint and no word; a job cut short by
    train.exit_after said ETA 0m00s; resuming under another optimizer dropped its state silently."""
    dataset, run_dir = world["dataset"], tmp_path / "run"
    args = [
        "train", "--config", "tiny", "--data.paths", dataset, "--data.tokenizer", "none",
        "--train.run_dir", str(run_dir), "--train.log_interval", "1", "--train.eval_interval", "0",
        "--train.tensorboard", "false", *world["shape"],
        "--model.num_layers", "2", "--train.steps", "1000", "--train.exit_after", "2",
        "--train.wandb_project", "loom-test", "--train.wandb_mode", "disabled",
    ]  # fmt: skip
    code, out, _ = run(capfd, *args)
    assert code == 0 and [row["step"] for row in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_0000002\n"
    last = [line for line in out.splitlines() if line.startswith("step      2/1000")][0]
    assert "ETA" in last and "ETA 0m00s" not in last  # 998 steps left, not the 0 left in this job
    assert not (run_dir / "wandb").exists()
    resume = [*args, "--optim.name", "sgd", "--train.exit_after", "0", "--train.steps", "4"]
    code, out, _ = run(capfd, *resume, "--parallel.sequence_parallel", "true")
    assert code == 0 and [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert "was trained with adamw; its optimizer state does not carry over to sgd" in out
    assert "warning: parallel.sequence_parallel = True has no effect with parallel.tp = 1" in out  # silent before
    code, out, _ = run(capfd, *args, "--optim.name", "sgd", "--train.exit_after", "0", "--train.steps", "4")
    assert code == 0 and "is complete at step 4 of train.steps = 4; raise --train.steps to continue it" in out


def test_old_and_new_spellings_mean_the_same(world, capfd, tmp_path):
    """One spelling per idea across commands (--checkpoint, --parallel.tp, --train.seq_length); the old ones work."""
    base = str(world["base"])
    for i, spelling in enumerate((["--checkpoint", base, "--parallel.tp", "2"], ["--input", base, "--tp", "2"])):
        code, _, err = run(
            capfd, "ckpt", "reshard", *spelling, "--parallel.pp", "1", "--output", str(tmp_path / str(i))
        )
        assert code == 0, err
    assert read_metadata(tmp_path / "0" / "iter_0000002").specs == read_metadata(tmp_path / "1" / "iter_0000002").specs


def test_data_commands_never_write_over_files_already_there(capfd, dataset, tmp_path, monkeypatch):
    """A data command's output that exists (the same command's earlier output, or another command's files sharing
    the prefix) is refused unless --overwrite, which moves it into replaced/<time>/; an output holding one of the
    command's inputs is refused even then (a preview once wrote its JSONL over the .bin it was reading)."""
    corpus = tmp_path / "c.jsonl"
    assert run(capfd, "data", "corpus", "--output", str(corpus), "--max-docs", "3")[0] == 0
    before = corpus.read_bytes()
    refused(capfd, ["data", "corpus", "--output", str(corpus), "--max-docs", "2"], "would replace existing files")
    assert corpus.read_bytes() == before
    code, out, err = run(capfd, "data", "corpus", "--output", str(corpus), "--max-docs", "2", "--overwrite")
    assert code == 0 and "--overwrite: moved c.jsonl, c.jsonl.manifest.json to" in out, err
    [aside] = (tmp_path / "replaced").iterdir()
    assert (aside / "c.jsonl").read_bytes() == before and corpus.read_bytes() != before

    prefix = tmp_path / "ds"
    for path in index_paths(dataset):
        shutil.copy(path, prefix.with_suffix(path.suffix))
    data = prefix.with_suffix(".bin")
    before = data.read_bytes()
    preview = ["data", "preview", "--data.paths", str(prefix), "--train.seq_length", "16", "--samples", "1"]
    refused(capfd, [*preview, "--output", str(data), "--overwrite"], f"holds {data}, an input")
    refused(capfd, ["data", "merge", "--inputs", str(prefix), "--output-prefix", str(prefix)], "is one of the inputs")
    # a prefix given twice merged its documents twice (exit 0), as a JSONL file given twice is refused
    twice = ["data", "merge", "--inputs", str(prefix), f"{tmp_path}/./ds", "--output-prefix", str(tmp_path / "m")]
    refused(capfd, twice, f"--inputs gives {prefix} and {tmp_path}/./ds twice")
    monkeypatch.chdir(
        tmp_path
    )  # equal strings may be one object (one-letter ones, interned): an identity check passed them
    refused(capfd, ["data", "merge", "--inputs", "ds", "ds", "--output-prefix", "m"], "--inputs gives ds twice")
    for suffix in (".bin", ".idx"):  # a symlinked copy is the same documents (merged twice, exit 0)
        (tmp_path / f"linked{suffix}").symlink_to(prefix.with_suffix(suffix))
    refused(
        capfd,
        ["data", "merge", "--inputs", "ds", "linked", "--output-prefix", "m"],
        "--inputs gives ds and linked twice",
    )
    assert data.read_bytes() == before

    folder = tmp_path / "clean"
    clean = ["data", "clean", "--input", str(corpus), "--output", str(folder), "--pipeline", "code", "--workers", "1"]
    assert run(capfd, *clean)[0] == 0
    refused(capfd, clean, "would replace existing files")
    kept = folder / "kept.jsonl"
    refused(capfd, [*clean[:3], str(kept), *clean[4:], "--overwrite"], f"holds {kept}, an input")


def test_a_rerun_removes_what_a_killed_run_of_it_left_on_this_machine(capfd, tmp_path):
    """SIGKILL (the OOM killer) leaves a command no chance to remove its temporary files: a rerun of data clean was
    refused for the killed run's staging folder, a finished export-hf folder kept a full-size temporary file beside
    the model (an upload took it along), a corpus its temporary .jsonl.gz. The next writer removes what a process of
    this machine that is gone left; a live process's, and another machine's, stay."""
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    host, alive = socket.gethostname(), os.getppid()
    folder = tmp_path / "clean"
    for name in (f".staging-{host}-{gone.pid}", f".staging-{host}-{alive}", f".staging-elsewhere-{gone.pid}"):
        (folder / name).mkdir(parents=True)
        (folder / name / "kept.jsonl").write_text("{}\n")
    corpus = tmp_path / "c.jsonl"
    leftovers = [tmp_path / f".c.jsonl.{host}-{gone.pid}.tmp", tmp_path / f".c.jsonl.{host}-{alive}.tmp"]
    for leftover in leftovers:
        leftover.write_text("half")
    assert run(capfd, "data", "corpus", "--output", str(corpus), "--max-docs", "3")[0] == 0
    assert [path.exists() for path in leftovers] == [False, True]
    clean = ["data", "clean", "--input", str(corpus), "--output", str(folder), "--pipeline", "code", "--workers", "1"]
    refused(capfd, clean, "would replace existing files", ".staging-elsewhere-")  # not this machine's to judge
    shutil.rmtree(folder / f".staging-elsewhere-{gone.pid}")
    refused(capfd, clean, f".staging-{host}-{alive}", "a command's unfinished output: one still running")  # live
    shutil.rmtree(folder / f".staging-{host}-{alive}")
    (folder / f".staging-{host}-{gone.pid}").mkdir()
    code, out, err = run(capfd, *clean)
    assert code == 0, err
    assert f"removed .staging-{host}-{gone.pid}, left by a command on this machine that was killed" in out
    assert sorted(path.name for path in folder.iterdir() if path.name.startswith(".")) == []


def test_a_data_command_is_refused_while_another_writes_its_output(world, capfd, tmp_path, monkeypatch):
    """Two builds into one prefix renamed their temporary files over each other's (the second exited 0, the
    dataset was torn: a .bin of another size, no .idx); a clean --overwrite beside a running clean moved its
    staging away and each then cleaned up the other's outputs. The writer's lock refuses the second in one line:
    one lock per place however it is spelled, and per prefix whichever command writes it (a tokenizer and a
    dataset of one prefix share its manifest)."""
    from loom.engine.run_lock import writing_output

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "c.jsonl"
    assert run(capfd, "data", "corpus", "--output", str(corpus), "--max-docs", "3")[0] == 0
    build = ["data", "build", "--input", str(corpus), "--tokenizer", str(world["root"] / "tok.model")]
    clean = ["data", "clean", "--input", str(corpus), "--pipeline", "code"]
    with writing_output(tmp_path / "x.manifest.json", "data tokenizer"):  # as `loom data tokenizer --output x` holds
        lock = tmp_path / ".x.manifest.json.loom-lock"
        assert json.loads(lock.read_text())["command"] == "data tokenizer"
        for spelled in (str(tmp_path / "x"), "./x", "x"):
            refused(
                capfd,
                [*build, "--output-prefix", spelled],
                f"--output-prefix {spelled} is being written by `loom data tokenizer` (pid",
            )
        assert sorted(p.name for p in tmp_path.iterdir()) == [lock.name, "c.jsonl", "c.jsonl.manifest.json"]
        with writing_output(tmp_path / "new" / "clean", "data clean"):
            refused(capfd, [*clean, "--output", "new/clean", "--overwrite"], "is being written by `loom data clean`")
        assert run(capfd, *build, "--output-prefix", "y")[0] == 0  # another prefix is free
    assert not lock.exists() and not (tmp_path / "new").exists()  # the lock and the folders made for it are gone
    assert run(capfd, *build, "--output-prefix", "x")[0] == 0
    # a lock file a killed command left is nobody's output: no refusal, nothing moved aside for it
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / ".ds.manifest.json.loom-lock").write_text("{}")
    assert run(capfd, *clean, "--output", str(stale))[0] == 0 and not (stale / "replaced").exists()
    assert sorted(p.name for p in tmp_path.rglob("*.loom-lock")) == [".ds.manifest.json.loom-lock"]
    # the checkpoint tools too: two reshards into one folder shared iter_N.tmp, each clearing the other's files
    reshard = ["ckpt", "reshard", "--checkpoint", str(world["base"]), "--output", "rs", "--tp", "1", "--pp", "1"]
    with writing_output(tmp_path / "rs", "ckpt reshard"):
        refused(capfd, reshard, "--output rs is being written by `loom ckpt reshard` (pid")
    assert run(capfd, *reshard)[0] == 0 and not (tmp_path / ".rs.loom-lock").exists()


def test_a_full_disk_under_a_checkpoint_tool_is_one_line_and_leaves_no_staging(world, capfd, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError: export-hf, reshard, import-hf and merge-lora
    ended in a 16-line traceback (exit 1), a reshard's iter_N.tmp left behind. Now the OSError it is, in one line.
    They write through loom's own streaming writer now: the disk fills after its first bytes."""
    from loom.engine import atomic

    class FillsUp:
        def __init__(self, path, mode):
            self.file = open(path, mode)  # noqa: SIM115 - closed by __exit__

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(b"the first bytes")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "open", FillsUp, raising=False)
    base, hf, resharded = world["base"], tmp_path / "hf", tmp_path / "resharded"
    export = ["ckpt", "export-hf", "--checkpoint", str(base), "--output", str(hf)]
    refused(capfd, export, f"{hf}/model.safetensors: No space left on device; free some space, or write elsewhere")
    reshard = ["ckpt", "reshard", "--checkpoint", str(base), "--output", str(resharded), "--tp", "1", "--pp", "1"]
    refused(capfd, reshard, "rank00000.safetensors: No space left on device")
    assert not hf.exists() and not resharded.exists()  # nothing that looks written, no empty folder either
    # the disk fills at the tokenizer, after the model: the error named the source tokenizer, and the model left
    # behind made the rerun refuse ("already holds a model"); now it names the copy and takes the model away
    monkeypatch.undo()

    def no_room(source, target, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", no_room)
    refused(capfd, export, f"{hf}/tokenizer.model: No space left on device")
    assert not hf.exists()
    monkeypatch.undo()
    code, out, _ = run(capfd, *export)  # which checkpoint of the run it exports is said (a fallback was not)
    assert code == 0 and re.search(rf"^exporting step \d+: {re.escape(str(base))}/checkpoints/iter_\d+$", out, re.M), (
        out
    )
    # the disk fills at the last file: a reshard's `latest` left a sealed checkpoint, an adapter's config its
    # weights alone (PEFT cannot load them); each rerun was refused ("holds checkpoints", "already holds a model")
    from loom.engine.checkpoint import format as checkpoint_format
    from loom.tools import hf as hf_tools

    def fails_at(name, write):
        def writing(path, *args, **kwargs):
            if Path(path).name == name:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return write(path, *args, **kwargs)

        return writing

    adapter = tmp_path / "adapter"
    adapter_only = ["ckpt", "export-hf", "--checkpoint", str(world["lora"]), "--adapter-only", "--output", str(adapter)]
    monkeypatch.setattr(checkpoint_format, "write_text_atomically", fails_at("latest", atomic.write_text_atomically))
    monkeypatch.setattr(
        hf_tools, "write_text_atomically", fails_at("adapter_config.json", atomic.write_text_atomically)
    )
    refused(capfd, reshard, f"{resharded}/latest: No space left on device")
    refused(capfd, adapter_only, f"{adapter}/adapter_config.json: No space left on device")
    assert not resharded.exists() and not list(adapter.glob("*"))
    monkeypatch.undo()
    assert run(capfd, *adapter_only)[0] == 0
    from loom.launch import cli_ckpt

    monkeypatch.setattr(cli_ckpt, "SHOW_TIME_AFTER_S", 0.0)  # a long one shows its time (a 1B merge: 26 s silent)
    code, _, err = run(capfd, *reshard)
    assert code == 0 and f"loom ckpt reshard: reading and writing a model into {resharded}: 00:0" in err

    # --overwrite moved the finished output into replaced/<time>/ first: failing, it left none in its place
    def files_of(folder):
        return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    before = files_of(resharded), files_of(hf)
    monkeypatch.setattr(checkpoint_format, "write_text_atomically", fails_at("latest", atomic.write_text_atomically))
    monkeypatch.setattr(hf_tools, "write_text_atomically", fails_at("config.json", atomic.write_text_atomically))
    for command, error in (
        ([*reshard, "--overwrite"], f"{resharded}/latest: No space left on device"),
        ([*export, "--overwrite"], f"{hf}/config.json: No space left on device"),
    ):
        code, out, err = run(capfd, *command)
        assert code == 2 and err.splitlines()[-1].startswith(f"error: {error}") and "held before" in out, err
    assert (files_of(resharded), files_of(hf)) == before


def test_a_run_directory_is_never_inside_checkpoints_or_outside_runs_by_name(world, capfd, tmp_path):
    """--train.run_dir RUN/checkpoints (or an iter_N in it) wrote a run's config, metrics and checkpoints among
    another run's checkpoints; --train.name "" wrote into runs/ itself and ../../x outside it."""
    base = world["base"]
    before = checkpoints_of(base)
    for run_dir in (base / "checkpoints", base / "checkpoints/iter_0000002/run"):
        refused(capfd, ["train", *tiny_train_args(world["dataset"], run_dir)], "a checkpoint folder")
    assert checkpoints_of(base) == before and not (base / "checkpoints/config.toml").exists()
    # a tool's output: a reshard's checkpoints at the folder's top (the run started from scratch beside them), an
    # export's model (the run's files mixed with it)
    resharded, exported, adapter, older = (tmp_path / name for name in ("resharded", "exported", "adapter", "bin"))
    code, _, err = run(
        capfd, "ckpt", "reshard", "--checkpoint", str(base), "--output", str(resharded), "--tp", "1", "--pp", "1"
    )
    assert code == 0, err
    shutil.copytree(world["hf"], exported)
    for folder, files in (
        (adapter, ("adapter_config.json", "adapter_model.safetensors")),  # export-hf --adapter-only's
        (older, ("config.json", "pytorch_model.bin")),  # a model saved the older way
    ):
        folder.mkdir()
        for name in files:
            (folder / name).write_text("{}")
    hugging_face = "holds a Hugging Face model or adapter"
    for run_dir, message in (
        (resharded, "holds checkpoints itself"),
        (exported, hugging_face),
        (adapter, hugging_face),
        (older, hugging_face),
    ):
        before_files = sorted(p.name for p in run_dir.iterdir())
        refused(capfd, ["train", *tiny_train_args(world["dataset"], run_dir), "--train.overwrite", "true"], message)
        assert sorted(p.name for p in run_dir.iterdir()) == before_files
    args = tiny_train_args(world["dataset"], tmp_path)
    without_run_dir = args[: args.index("--train.run_dir")] + args[args.index("--train.run_dir") + 2 :]
    for name in ("", "../../x", "a/b"):
        refused(capfd, ["train", *without_run_dir, "--train.name", name], "must be a plain name")


def test_a_dataset_is_read_only_with_the_tokenizer_it_was_built_with(world, capfd, tmp_path):
    """Its manifest records the tokenizer's sha256: merging datasets of two tokenizers, training or previewing one
    with another tokenizer (a model trained on noise, garbage text, exit 0) are refused."""
    from loom.data_tools.build import build_indexed_dataset

    root = world["root"]
    for name in ("tok", "other"):
        build_indexed_dataset([root / "docs.jsonl"], root / f"{name}.model", tmp_path / name, workers=1, progress=False)
    merge = ["data", "merge", "--inputs", str(tmp_path / "tok"), str(tmp_path / "other")]
    refused(capfd, [*merge, "--output-prefix", str(tmp_path / "both")], "were built with different tokenizers")
    mismatch = f"dataset {tmp_path / 'tok'} was built with tokenizer {root / 'tok.model'}, not {root / 'other.model'}"
    train = tiny_train_args(str(tmp_path / "tok"), tmp_path / "run", "--data.tokenizer", str(root / "other.model"))
    refused(capfd, ["train", *train], mismatch)
    assert not (tmp_path / "run").exists()  # refused after preflight made it: not left behind empty
    preview = ["data", "preview", "--data.paths", str(tmp_path / "tok"), "--train.seq_length", "16"]
    refused(capfd, [*preview, "--tokenizer", str(root / "other.model")], mismatch)
    assert run(capfd, *preview, "--tokenizer", str(root / "tok.model"))[0] == 0
    # a dataset without a manifest (Megatron-LM's, or copied without it): its token ids are checked against the
    # tokenizer's pieces (a 300-piece tokenizer trained on ids up to 319, exit 0), and a merge says it cannot check
    bare = tmp_path / "bare"
    bare.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(tmp_path / f"other{suffix}", bare / f"other{suffix}")
    train = tiny_train_args(str(bare / "other"), tmp_path / "run", "--data.tokenizer", str(root / "tok.model"))
    refused(
        capfd, ["train", *train], f"dataset {bare / 'other'} holds token id", "but data.tokenizer", "has 300 pieces"
    )
    code, _, err = run(
        capfd,
        "data",
        "merge",
        "--inputs",
        str(tmp_path / "tok"),
        str(bare / "other"),
        "--output-prefix",
        str(tmp_path / "with-bare"),
    )
    assert code == 0 and f"warning: {bare / 'other'} record(s) no tokenizer" in err
    # a merge's manifest (it wrote none) carries the tokenizer on
    merged, again = tmp_path / "merged", tmp_path / "tok-again"
    build_indexed_dataset([root / "docs.jsonl"], root / "tok.model", again, workers=1, progress=False)
    inputs = [str(tmp_path / "tok"), str(again)]
    code, _, err = run(capfd, "data", "merge", "--inputs", *inputs, "--output-prefix", str(merged))
    bins = sum((tmp_path / name).with_suffix(".bin").stat().st_size for name in ("tok", "tok-again"))
    assert code == 0 and "merge: copying: 100%" in err and "merge: sha256 of" in err  # 20 s of silence at 4.7 GB
    assert merged.with_suffix(".bin").stat().st_size == bins
    assert json.loads(merged.with_suffix(".manifest.json").read_text())["parameters"]["tokenizer"] == str(
        root / "tok.model"
    )
    refused(
        capfd, ["data", "inspect", str(merged), "--tokenizer", str(root / "other.model")], "was built with tokenizer"
    )
    assert json.loads(merged.with_suffix(".manifest.json").read_text())["parameters"]["append_eod"] is True
    # documents with and without an end-of-document id merged into one stream, exit 0
    build_indexed_dataset(
        [root / "docs.jsonl"], root / "tok.model", tmp_path / "run-on", workers=1, progress=False, append_eod=False
    )
    mixed = ["data", "merge", "--inputs", str(tmp_path / "tok"), str(tmp_path / "run-on")]
    refused(capfd, [*mixed, "--output-prefix", str(tmp_path / "mixed")], "was built with --no-append-eod")
    # a tokenizer retrained at the same path: "built with tokenizer t.model, not t.model"
    retrained = tmp_path / "t.model"
    retrained.write_bytes((root / "tok.model").read_bytes())
    build_indexed_dataset([root / "docs.jsonl"], retrained, tmp_path / "by-t", workers=1, progress=False)
    retrained.write_bytes((root / "other.model").read_bytes())
    preview_t = ["data", "preview", "--data.paths", str(tmp_path / "by-t"), "--train.seq_length", "16"]
    refused(capfd, [*preview_t, "--tokenizer", str(retrained)], f"tokenizer {retrained} has changed since dataset")


def test_options_a_command_would_ignore_are_refused(world, capfd, tmp_path):
    """generate took --prompt-ids and dropped --prompt; exact dedup took a --threshold it does not use."""
    both = ["generate", "--checkpoint", str(world["base"]), "--prompt", "x", "--prompt-ids", "1 2"]
    refused(capfd, both, "not allowed with argument")
    exact = ["data", "dedup", "--input", str(world["root"] / "docs.jsonl"), "--output", str(tmp_path / "d")]
    refused(capfd, [*exact, "--threshold", "0.5"], "--threshold is for --method minhash or semantic")


def test_lora_base_on_a_checkpoint_without_adapters_is_refused(world, capfd, tmp_path):
    """export-hf and generate ignored it; eval said to add --lora.rank, which is training's advice."""
    base = str(world["base"])
    said = "is not a LoRA checkpoint, so --lora.base"
    refused(
        capfd, ["ckpt", "export-hf", "--checkpoint", base, "--output", str(tmp_path / "hf"), "--lora.base", base], said
    )
    refused(capfd, ["generate", "--checkpoint", base, "--prompt-ids", "1 2", "--lora.base", base], said)
    refused(capfd, ["eval", "--checkpoint", base, "--data", world["dataset"], "--lora.base", base], said)


def test_inspect_max_tokens_0_shows_every_token_as_preview_does(capfd, dataset):
    """`data inspect --max-tokens 0` printed [] while preview's 0 means all."""
    from loom.engine.data.indexed import IndexedDataset

    code, out, err = run(capfd, "data", "inspect", dataset, "--samples", "1", "--max-tokens", "0")
    assert code == 0, err
    assert out.splitlines()[-1] == f"[0] {IndexedDataset(dataset)[0].tolist()}"


def test_inspect_says_what_the_dataset_s_caches_hold(capfd, tmp_path):
    """Sample-index caches pile up beside a dataset (one set per seq_length, seed and epoch count) and nothing said
    how much, nor that they may go."""
    import numpy as np

    from loom.engine.data.gpt_dataset import GPTDataset
    from loom.engine.data.indexed import IndexedDataset
    from loom.tools.synthetic_data import write_markov_dataset

    prefix = write_markov_dataset(tmp_path / "d", vocab_size=100, num_documents=20)
    for seq_length in (8, 16):
        GPTDataset(IndexedDataset(prefix), np.arange(20), 10, seq_length, seed=1)
    files = list(Path(f"{prefix}_cache").iterdir())
    size = sum(f.stat().st_size for f in files) / 1e6
    code, out, err = run(capfd, "data", "inspect", prefix, "--samples", "0")
    assert code == 0 and f"caches: {size:,.1f} MB in {len(files)} files in {prefix}_cache" in out, err
    assert "safe to delete while no run builds them" in out


def test_dedup_and_tokenizer_say_how_many_lines_were_not_documents(world, capfd, tmp_path):
    """Clean and build said so on the console; dedup and tokenizer only counted them in their files."""
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text((world["root"] / "docs.jsonl").read_text() + 'not json\n{"title": "no text"}\n')
    code, out, err = run(capfd, "data", "dedup", "--input", str(mixed), "--output", str(tmp_path / "d"))
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["bad_lines"] == 2
    assert "warning: 2 input line(s) were not documents and were left out" in err
    tokenizer = ["data", "tokenizer", "--input", str(mixed), "--output", str(tmp_path / "t"), "--vocab-size", "300"]
    code, out, err = run(capfd, *tokenizer)
    assert code == 0, err
    assert "warning: 2 input line(s) were not documents and were left out; counted by reason in" in err

"""Checks that need no process group: the layout, data, tokenizer, checkpoint and run directory.

Every launcher (local, torchrun, Slurm, `loom eval`, the demo) runs them before any rank starts, so
a user's mistake is one line instead of N failing ranks.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from loom.engine.atomic import move_aside
from loom.engine.config import ConfigError, LoomConfig
from loom.engine.run_dir import CONFIG, METRICS, checkpoints_of

if TYPE_CHECKING:
    from loom.engine.checkpoint.format import CheckpointMetadata


def preflight(config: LoomConfig, world_size: int, training: bool = True, ranks_have_cuda: bool | None = None) -> None:
    """Everything that can be checked before a process group starts (`training` False: for an evaluation).
    `ranks_have_cuda`: whether the ranks will find a GPU; None: they run on this machine, which says (`loom submit`
    asks the partition: a login node without GPUs must not refuse FP8 for a job that runs on GPU nodes)."""
    from loom.engine.data.indexed import IndexedDataset
    from loom.engine.data.loader import check_splits
    from loom.engine.data.token_range import check_dataset_token_ids, check_ids_within_tokenizer

    adopt_lora_base(config)
    adopted = adopt_settings_of_the_checkpoint_to_resume(config, say=False)  # what the checks below check against
    config.check_experts()  # the LoRA base's or the checkpoint's model may have experts the config's did not
    config.resolve_world(world_size)
    if config.model.kernels == "te" or config.train.fp8 != "off" or config.model.attention_backend != "auto":
        import torch

        from loom.engine.model.kernels import check_fp8_shapes, choose_kernels

        if ranks_have_cuda is None:
            ranks_have_cuda = torch.cuda.is_available()
        if not ranks_have_cuda:  # what needs CUDA is refused in one line; with it, each rank checks its own device
            choose_kernels(config, torch.device("cpu"))
        elif config.train.fp8 != "off":
            check_fp8_shapes(config)  # on any GPU
    if not config.data.paths:
        raise ConfigError(
            "data.paths is empty; build a dataset with `loom data build` (or run `loom demo`) "
            "and pass --data.paths PREFIX"
        )
    cache_dir = Path(config.data.cache_dir) if config.data.cache_dir else None
    if cache_dir is not None and cache_dir.exists() and not cache_dir.is_dir():
        raise ConfigError(f"data.cache_dir {cache_dir} is a file; give a directory (it is created if missing)")
    for prefix in config.data.paths:
        dataset = IndexedDataset(prefix)
        if dataset.num_tokens == 0:
            raise ConfigError(f"dataset {prefix} holds no tokens")
        check_dataset_token_ids(dataset, config.model.vocab_size, config.data.cache_dir)
    check_splits(config, with_train=training)
    if config.data.tokenizer:
        from loom.engine.data.tokenizer_json import TokenizerError, open_tokenizer

        tokenizer = Path(config.data.tokenizer)
        if not tokenizer.is_file():
            what = (
                "is a directory; give its .model file (or a Hugging Face model's tokenizer.json)"
                if tokenizer.is_dir()
                else "does not exist; give its path (--data.tokenizer PATH, relative to this directory), or "
                "--data.tokenizer none to read token ids without one"
            )
            raise ConfigError(f"data.tokenizer {tokenizer} {what}")
        try:
            vocab = open_tokenizer(tokenizer).get_piece_size()
        except TokenizerError as error:
            raise ConfigError(f"data.tokenizer: {error}") from None
        if vocab > config.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab} pieces but model.vocab_size = {config.model.vocab_size}; "
                f"set --model.vocab_size {vocab}"
            )
        if training and vocab < config.model.vocab_size and not (config.checkpoint.load or config.lora.enabled):
            # Megatron takes the vocabulary from the tokenizer: a ported script names none, and a preset's stays
            print(
                f"warning: model.vocab_size = {config.model.vocab_size} but the tokenizer has {vocab} pieces: ids "
                f"{vocab}-{config.model.vocab_size - 1} never occur and only take probability from the rest; set "
                f"--model.vocab_size {vocab} (the embedding is padded to a multiple of "
                f"model.make_vocab_divisible_by for speed anyway)",
                flush=True,
            )
        check_ids_within_tokenizer(config.data.paths, vocab, config.data.tokenizer, config.data.cache_dir)
    check_checkpoint_to_load(config, training)
    for line in adopted:  # said once the checkpoint is found loadable
        print(line, flush=True)
    check_wandb_installed(config)
    if training:
        warn_settings_without_effect(config)
    run_dir = Path(config.train.run_dir)
    if run_dir.is_file():
        raise ConfigError(f"run directory {run_dir} is a file; give a folder (--train.run_dir or --train.name)")
    check_run_directory(config)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"run directory {run_dir} is not writable: {error.strerror}") from None


@contextmanager
def removed_if_left_empty(run_dir: Path) -> Iterator[None]:
    """A launch that fails before anything was written leaves no empty run directory behind (it reads as a run
    that never started, and `runs/` fills with them); only a directory this launch created, and never a file."""
    from loom.engine.run_lock import remove_lock_if_free

    created = not run_dir.exists()
    try:
        yield
    except BaseException:
        if created and run_dir.is_dir() and remove_lock_if_free(run_dir):
            for folder in sorted((p for p in run_dir.rglob("*") if p.is_dir()), reverse=True) + [run_dir]:
                try:
                    folder.rmdir()  # refused for a folder that holds anything
                except OSError:
                    pass
        raise


def check_checkpoint_to_load(config: LoomConfig, training: bool) -> None:
    """The checkpoint the ranks will load (the run's own newest, else checkpoint.load) holds the same model and,
    when training, stops short of train.steps. Its model settings are the config's already (preflight adopted them
    first, adopt_settings_of_the_checkpoint_to_resume: the same checkpoint)."""
    from loom.engine.checkpoint.format import (
        CheckpointError,
        checkpoint_to_resume,
        find_loadable,
        foreign_checkpoint_hint,
    )
    from loom.engine.checkpoint.load import fine_tunes_from
    from loom.engine.checkpoint.saved_settings import check_same_model
    from loom.engine.model.lora import base_pointer, check_same_base

    load = Path(config.checkpoint.load) if config.checkpoint.load else None
    if load is not None:
        if not load.exists():
            raise ConfigError(f"checkpoint.load = {load} does not exist")
        damaged: list[CheckpointError] = []
        try:  # hashes are the ranks' to check; a folder without a checkpoint, or a file, is refused before them
            holds_one = load.is_dir() and find_loadable(load, verify_hashes=False, warn=lambda _: None, damaged=damaged)
        except CheckpointError as error:
            raise ConfigError(f"checkpoint.load = {load}: {error}") from None
        if not holds_one and damaged:  # a truncated or incomplete one was "no checkpoint"
            raise ConfigError(f"checkpoint.load = {load} holds no intact checkpoint (the newest: {damaged[0]})")
        if not holds_one:
            raise ConfigError(
                f"checkpoint.load = {load} holds no checkpoint; give a run directory, its checkpoints/ folder or an "
                f"iter_N folder{foreign_checkpoint_hint(load)}"
            )
    own = checkpoints_of(config.train.run_dir)
    found = checkpoint_to_resume(own, config.checkpoint.load, verify_hashes=False, warn=lambda _: None)
    if found is None:
        return
    check_same_base(found[0], found[1].lora_base, base_pointer(config))  # a rank's refusal, said before any starts
    run_dir = Path(config.train.run_dir)
    trained_here = (run_dir / METRICS).exists() or (run_dir / CONFIG).exists()  # a run writes them before saving
    if training and found[0].parent == own and not trained_here:
        raise ConfigError(
            f"{own} holds checkpoints no training run wrote ({found[0].name}: a loom ckpt tool's, import-hf or "
            "reshard): a run trained here would take them for its own and rotate them away; give this run its own "
            f"--train.name or --train.run_dir with --checkpoint.load {own} (and --checkpoint.finetune true to start "
            "from its weights at step 1)"
        )
    starts_from_load = training and load is not None and found[0].parent != own
    if starts_from_load and not fine_tunes_from(config, found[0]) and found[1].step >= config.train.steps:
        raise ConfigError(
            f"checkpoint.load = {load} is at step {found[1].step}, and train.steps = {config.train.steps}: "
            f"nothing would train; raise --train.steps above {found[1].step}"
        )
    check_same_model(found[0], found[1].config, config)


def adopt_saved_model_settings(
    config: LoomConfig, found: tuple[Path, CheckpointMetadata], say: bool = True
) -> list[str]:
    """A run that resumes or starts from checkpoint `found` computes the model saved there. Resuming its own, the
    [model] settings its config does not give are the checkpoint's; starting from another run's (checkpoint.load,
    with or without checkpoint.finetune), every setting no flag gives is, over the config file's, as a LoRA run
    takes its base's: the weights are that model, and a fine-tune of an import under a preset was refused a field
    at a time. Both shapes and the settings that change what the weights compute without changing a shape (RoPE,
    norm_eps): an imported Llama 3 fine-tuned with a config that left rope_theta out trained at 10000 instead of
    500000 (its logits off by 1.2 through export), said only in a warning; its max_position_embeddings became the
    preset's, which its export then claimed. A setting that stays and differs is refused if a shape
    (check_same_model), warned otherwise (resume_warnings: a longer context may be meant). Returns what it took,
    as lines to print (printed here with `say`)."""
    from loom.engine.checkpoint.saved_settings import ARCHITECTURE_MODEL_FIELDS, FUNCTIONAL_MODEL_FIELDS, flag_value
    from loom.engine.config_io import config_from_dict

    given = config.model_fields_given
    if given is None or config.lora.enabled:  # unknown; or LoRA, which takes the base's whole [model]
        return []
    # a run started from checkpoint.load keeps that model on every rerun, from its own checkpoints too
    kept = config.model_fields_flagged if config.checkpoint.load is not None else given
    saved = config_from_dict({"model": found[1].config["model"]}).model
    # yarn's cos/sin factor follows a factor this run gives (as Hugging Face derives it), not the checkpoint's
    rederived = saved.rope_scaling == "yarn" and "rope_scaling_factor" in kept and "rope_attention_factor" not in kept
    kept = {*kept, "rope_attention_factor"} if rederived else kept
    adopted = {
        name: getattr(saved, name)
        for name in ARCHITECTURE_MODEL_FIELDS + FUNCTIONAL_MODEL_FIELDS
        if name not in kept and getattr(saved, name) != getattr(config.model, name)
    }
    context = saved.max_position_embeddings  # RoPE's: no shape, but what an export says the model takes
    if "max_position_embeddings" not in kept and context != config.model.max_position_embeddings:
        if config.train.seq_length <= context:  # a longer training context keeps the config's (and is checked)
            adopted["max_position_embeddings"] = context
    if not adopted:
        return []
    said = {name: f"model.{name} = {flag_value(value)}" for name, value in adopted.items()}
    replaced = [f"{said[name]} (not {flag_value(getattr(config.model, name))})" for name in adopted if name in given]
    unset = [said[name] for name in adopted if name not in given]
    config.model = dataclasses.replace(
        config.model, **adopted, **({"rope_attention_factor": None} if rederived else {})
    )
    lines = []
    if unset:
        lines.append(f"model settings as {found[0]} was saved (the config does not set them): {', '.join(unset)}")
    if replaced:
        lines.append(
            f"the model is that of {found[0]}, whose weights this run starts from (the config file's [model] "
            f"differs): {', '.join(replaced)}"
        )
    for line in lines if say else ():
        print(line, flush=True)
    return lines


def adopt_settings_of_the_checkpoint_to_resume(config: LoomConfig, say: bool) -> list[str]:
    """adopt_saved_model_settings for the checkpoint a run would resume, found here (before check_checkpoint_to_load,
    or where it does not run: a torchrun or srun rank, --print-config); none where that checkpoint cannot be read."""
    from loom.engine.checkpoint.format import CheckpointError, checkpoint_to_resume

    load = config.checkpoint.load
    if load is None or Path(load).exists():  # a missing one is refused by rank 0, in its words
        try:
            found = checkpoint_to_resume(
                checkpoints_of(config.train.run_dir), load, verify_hashes=False, warn=lambda _: None
            )
        except CheckpointError:  # rank 0 refuses it, once, in the trainer's words
            return []
        if found is not None:
            return adopt_saved_model_settings(config, found, say)
    return []


def run_is_complete(run_dir: str | Path, step: int, steps: int, consequence: str = "") -> str:
    """What `loom train` says (and `loom submit` refuses with) when a run's checkpoint is already at train.steps."""
    return (
        f"nothing to train: the run in {run_dir} is complete at step {step} of train.steps = {steps}{consequence}; "
        "raise --train.steps to continue it, or give a new run its own --train.name or --train.run_dir"
    )


def adopt_lora_base(config: LoomConfig) -> None:
    """A LoRA run's [model] is its base's (engine/model/lora.py): take it, say what changed, check the rank."""
    if not config.lora.enabled:
        return
    from loom.engine.config.lora import LORA_TARGETS
    from loom.engine.model.lora import adopt_base_model, check_rank, frozen_router_fields

    changes = adopt_base_model(config)
    if changes:
        print(f"LoRA: the model is the base's ({config.lora.base}): {'; '.join(changes)}", flush=True)
    if config.model.moe and config.lora.targets == list(LORA_TARGETS):  # the default: every dense linear layer
        config.lora.targets = [target for target in LORA_TARGETS if target not in ("fc1", "fc2")]
        print(
            f"LoRA: the base is a mixture of {config.model.num_experts} experts, which take no adapters: "
            f"lora.targets = {' '.join(config.lora.targets)}",
            flush=True,
        )
    frozen = frozen_router_fields(config.model)
    if frozen:  # adopt_base_model zeroed them, as peft's fine-tunes of Mixtral and the others train
        biases = ", its experts' biases fixed" if config.model.moe_expert_bias else ""
        zeroed = ", ".join(f"model.{name} = 0" for name in frozen)
        print(f"LoRA: the router is frozen: no load-balancing loss or z-loss{biases} ({zeroed})", flush=True)
    check_rank(config)


def first_difference(first: dict, second: dict, names: tuple[str, str] = ("there", "now")) -> str:
    """The first setting two configs (as dicts of sections) give differently, said as `section.field: A there, B
    now` (`names` in place of there and now)."""
    for section in sorted(set(first) | set(second)):
        before, after = first.get(section, {}), second.get(section, {})
        for name in sorted(set(before) | set(after)):
            if before.get(name) != after.get(name):
                from loom.engine.checkpoint.saved_settings import flag_value

                said = [
                    flag_value(value) if isinstance(value, bool) else value
                    for value in (before.get(name), after.get(name))
                ]
                return f"{section}.{name}: {said[0]} {names[0]}, {said[1]} {names[1]}"
    return "the same settings, written differently"


JOB_SETTINGS = ("overwrite", "exit_after")
"""[train] settings one job of a run may change without making it another run."""


def _refuse_a_tool_output(run_dir: Path) -> None:
    """A folder that `loom ckpt reshard|import-hf|merge-lora` (checkpoints at its top) or `export-hf` (a Hugging
    Face model) wrote is no run directory: a run would mix its files with them, and would not resume from the
    checkpoints (a run keeps its own in RUN/checkpoints/)."""
    from loom.engine.checkpoint.format import LATEST, candidates, is_hugging_face_folder

    if candidates(run_dir) or (run_dir / LATEST).is_file():
        raise ConfigError(
            f"run directory {run_dir} holds checkpoints itself (iter_N, latest: a checkpoint tool's output); give "
            f"this run its own --train.run_dir, with --checkpoint.load {run_dir} to start from them"
        )
    if is_hugging_face_folder(run_dir):
        raise ConfigError(
            f"run directory {run_dir} holds a Hugging Face model or adapter; give this run its own --train.run_dir "
            f"(to train from a model there: loom ckpt import-hf --input {run_dir} --output DIR, then "
            "--checkpoint.load DIR)"
        )


def check_run_directory(config: LoomConfig) -> None:
    """A run directory is this run's alone: one that holds another run's metrics (a different resolved
    config, no checkpoint to resume from) is refused unless train.overwrite moves that run aside. Resuming
    (a checkpoint is there) and re-running the same config are allowed."""
    from loom.engine.checkpoint.format import enclosing_checkpoint, find_loadable
    from loom.engine.config_io import config_to_toml
    from loom.engine.run_lock import check_not_in_use

    run_dir = Path(config.train.run_dir)
    folder = enclosing_checkpoint(run_dir, folders=True)
    if folder is not None:
        raise ConfigError(
            f"run directory {run_dir} "
            + ("is a checkpoint folder" if folder == run_dir else f"lies in {folder}, a checkpoint folder")
            + ": this run's files would mix with its; "
            "give this run its own --train.name or --train.run_dir"
        )
    _refuse_a_tool_output(run_dir)
    check_not_in_use(run_dir)
    metrics, saved_config = run_dir / METRICS, run_dir / CONFIG
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return
    if find_loadable(checkpoints_of(run_dir), verify_hashes=False, warn=lambda _: None) is not None:
        if config.train.overwrite:
            print(
                f"warning: train.overwrite: {run_dir} has a checkpoint, so this run resumes it; to start over, "
                f"give this run its own --train.name or --train.run_dir, or move {run_dir} aside"
            )
        return
    current = tomllib.loads(config_to_toml(config))
    try:
        saved = tomllib.loads(saved_config.read_text())
    except (OSError, ValueError):
        saved = {}
    for job_setting in JOB_SETTINGS:  # how this job runs, not which run it is
        saved.get("train", {}).pop(job_setting, None)
        current["train"].pop(job_setting, None)
    if saved == current:  # the same run, stopped before its first checkpoint: it starts again
        print(
            f"{run_dir} holds this run's metrics but no checkpoint to resume from: it trains again from step 1, "
            f"replacing them"
        )
        return
    if not config.train.overwrite:
        difference = first_difference(saved, current) if saved else f"and no readable {saved_config.name}"
        raise ConfigError(
            f"run directory {run_dir} holds another run's metrics ({difference}); "
            f"give this run its own --train.name or --train.run_dir, or pass --train.overwrite true to replace it"
        )
    aside = move_aside(run_dir, [entry for entry in run_dir.iterdir() if entry.name != "replaced"])
    print(f"train.overwrite: the previous run in {run_dir} was moved to {aside}")


def preflight_of_a_rank(config: LoomConfig) -> None:
    """What a rank started by torchrun or srun checks itself before its process group: the checks above that
    need neither the world size nor the run directory's ownership (its launcher, not loom, started it)."""
    from loom.engine.data.token_range import check_token_ids

    adopt_settings_of_the_checkpoint_to_resume(config, say=os.environ.get("RANK") == "0")
    check_token_ids(config.data.paths, config.model.vocab_size, config.data.cache_dir)
    check_wandb_installed(config)


def warn_settings_without_effect(config: LoomConfig) -> None:
    for unread in config.settings_without_effect() + config.file_fields_a_flag_outdates():
        print(f"warning: {unread}", flush=True)


def check_wandb_installed(config: LoomConfig) -> None:
    if not config.train.wandb_project or config.train.wandb_mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            "train.wandb_project is set but the wandb package is not installed: pip install wandb "
            "(or leave train.wandb_project unset)"
        ) from None

"""Where the offline tools may write: never over another run's files unless the user said to replace them.

`loom ckpt import-hf|merge-lora|reshard` write a checkpoint (iter_N + `latest`) into a checkpoints folder, and
`loom ckpt export-hf` writes a Hugging Face folder. Written into a training run, an import would repoint its
`latest` (the run then resumes at step 0 of another model), and an iter_N beside a run's checkpoints/ is found
before them by `--checkpoint RUN`. So each refuses, in one line: a file, a run directory, a folder holding
checkpoints or (for an export) a model, unless --overwrite, which moves what is there into replaced/<time>/
(as `train --train.overwrite` does) -- except the checkpoint being read, which is never replaced.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from loom.engine.atomic import cannot_create, move_aside, put_back_if_failed
from loom.engine.checkpoint.format import (
    HF_FILES,
    LATEST,
    MEGATRON_TRACKER,
    CheckpointError,
    candidates,
    enclosing_checkpoint,
    is_megatron_checkpoint,
)
from loom.engine.config import ConfigError
from loom.engine.run_dir import CHECKPOINTS, CONFIG, METRICS, checkpoints_of
from loom.engine.run_lock import holder_of

RUN_FILES = (METRICS, CONFIG)
"""What a training run writes into its run directory before anything else."""


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
"""A Hugging Face folder's tokenizer: what export-hf writes beside the model, and copies from an import's folder."""


def is_run_directory(path: Path) -> bool:
    """A training run's directory: its metrics or resolved config, or a checkpoints/ folder with checkpoints."""
    return path.is_dir() and (
        any((path / name).is_file() for name in RUN_FILES) or bool(candidates(checkpoints_of(path)))
    )


def _checkpoint_entries(folder: Path) -> list[Path]:
    return candidates(folder) + [p for p in (folder / LATEST,) if p.exists()]


def _refuse_file_or_run(output: Path, what: str) -> None:
    if output.exists() and not output.is_dir():
        raise CheckpointError(f"--output {output} is a file; give a folder for the {what}")
    if is_run_directory(output):
        raise CheckpointError(
            f"--output {output} is a training run's directory; write the {what} to a folder of its own, "
            f"e.g. {output.with_name(output.name + '-' + what.split()[0])}"
        )


@contextmanager
def claimed_checkpoint_output(output: Path, overwrite: bool, reading: tuple[Path, ...] = ()) -> Iterator[None]:
    """Make sure a checkpoint may be written into `output` (a checkpoints folder) by the block; with `overwrite`,
    move the checkpoints already there aside, and back if the block fails. `reading`: the checkpoints the command
    reads, which it cannot replace."""
    _refuse_file_or_run(output, "checkpoint")
    inside = enclosing_checkpoint(output)
    if inside is not None:
        raise CheckpointError(
            f"--output {output} is inside the checkpoint {inside} (a checkpoint written there would be found "
            "in its place); write to a new folder"
        )
    if output.is_dir() and any(next(output.glob(pattern), None) for pattern in HF_FILES):
        raise CheckpointError(
            f"--output {output} holds a Hugging Face model; write the checkpoint to a folder of its own"
        )
    existing = _checkpoint_entries(output) if output.is_dir() else []
    owner = output.parent if output.name == CHECKPOINTS and is_run_directory(output.parent) else None
    real = output.resolve()  # a link to a run's checkpoints/ is that run's too
    holder = holder_of(real.parent) if real.name == CHECKPOINTS and is_run_directory(real.parent) else None
    if holder is not None:  # its next save (and retention) would meet this checkpoint, --overwrite or not
        raise CheckpointError(
            f"--output {output} is the checkpoints folder of {real.parent}, in use by {holder}; write to a new "
            "folder, or wait for that run to stop"
        )
    if (existing or owner is not None) and not overwrite:
        trained = owner is not None and any((owner / name).is_file() for name in RUN_FILES)
        held = f"is {'training run ' if trained else ''}{owner}'s checkpoints folder" if owner else "holds checkpoints"
        raise CheckpointError(
            f"--output {output} {held}: writing there would repoint its `latest`; write to a new folder, "
            f"or pass --overwrite to move what is there into {output}/replaced/"
        )
    for source in reading:
        if source.resolve() == output.resolve() or output.resolve() in source.resolve().parents:
            raise CheckpointError(f"--output {output} holds {source}, which this command reads; write elsewhere")
    with _replacing(output, existing, "the checkpoints"):
        yield


@contextmanager
def claimed_export_output(output: Path, overwrite: bool) -> Iterator[None]:
    """Make sure a Hugging Face model (or adapter) may be written into `output` by the block; with `overwrite`,
    move the model files already there aside (a stale shard index would otherwise win over the new
    model.safetensors). An export's files are written before its config (the last, which makes it complete): if
    the block fails (a full disk), they go again, so that a rerun is not refused over a half-written model (the
    folder held no model files once claimed, so any there now are this export's), and what --overwrite moved
    aside comes back."""
    _refuse_file_or_run(output, "export")
    if output.is_dir() and _checkpoint_entries(output):
        raise CheckpointError(f"--output {output} holds loom checkpoints; export to a folder of its own")
    existing = _export_files(output)
    if existing and not overwrite:
        raise CheckpointError(
            f"--output {output} already holds a model ({', '.join(p.name for p in existing[:3])}); export to a new "
            f"folder, or pass --overwrite to move those files into {output}/replaced/"
        )
    with _replacing(output, existing, "the files"):
        try:
            yield
        except BaseException:
            for path in _export_files(output):
                with suppress(OSError):
                    path.unlink()
            raise


@contextmanager
def claimed_megatron_output(output: Path, overwrite: bool) -> Iterator[None]:
    """Make sure a Megatron-LM checkpoint may be written into `output` (a --save folder) by the block: not a file,
    a run's directory, a folder of loom checkpoints or a Hugging Face model; a Megatron checkpoint already there
    (its latest_checkpointed_iteration.txt and iteration folders) only with `overwrite`, which moves it aside, and
    back if the block fails."""
    _refuse_file_or_run(output, "Megatron checkpoint")
    if (inside := enclosing_checkpoint(output)) is not None:
        raise CheckpointError(f"--output {output} is inside the checkpoint {inside}; write to a new folder")
    if output.is_dir() and any(next(output.glob(pattern), None) for pattern in HF_FILES):
        raise CheckpointError(f"--output {output} holds a Hugging Face model; write to a folder of its own")
    iterations = [p for p in candidates(output) if p.is_dir()] if output.is_dir() else []
    if (output / LATEST).exists() or any(not is_megatron_checkpoint(p) for p in iterations):
        raise CheckpointError(f"--output {output} holds loom checkpoints; export to a folder of its own")
    existing = iterations + [p for p in (output / MEGATRON_TRACKER, output / "release") if p.exists()]
    if existing and not overwrite:
        raise CheckpointError(
            f"--output {output} already holds a Megatron-LM checkpoint ({', '.join(p.name for p in existing[:3])}); "
            f"export to a new folder, or pass --overwrite to move it into {output}/replaced/"
        )
    with _replacing(output, existing, "the Megatron-LM checkpoint's files"):
        yield


@contextmanager
def _replacing(output: Path, existing: list[Path], what: str) -> Iterator[None]:
    """Move `existing` (what --overwrite replaces in `output`) into output/replaced/<time>/, say so, and put it back
    if the block fails."""
    replaced = None
    if existing:
        replaced = move_aside(output, existing), existing
        print(f"--overwrite: {what} in {output} were moved to {replaced[0]}")
    with put_back_if_failed(replaced, output):
        yield


def _export_files(output: Path) -> list[Path]:
    """The model and tokenizer files of a Hugging Face folder (an old tokenizer left beside a new model would be
    taken for its own)."""
    if not output.is_dir():
        return []
    return sorted({path for pattern in (*HF_FILES, *HF_TOKENIZER_FILES) for path in output.glob(pattern)})


def claim_result_file(output: Path, kind: str, overwrite: bool, identity: dict) -> Path:
    """A benchmark's JSON result file: a new file (its folder is created), or an earlier result of the same benchmark
    run the same way (`identity`: the config, the device, ..., as the result records them): what a rerun replaces.
    Anything else (a run's metrics.jsonl, a checkpoint's metadata.json, another configuration's or device's figures)
    only with --overwrite. Checked before the benchmark runs, not after its minutes of measuring. Returns the file to
    write: a link's target (written through, as other programs write to a link)."""
    import json

    output = Path(os.path.realpath(output))  # a link is written through: its target is claimed, and returned
    if output.exists() and not overwrite:
        try:
            earlier = json.loads(output.read_text())
        except (OSError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and earlier.get("bench") == kind):
            raise ConfigError(
                f"--output {output} exists and is not a `loom bench {kind}` result; give another file, or pass "
                "--overwrite to replace it"
            )
        if missing := [key for key in identity if key not in earlier]:
            raise ConfigError(
                f"--output {output} holds a `loom bench {kind}` result written by an older loom (it records no "
                f"{', '.join(missing)}); give another file, or pass --overwrite to replace it"
            )
        differing = [key for key, value in identity.items() if earlier.get(key) != value]
        if differing:
            theirs = ", ".join(f"{key} {earlier.get(key)!r}" for key in differing)
            ours = ", ".join(f"{key} {identity[key]!r}" for key in differing)
            raise ConfigError(
                f"--output {output} holds the result of another `loom bench {kind}` ({theirs}; this one: {ours}); "
                "give another file, or pass --overwrite to replace it"
            )
    if not output.exists() and (why := cannot_create(output)):
        raise ConfigError(f"--output {output}: cannot write there ({why})")
    return output

"""The on-disk checkpoint format: one place for names, metadata and the checks that find a good one.

    checkpoints/latest                 the newest complete iteration, written last (atomic rename)
    checkpoints/iter_0000020/
        metadata.json                  step, consumed samples, config, layout, every file's size and
                                       sha256, the index of every tensor piece, each parameter's ShardSpec
        rank00000.safetensors ...      the pieces each rank wrote (safetensors: loading runs no code)

A piece is a slice of one *logical* tensor (the parameter as a dense single-device model has it):
`model/<name>/tp<r>` is TP rank r's shard of a weight; `optim/<state>/<name>/tp<r>/<start>-<end>`
is the flat range [start, end) of that shard's master weight or optimizer state (a ZeRO-1 piece,
or the whole shard). With the ShardSpec and TP size they were saved under, the pieces rebuild the
logical tensor, which any other layout slices again: that is what makes checkpoints layout-free.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

from loom.engine.parallel.sharding import ShardSpec
from loom.errors import LoomError

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
_ITERATION = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(LoomError):
    """A missing, incomplete, corrupt or incompatible checkpoint; one line naming it."""


def iteration_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"iter_{step:07d}"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def model_key(name: str, tp_rank: int) -> str:
    return f"model/{name}/tp{tp_rank}"


def optim_key(state: str, name: str, tp_rank: int, start: int, end: int) -> str:
    return f"optim/{state}/{name}/tp{tp_rank}/{start}-{end}"


def parse_optim_key(key: str) -> tuple[str, str, int, int, int]:
    """(state, parameter name, tp rank, start, end) of an optimizer piece."""
    _, state, rest = key.split("/", 2)
    name, tp, span = rest.rsplit("/", 2)
    start, end = span.split("-")
    return state, name, int(tp[2:]), int(start), int(end)


def spec_to_json(spec: ShardSpec) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()}


def spec_from_json(data: dict) -> ShardSpec:
    return ShardSpec(tuple(data["full_shape"]), data["dim"], tuple(data["blocks"]), data["padded_size"])


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(directory: Path, verify_hashes: bool = True) -> dict:
    """The metadata of a complete, intact checkpoint, or CheckpointError saying what is wrong."""
    path = directory / METADATA
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: no {METADATA}")
    try:
        metadata = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"checkpoint {directory}: {METADATA} is corrupt ({error})") from None
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {directory} has format {metadata.get('format_version')}, this loom reads {FORMAT_VERSION}"
        )
    for name, expected in metadata["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
        if file.stat().st_size != expected["size"]:
            raise CheckpointError(
                f"checkpoint {directory}: {name} has {file.stat().st_size} bytes, "
                f"expected {expected['size']} (truncated?)"
            )
        if verify_hashes and sha256_of(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {name} does not match its sha256 (corrupt)")
    return metadata


def candidates(checkpoints: Path) -> list[Path]:
    """Complete-looking iteration directories, newest first (`latest`'s choice first)."""
    found = (
        sorted((p for p in checkpoints.iterdir() if _ITERATION.match(p.name)), reverse=True)
        if checkpoints.is_dir()
        else []
    )
    latest = checkpoints / LATEST
    if latest.is_file():
        named = checkpoints / latest.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def find_loadable(path: Path, verify_hashes: bool = True, warn=print) -> tuple[Path, dict] | None:
    """A checkpoint to resume from: `path` itself if it is an iteration directory, else the newest
    intact one under it (falling back past damaged ones, with a warning); None if there is none."""
    if (path / METADATA).exists() or _ITERATION.match(path.name):
        return path, read_metadata(path, verify_hashes)
    for directory in candidates(path):
        try:
            return directory, read_metadata(directory, verify_hashes)
        except CheckpointError as error:
            warn(f"warning: {error}; falling back to an older checkpoint")
    return None

"""The on-disk checkpoint format: one place for names, metadata, the commit that seals a checkpoint and
the checks that find a good one. Every writer (training, `loom ckpt reshard`, `loom ckpt import-hf`)
fills a staging directory, describes it with CheckpointMetadata and seals it with commit().

    checkpoints/latest                 the newest complete iteration, written last (atomic rename)
    checkpoints/iter_0000020/
        metadata.json                  step, consumed samples, config, layout, every file's size and
                                       sha256, the index of every tensor piece, each parameter's ShardSpec
        rank00000.safetensors ...      the pieces each rank wrote (safetensors: loading runs no code)

A piece is a slice of one *logical* tensor (the parameter as a dense single-device model has it):
`model/<name>/tp<r>` is TP rank r's shard of a weight (`model/<name>/tp<r>/<start>-<end>` a flat range of it, what
an expert-parallel rank holds of an expert weight); `optim/<state>/<name>/tp<r>/<start>-<end>`
is the flat range [start, end) of that shard's master weight or optimizer state (a ZeRO piece
under optim.zero >= 1, or the whole shard). With the ShardSpec and TP size they were saved under, the pieces rebuild the
logical tensor, which any other layout slices again: that is what makes checkpoints layout-free.
`fp8/<module>` is a module's FP8 delayed-scaling state (the same on every TP rank, so saved once), `buffer/<name>`
a buffer that is model state (an MoE block's experts' biases, the same on every rank of a stage),
`rng/<rank>/<stream>` a rank's random state (read back only under the same layout).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from loom.engine.atomic import save_tensors_atomically, stream_tensors_atomically, write_text_atomically
from loom.engine.parallel.sharding import ShardSpec
from loom.engine.run_dir import CHECKPOINTS
from loom.errors import LoomError

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
_ITERATION = re.compile(r"^iter_(\d{7,})$")
_STAGING = re.compile(r"^iter_\d{7,}\.tmp$")
SLOW_HASH_BYTES = 4 << 30
"""Checking a checkpoint's hashes past this many bytes takes seconds (about 1.7 GB/s here): it is said first."""


class CheckpointError(LoomError):
    """A missing, incomplete, corrupt or incompatible checkpoint; one line naming it."""


def iteration_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"iter_{step:07d}"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def model_key(name: str, tp_rank: int) -> str:
    return f"model/{name}/tp{tp_rank}"


def model_range_key(name: str, tp_rank: int, start: int, end: int) -> str:
    """The flat range [start, end) of TP rank tp_rank's shard of a weight: what an expert-parallel rank holds of an
    expert weight (its experts, ParamInfo.expert_range), the shard's other ranges written by the other ranks."""
    return f"model/{name}/tp{tp_rank}/{start}-{end}"


_MODEL_RANGE = re.compile(r"^model/(.+)/tp(\d+)/(\d+)-(\d+)$")


def parse_model_range_key(key: str) -> tuple[str, int, int, int] | None:
    """(parameter name, tp rank, start, end) of a model_range_key; None for any other key."""
    match = _MODEL_RANGE.match(key)
    if match is None:
        return None
    name, tp, start, end = match.groups()
    return name, int(tp), int(start), int(end)


def optim_key(state: str, name: str, tp_rank: int, start: int, end: int) -> str:
    return f"optim/{state}/{name}/tp{tp_rank}/{start}-{end}"


def rng_key(rank: int, name: str) -> str:
    """A rank's random state entry (RNGStreams.state_dict's `name`); only the same layout reads it back."""
    return f"rng/{rank}/{name}"


def fp8_key(module: str) -> str:
    """A module's FP8 scaling state (fp8_state.Fp8ScalingState), by layout-independent module name."""
    return f"fp8/{module}"


def buffer_key(name: str) -> str:
    """A model buffer that is state but no parameter (an MoE block's experts' biases: moe.expert_biases), by its
    layout-independent name, the same on every TP and DP rank, so saved once."""
    return f"buffer/{name}"


def buffer_names(metadata: CheckpointMetadata) -> dict[str, str]:
    """A checkpoint's buffers (buffer_key) by name: {name: key}; empty where it has none."""
    prefix = buffer_key("")
    return {key.removeprefix(prefix): key for key in metadata.index if key.startswith(prefix)}


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


def tokenizer_record(path: str | None) -> dict | None:
    """What a checkpoint records of its tokenizer file (CheckpointMetadata.tokenizer); None without one."""
    if not path or not Path(path).is_file():
        return None
    return {"path": str(Path(path).resolve()), "sha256": sha256_of(Path(path))}


def unrecorded_tokenizer(config: dict) -> dict | None:
    """A checkpoint that records no tokenizer (written before loom recorded one, or when its file was gone) but
    whose config's data.tokenizer names one: that path as written (a relative one is relative to where training
    ran), with no sha256 to check a file against (None)."""
    path = config.get("data", {}).get("tokenizer")
    return {"path": str(path), "sha256": None} if path else None


@dataclass(frozen=True)
class FileRecord:
    """What metadata.json records of one file, so that a truncated or corrupt file is found before loading."""

    size: int
    """Bytes on disk."""
    sha256: str
    """Hex digest of the whole file."""

    @classmethod
    def of(cls, path: Path) -> FileRecord:
        return cls(path.stat().st_size, sha256_of(path))


@dataclass(frozen=True)
class CheckpointLayout:
    """The layout and settings a checkpoint was saved under (loading under another layout reshards)."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    vp: int
    """Virtual pipeline stages per pipeline rank."""
    dp: int
    """Data-parallel size."""
    world: int
    """Number of ranks (tp * cp * pp * dp)."""
    zero: int
    """The ZeRO stage (optim.zero) when saved: with 1 to 3 optimizer state was split across DP (x CP) ranks."""
    optimizer: str | None
    """The optimizer's name (optim.name); None for a checkpoint without optimizer state (import-hf)."""
    precision: str
    """train.precision: fp32, bf16 or fp16."""
    cp: int = 1
    """Context-parallel size (checkpoints from before context parallelism: 1). Shards no weights."""
    ep: int = 1
    """Expert-parallel size (checkpoints from before expert parallelism: 1): its ranks saved their experts' ranges
    of each expert weight (model_range_key)."""

    def places_ranks_like(self, tp: int, pp: int, dp: int, vp: int, cp: int = 1) -> bool:
        """Whether rank r here is rank r there (per-rank state such as RNG streams then carries over)."""
        return (self.tp, self.pp, self.dp, self.vp, self.cp) == (tp, pp, dp, vp, cp)


@dataclass
class CheckpointMetadata:
    """metadata.json: the one description of a checkpoint, written by every writer (training, reshard,
    import-hf) and read by every reader. Written last, so its presence means the files are complete."""

    step: int
    """Training steps completed when saved."""
    consumed_samples: int
    """Training samples consumed, the data iterator's position (its state_dict's `consumed_samples`)."""
    tokens: int
    """Training tokens consumed (consumed_samples * seq_length)."""
    layout: CheckpointLayout
    """The layout the pieces were saved under."""
    optimizer_step: int
    """The optimizer's own step count (bias correction); 0 without optimizer state."""
    loss_scaler: dict | None
    """The fp16 loss scaler's state_dict, or None when training was not fp16."""
    config: dict
    """The full config of the run (config_io.config_to_dict), which `loom eval` and resharding start from."""
    specs: dict[str, ShardSpec]
    """Each parameter's ShardSpec by layout-independent name: how its pieces join into the logical tensor."""
    files: dict[str, FileRecord]
    """Size and sha256 of every file of the checkpoint, by file name."""
    index: dict[str, str]
    """The file holding each tensor piece, by piece key (model_key, optim_key, fp8/..., rng/..., factored/...)."""
    lora_base: dict | None = None
    """For a LoRA run's checkpoint (adapters only): the base model's checkpoint directory ("path") and the
    sha256 of its metadata.json ("metadata_sha256"); None for a checkpoint of the whole model."""
    tokenizer: dict | None = None
    """The tokenizer the model was trained with (data.tokenizer): its "path" then and the "sha256" of the file, so
    `loom generate` can refuse another; None when training read token ids without one."""
    hf_source: str | None = None
    """For a checkpoint written by `loom ckpt import-hf`: the Hugging Face model folder it came from, which a
    PEFT export of adapters trained on it names as base_model_name_or_path."""
    hf_token_ids: dict | None = None
    """For a model `loom ckpt import-hf` wrote (and the checkpoints of runs that train on from it, and merge-lora's
    of adapters on it): the special-token ids its config.json gave (bos_token_id, eos_token_id, pad_token_id, those
    present), which export-hf writes back; None elsewhere."""
    hf_model_type: str | None = None
    """For the same checkpoints: the model_type of the Hugging Face config ("phi3", ...), so that export-hf writes
    a Phi-3 back as one and a PEFT export of adapters on it names Phi-3's fused modules; None elsewhere."""
    hf_dtype: str | None = None
    """For the same checkpoints: the torch_dtype the Hugging Face model was stored in ("bfloat16", ...), which
    export-hf writes by default (loom keeps fp32 weights); None elsewhere."""
    hf_tokenizer: dict | None = None
    """For the same checkpoints: the sha256 of each tokenizer file the Hugging Face folder held at import, by name,
    so that export-hf copies those files only while they are unchanged; None elsewhere (or none there)."""
    validation: dict | None = None
    """Early stopping's state when saved: "best_loss" (the best validation loss so far, null before the first
    evaluation) and "evals_without_gain" (evaluations since it last improved), so a resumed run neither forgets
    its best nor trains on after it stopped early; None from writers that do not train."""
    datasets: list | None = None
    """The training datasets as training read them (engine/data/indexed.dataset_record, one per data.paths entry:
    absolute prefix, bin_bytes, idx_bytes, idx_written_ns, sampled_sha256), so a resume compares data, not how its
    path was spelled; None from writers that do not train, or where a file was missing."""
    nonfinite_in_a_row: int = 0
    """Non-finite steps in a row when saved (train.nan_policy = skip skips them): a resumed or requeued job goes
    on counting toward train.max_skipped_steps instead of starting again from 0."""
    skipped_updates: int = 0
    """Steps whose update was skipped (an fp16 overflow, or a non-finite step under train.nan_policy = skip). The
    learning-rate schedule stands still on them, as Megatron-LM's and DeepSpeed's do: a resumed run takes the
    learning rate of step - skipped_updates. 0 in checkpoints of older looms, whose schedule moved on."""
    lr_position: float | None = None
    """The learning-rate schedule's position when saved (lr_schedule.learning_rate): the applied updates, each
    counted as its batch's share of the full global batch (under a batch ramp-up the schedule counts samples, as
    Megatron-LM's does). None from older looms, whose schedule counted steps: step - skipped_updates."""
    format_version: int = FORMAT_VERSION
    """The on-disk format version; a reader refuses any other."""

    def to_json(self) -> str:
        data = {
            "format_version": self.format_version,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "tokens": self.tokens,
            "layout": asdict(self.layout),
            "loss_scaler": self.loss_scaler,
            "config": self.config,
            "optimizer_step": self.optimizer_step,
            "specs": {name: spec_to_json(spec) for name, spec in self.specs.items()},
            "files": {name: asdict(record) for name, record in self.files.items()},
            "index": self.index,
            "lora_base": self.lora_base,
            "tokenizer": self.tokenizer,
            "hf_source": self.hf_source,
            "hf_token_ids": self.hf_token_ids,
            "hf_dtype": self.hf_dtype,
            "hf_model_type": self.hf_model_type,
            "hf_tokenizer": self.hf_tokenizer,
            "validation": self.validation,
            "datasets": self.datasets,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "skipped_updates": self.skipped_updates,
            "lr_position": self.lr_position,
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CheckpointMetadata:
        """Parse metadata.json; CheckpointError (without the directory, which the caller adds) if it is not one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{METADATA} is corrupt ({error})") from None
        if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
            version = data.get("format_version") if isinstance(data, dict) else None
            raise CheckpointError(f"{METADATA} has format {version}, this loom reads {FORMAT_VERSION}")
        try:
            return cls(
                step=data["step"],
                consumed_samples=data["consumed_samples"],
                tokens=data["tokens"],
                layout=CheckpointLayout(**_migrated_layout(data["layout"])),
                optimizer_step=data["optimizer_step"],
                loss_scaler=data["loss_scaler"],
                config=data["config"],
                specs={name: spec_from_json(spec) for name, spec in data["specs"].items()},
                files={name: FileRecord(**record) for name, record in data["files"].items()},
                index=data["index"],
                lora_base=data.get("lora_base"),
                tokenizer=data.get("tokenizer"),
                hf_source=data.get("hf_source"),
                hf_token_ids=data.get("hf_token_ids"),
                hf_dtype=data.get("hf_dtype"),
                hf_model_type=data.get("hf_model_type"),
                hf_tokenizer=data.get("hf_tokenizer"),
                validation=data.get("validation"),
                datasets=data.get("datasets"),
                nonfinite_in_a_row=data.get("nonfinite_in_a_row", 0),
                skipped_updates=data.get("skipped_updates", 0),
                lr_position=data.get("lr_position"),
                format_version=data["format_version"],
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{METADATA} is corrupt ({type(error).__name__}: {error})") from None

    @property
    def hf_origin(self) -> dict | None:
        """The fields of a Hugging Face import that every checkpoint descended from it carries (None: not one)."""
        origin = {name: getattr(self, name) for name in HF_ORIGIN_FIELDS}
        return origin if any(value is not None for value in origin.values()) else None

    @property
    def schedule_position(self) -> float:
        """Where a run resumed from this checkpoint takes the learning-rate schedule up (lr_position)."""
        return float(self.step - self.skipped_updates) if self.lr_position is None else self.lr_position


HF_ORIGIN_FIELDS = ("hf_source", "hf_token_ids", "hf_dtype", "hf_tokenizer", "hf_model_type")


HF_WEIGHTS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.bin",
)
"""A Hugging Face model's or PEFT adapter's weights: safetensors, or PyTorch's older .bin."""

HF_FILES = ("config.json", "adapter_config.json", "generation_config.json", *HF_WEIGHTS)
"""A Hugging Face model's or PEFT adapter's files."""


def is_hugging_face_folder(path: Path) -> bool:
    """A Hugging Face model or PEFT adapter folder: a config beside weights."""
    configured = (path / "config.json").is_file() or (path / "adapter_config.json").is_file()
    return configured and any(next(path.glob(pattern), None) for pattern in HF_WEIGHTS)


MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""The file in Megatron-LM's --save folder naming its newest complete checkpoint ("release" or an iteration)."""


def is_megatron_checkpoint(path: Path) -> bool:
    """Megatron-LM's --save folder or one of its iteration folders (torch_dist: a metadata.json naming its
    sharded_backend; the older torch format: mp_rank_* folders), which loom reads only through import-megatron
    (their iter_NNNNNNN folders are named as loom's)."""
    if (path / MEGATRON_TRACKER).is_file() or next(path.glob("mp_rank_*"), None) is not None:
        return True
    return megatron_backend(path) is not None


def megatron_backend(path: Path) -> str | None:
    """The `sharded_backend` (torch_dist, zarr) megatron-core's metadata.json in `path` names; None where `path`
    holds no such file (loom's own metadata.json names none)."""
    try:  # megatron-core's is a line; loom's own (a record per tensor) is not parsed twice
        if (path / METADATA).stat().st_size >= 4096:
            return None
        recorded = json.loads((path / METADATA).read_text())
    except (OSError, ValueError):
        return None
    return recorded.get("sharded_backend") if isinstance(recorded, dict) else None


def foreign_checkpoint_hint(path: Path) -> str:
    """For a refusal of `path` as a checkpoint: how to use it, if it is a Hugging Face model folder or a Megatron-LM
    checkpoint instead."""
    if (path / "config.json").is_file() and next(path.glob("*.safetensors"), None) is not None:
        return f"; it is a Hugging Face model: import it first, loom ckpt import-hf --input {path} --output DIR"
    if path.is_dir() and is_megatron_checkpoint(path):
        return (
            f"; it is a Megatron-LM checkpoint: import it first, loom ckpt import-megatron --input {path} --output DIR"
        )
    return ""


def read_metadata(directory: Path, verify_hashes: bool = True) -> CheckpointMetadata:
    """The metadata of a complete, intact checkpoint, or CheckpointError saying what is wrong."""
    path = directory / METADATA
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: no {METADATA}")
    try:
        metadata = CheckpointMetadata.from_json(path.read_text())
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint {directory}: {error}") from None
    size = sum(expected.size for expected in metadata.files.values())
    if verify_hashes and size > SLOW_HASH_BYTES:  # a 1B training checkpoint took 3-4 s of silence, an 8B's a minute
        print(f"checking the sha256 of {directory}'s {size / 1e9:,.1f} GB", flush=True)
    for name, expected in metadata.files.items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
        if file.stat().st_size != expected.size:
            raise CheckpointError(
                f"checkpoint {directory}: {name} has {file.stat().st_size} bytes, expected {expected.size} (truncated?"
                " copy it again whole, or load an earlier iter_N)"
            )
    if verify_hashes:
        # One file per thread (hashlib lets go of the GIL): the ranks' files of a large checkpoint are hashed side
        # by side, at the disk's pace rather than one core's (~1.75 GB/s).
        names = list(metadata.files)
        workers = max(1, min(len(names), os.cpu_count() or 1, 8))
        with ThreadPoolExecutor(workers) as pool:
            digests = list(pool.map(lambda name: sha256_of(directory / name), names))
        for name, digest in zip(names, digests, strict=True):
            if digest != metadata.files[name].sha256:
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


def is_checkpoint_dir(path: Path) -> bool:
    """An iteration directory (iter_N) of a checkpoint, complete or not."""
    return (path / METADATA).exists() or bool(_ITERATION.match(path.name))


def enclosing_checkpoint(path: Path, folders: bool = False) -> Path | None:
    """The checkpoint `path` is or lies in (an iter_N directory; with `folders`, also a checkpoints folder that
    holds checkpoints), nearest first; None if none: what no run or new checkpoint may be written into."""
    for folder in (path, *path.absolute().parents):
        if is_checkpoint_dir(folder) or (folders and folder.name == CHECKPOINTS and candidates(folder)):
            return folder
    return None


def find_loadable(
    path: Path, verify_hashes: bool = True, warn=print, damaged: list[CheckpointError] | None = None
) -> tuple[Path, CheckpointMetadata] | None:
    """A checkpoint to resume from: `path` itself if it is an iteration directory, else the newest
    intact one under it (falling back past damaged ones, with a warning, their errors appended to `damaged`);
    None if there is none (Megatron-LM's checkpoints are none: foreign_checkpoint_hint says what they are). A run
    directory stands for its checkpoints/ folder."""
    if path.is_dir() and is_megatron_checkpoint(path):
        return None
    if is_checkpoint_dir(path):
        return path, read_metadata(path, verify_hashes)
    if (path / CHECKPOINTS).is_dir() and not candidates(path):
        path = path / CHECKPOINTS
    for directory in candidates(path):
        try:
            return directory, read_metadata(directory, verify_hashes)
        except CheckpointError as error:
            warn(f"warning: {error}; falling back to an older checkpoint")
            if damaged is not None:
                damaged.append(error)
    return None


def checkpoint_to_resume(
    run_checkpoints: Path, load: str | None, verify_hashes: bool = True, warn=print
) -> tuple[Path, CheckpointMetadata] | None:
    """What a training run starts from: its own newest intact checkpoint once it has one (so rerunning the same
    command, or a requeued job, continues the run instead of going back to checkpoint.load), else checkpoint.load,
    else nothing. A run whose own checkpoints are all damaged is refused unless checkpoint.load names one."""
    damaged: list[CheckpointError] = []
    own = find_loadable(run_checkpoints, verify_hashes, warn, damaged)
    if own is not None:
        return own
    if load:
        found = find_loadable(Path(load), verify_hashes, warn)
        if found is None:
            raise CheckpointError(f"no intact checkpoint under {load}")
        return found
    if damaged:  # starting afresh would write over this run's own files
        raise CheckpointError(
            f"{run_checkpoints} holds checkpoints but none is intact (the newest: {damaged[0]}); load an older one "
            f"with --checkpoint.load, or move {run_checkpoints.parent} aside to start over"
        )
    return None


def staging_dir(final: Path) -> Path:
    """Where the files of `final` are written before commit() renames them into place."""
    return final.with_name(final.name + ".tmp")


def make_staging_dir(final: Path) -> Path:
    """An empty staging directory for `final` (what an interrupted earlier attempt left there is discarded)."""
    staging = staging_dir(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


@contextmanager
def staged(final: Path) -> Iterator[Path]:
    """make_staging_dir for a single writer (the offline tools), removed again if the block fails: a full disk
    or a stop leaves no half-written folder beside the checkpoints. So is `final` if commit() sealed it and then
    could not write `latest`: a tool's output holding a checkpoint is refused to its rerun."""
    staging, existed = make_staging_dir(final), final.exists()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not existed:
            shutil.rmtree(final, ignore_errors=True)
        raise


def write_rank_file(staging: Path, rank: int, pieces: dict[str, torch.Tensor]) -> tuple[str, FileRecord]:
    """Write one rank's pieces into the staging directory; its file name and record for the metadata."""
    name = rank_file(rank)
    save_tensors_atomically(pieces, staging / name)
    return name, FileRecord.of(staging / name)


def stream_rank_file(staging: Path, rank: int, declared: dict, make: Callable) -> tuple[str, FileRecord]:
    """write_rank_file for pieces made one at a time (stream_tensors_atomically: {key: (dtype, shape)} and
    make(key)), so a tool writing a whole model holds one tensor of it, not all."""
    name = rank_file(rank)
    stream_tensors_atomically(declared, make, staging / name)
    return name, FileRecord.of(staging / name)


def commit(staging: Path, final: Path, metadata: CheckpointMetadata, keep: int | None = None) -> Path:
    """Seal a fully written staging directory as checkpoint `final` and point `latest` at it.

    The order makes it crash-safe: metadata.json is written (atomically) only after every file it
    describes, the directory is renamed into place in one step, and `latest` moves last; a crash
    before the rename leaves the previous checkpoint as `latest` and the staging directory ignored.
    With `keep`, checkpoints beyond the newest `keep` in final's parent are then removed.
    """
    missing = sorted(name for name in metadata.files if not (staging / name).is_file())
    if missing:
        raise CheckpointError(f"cannot commit {final}: {', '.join(missing)} not written in {staging}")
    write_text_atomically(staging / METADATA, metadata.to_json())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    write_text_atomically(final.parent / LATEST, final.name + "\n")
    if keep is not None:
        for old in candidates(final.parent)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    _remove_saves_cut_short(final.parent)
    return final


def _remove_saves_cut_short(checkpoints: Path) -> None:
    """The staging folders a killed save left (a Slurm stop mid-save: a whole checkpoint's size each, never loaded):
    only one save writes into a checkpoints folder at a time (the run's lock, a tool's output lock), so once one is
    sealed any other is a leftover. Only the folder of the step being saved was cleared before."""
    stale = sorted(p for p in checkpoints.iterdir() if _STAGING.match(p.name) and p.is_dir())
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    if stale:
        print(f"removed {', '.join(p.name for p in stale)} from {checkpoints}: saves cut short, never loadable")


def _migrated_layout(layout: dict) -> dict:
    """Checkpoints written before ZeRO 2 existed say zero1 = true/false instead of the stage."""
    if "zero1" in layout:
        layout = {name: value for name, value in layout.items() if name != "zero1"} | {"zero": int(layout["zero1"])}
    return layout

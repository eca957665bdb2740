"""Offline checkpoint tools: inspect, and reshard to another (tp, pp, vp) layout on one CPU machine.

Resharding streams: each piece of each target rank's file is rebuilt from the source pieces when its bytes are
written, one logical tensor at a time, so memory holds one tensor (and the pages of the source files the kernel maps
in, which it can take back). The result is an ordinary checkpoint saved "as if" at the target layout with one DP
rank and zero = 0 (which any DP size and ZeRO stage loads). FP8 scaling state is carried over by module name;
factored Adafactor state is not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Iterator

import torch

from loom.engine.checkpoint.format import (
    CheckpointError,
    CheckpointLayout,
    CheckpointMetadata,
    buffer_key,
    buffer_names,
    commit,
    find_loadable,
    foreign_checkpoint_hint,
    iteration_dir,
    model_key,
    optim_key,
    staged,
    stream_rank_file,
)
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config import LoomConfig
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model import naming
from loom.engine.model.gpt import GPTModel
from loom.engine.model.moe import expert_biases
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.sharding import ShardSpec
from loom.engine.parallel.state import rank_of
from loom.engine.parallel.vocab import padded_vocab_size
from loom.engine.pipeline.stages import stage_layers
from loom.tools.outputs import claimed_checkpoint_output


def open_checkpoint(path: Path) -> tuple[Path, CheckpointMetadata]:
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file; give a checkpoint: a run directory, its checkpoints/ or an iter_N folder"
        )
    found = find_loadable(path)
    if found is None:
        raise CheckpointError(f"no intact checkpoint at {path}{foreign_checkpoint_hint(path)}")
    return found


def first_few(names: list[str], most: int = 3) -> str:
    """`names` for a one-line message: the first `most`, and how many more."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


class LazyWeights(Mapping):
    """Logical weights by name, each made only when it is asked for; their shapes are known up front (from
    metadata or file headers), so a mismatch is refused before anything is written. What import-hf, merge-lora and
    export-hf write from: made all at once, an 8B model's merge or import held 2-3.5x the model."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], make: Callable[[str], torch.Tensor] | None = None):
        """`make(name)` makes one weight; None for a subclass with a __getitem__ of its own."""
        self.shapes = shapes
        self._make = make

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> LazyWeights:
        """`tensors` itself if lazy, else a plain dict of tensors seen as LazyWeights."""
        if isinstance(tensors, LazyWeights):
            return tensors
        return cls({name: tuple(tensor.shape) for name, tensor in tensors.items()}, tensors.__getitem__)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self._make(name)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def write_weights_checkpoint(
    output: Path,
    config: LoomConfig,
    logical: Mapping[str, torch.Tensor],
    source: str,
    hf_origin: dict | None = None,
    tokenizer: dict | None = None,
) -> Path:
    """Write a weights-only checkpoint (step 0, tp = pp = 1, fp32, no optimizer state) of `config`'s model from
    its logical tensors (LazyWeights: each made when written, so memory holds one), as iter_0000000 under `output`:
    what import-hf and merge-lora produce, and any layout loads. `source` names where the tensors came from, for the
    error when one is missing or misshapen; `hf_origin`: the Hugging Face fields of an import
    (CheckpointMetadata.hf_origin); `tokenizer`: the tokenizer the weights were trained with
    (CheckpointMetadata.tokenizer)."""
    logical = LazyWeights.of(logical)
    model = GPTModel(config.model, None)
    infos = [param_info(param) for param in model.parameters()]
    specs = {info.name: info.shard_spec for info in infos}
    for name, spec in specs.items():
        if name not in logical:
            raise CheckpointError(f"{source} has no tensor for loom's {name}")
        if tuple(logical.shapes[name]) != spec.full_shape:
            raise CheckpointError(
                f"{name}: shape {tuple(logical.shapes[name])} in {source}, the config says {spec.full_shape}"
            )
    names = {model_key(name, 0): name for name in specs}
    # the experts' biases (model.moe_expert_bias) where the source has them: without, the model starts with none
    biases = {name: bias.shape for name, bias in expert_biases([model]).items()}
    buffers = {buffer_key(name): name for name in biases if name in logical.shapes}
    for name in buffers.values():
        if tuple(logical.shapes[name]) != tuple(biases[name]):
            raise CheckpointError(
                f"{name}: shape {tuple(logical.shapes[name])} in {source}, {tuple(biases[name])} here"
            )

    def piece(key: str) -> torch.Tensor:
        if key in buffers:
            return logical[buffers[key]].float().contiguous()
        name = names[key]
        tensor = logical[name]
        if tuple(tensor.shape) != specs[name].full_shape:  # the header said otherwise than the data
            raise CheckpointError(
                f"{name}: shape {tuple(tensor.shape)} in {source}, the config says {specs[name].full_shape}"
            )
        return specs[name].shard(tensor.float(), 0, 1).contiguous()

    final = iteration_dir(output, 0)
    declared = {key: (torch.float32, specs[name].local_shape(1)) for key, name in names.items()}
    declared.update({key: (torch.float32, tuple(biases[name])) for key, name in buffers.items()})
    with staged(final) as staging:
        file, record = stream_rank_file(staging, 0, declared, piece)
        metadata = CheckpointMetadata(
            step=0,
            consumed_samples=0,
            tokens=0,
            layout=CheckpointLayout(tp=1, pp=1, vp=1, dp=1, world=1, zero=0, optimizer=None, precision="fp32"),
            optimizer_step=0,
            loss_scaler=None,
            config=config_to_dict(config),
            specs=specs,
            files={file: record},
            index={key: file for key in declared},
            tokenizer=tokenizer,
            **(hf_origin or {}),
        )
        return commit(staging, final, metadata)


def inspect(path: Path) -> str:
    directory, metadata = open_checkpoint(path)
    layout = dataclasses.asdict(metadata.layout)
    lines = [
        f"checkpoint {directory}",
        f"step {metadata.step}, {metadata.consumed_samples:,} samples, {metadata.tokens:,} tokens",
        "layout " + " ".join(f"{k}={v}" for k, v in layout.items()),
        f"files {len(metadata.files)}, {sum(f.size for f in metadata.files.values()) / 1e6:.1f} MB",
        *(
            [
                f"LoRA adapters on the base {metadata.lora_base['path']} (metadata sha256 "
                f"{metadata.lora_base['metadata_sha256'][:16]}...)"
            ]
            if metadata.lora_base
            else []
        ),
        *(
            [f"tokenizer {metadata.tokenizer['path']} (sha256 {metadata.tokenizer['sha256'][:16]}...)"]
            if metadata.tokenizer
            else []
        ),
        *(
            [
                f"from the Hugging Face model {metadata.hf_source} (stored as {metadata.hf_dtype}; special tokens "
                f"{metadata.hf_token_ids})"
            ]
            if metadata.hf_origin
            else []
        ),
        f"{'tensor':48} {'shape':>18} {'parameters':>12}  optimizer state",
    ]
    reader = PieceReader(directory, metadata)
    total = 0
    for name, spec in sorted(metadata.specs.items(), key=lambda item: _model_order(item[0])):
        shape = spec.full_shape
        count = int(torch.Size(shape).numel())
        total += count
        lines.append(f"{name:48} {str(shape):>18} {count:12,}  {', '.join(sorted(reader.states(name))) or '-'}")
    lines.append(f"total parameters {total:,}")
    for name, key in sorted(buffer_names(metadata).items(), key=lambda item: _model_order(item[0])):
        lines.append(f"{name:48} {str(reader.header(key)[1]):>18} {'(buffer)':>12}  -")
    return "\n".join(lines)


def _model_order(name: str) -> tuple:
    """Embedding, blocks by index, final norm and output: the order of the model, not of the ranks that wrote it."""
    layer = naming.layer_index(name)
    return (1, layer, name) if layer is not None else (0 if naming.before_blocks(name) else 2, 0, name)


def _stage_of(name: str, num_layers: int, pp: int, vp: int) -> int:
    """The virtual stage that holds a parameter in a (pp, vp) layout."""
    layer = naming.layer_index(name)
    if layer is not None:
        return next(s for s in range(pp * vp) if layer in stage_layers(num_layers, pp, vp, s))
    return 0 if naming.before_blocks(name) else pp * vp - 1


def reshard(source: Path, output: Path, tp: int, pp: int, vp: int = 1, overwrite: bool = False) -> Path:
    """Write the checkpoint at `source` as iter_N under `output` (claimed as tools/outputs.py says), laid out for
    tp x pp (x vp)."""
    directory, metadata = open_checkpoint(source)
    layers = metadata.config["model"]["num_layers"]
    if layers % (pp * vp):
        raise CheckpointError(f"{layers} layers do not split into pp*vp = {pp}*{vp} stages")
    # the layout's own checks are train's (vp > 1 at pp 1 was written, and then refused by loom train)
    parallel = {"tp": tp, "pp": pp, "vp": vp}
    config_from_dict({"model": metadata.config["model"], "parallel": parallel}).model.check_tensor_parallel(tp)
    with claimed_checkpoint_output(output, overwrite, reading=(directory,)):
        reader = PieceReader(directory, metadata)
        final = output / directory.name
        specs, files, index = {}, {}, {}
        divisible_by = metadata.config["model"]["make_vocab_divisible_by"]
        # FP8 scaling state and buffers (experts' biases): the same on every TP rank, one copy per stage, as saved
        per_stage = {
            key: name
            for key in metadata.index
            for prefix in ("fp8/", "buffer/")
            if key.startswith(prefix) and (name := key.removeprefix(prefix))
        }
        with staged(final) as staging:
            for pp_rank in range(pp):
                names = [n for n in metadata.specs if _stage_of(n, layers, pp, vp) % pp == pp_rank]
                for tp_rank in range(tp):
                    declared, make = _rank_pieces(reader, names, tp_rank, tp, divisible_by, specs)
                    if tp_rank == 0:
                        for key in [
                            k for k, name in per_stage.items() if _stage_of(name, layers, pp, vp) % pp == pp_rank
                        ]:
                            declared[key], make[key] = reader.header(key), functools.partial(reader.tensor, key)
                    rank = rank_of(tp_rank, 0, pp_rank, tp, 1)
                    name, files[name] = stream_rank_file(staging, rank, declared, _made_by(make))
                    index.update({key: name for key in declared})
            layout = dataclasses.replace(metadata.layout, tp=tp, pp=pp, vp=vp, dp=1, cp=1, ep=1, world=tp * pp, zero=0)
            resharded = dataclasses.replace(metadata, specs=specs, files=files, index=index, layout=layout)
            return commit(staging, final, resharded)


def _rank_pieces(
    reader: PieceReader, names: list[str], tp_rank: int, tp: int, divisible_by: int, specs: dict
) -> tuple[dict, dict]:
    """What one target rank's file holds, declared (key: dtype, shape) and made when written (key: a function):
    each parameter and optimizer state rebuilt from the source when its turn comes, so memory holds one logical
    tensor, not the rank's share (a reshard to tp 1 of an 8B training checkpoint held 112 GB)."""
    declared, make = {}, {}
    for name in names:
        spec = specs[name] = _retarget(reader.metadata.specs[name], tp, divisible_by)
        local_shape = spec.local_shape(tp)
        key = model_key(name, tp_rank)
        declared[key] = (reader.model_dtype(name), local_shape)
        make[key] = functools.partial(_model_piece, reader, spec, name, tp_rank, tp)
        for state in sorted(reader.states(name)):
            numel = math.prod(local_shape)
            key = optim_key(state, name, tp_rank, 0, numel)
            declared[key] = (torch.float32, (numel,))
            make[key] = functools.partial(_optim_piece, reader, spec, state, name, tp_rank, tp)
    return declared, make


def _made_by(makers: dict[str, Callable[[], torch.Tensor]]) -> Callable[[str], torch.Tensor]:
    return lambda key: makers[key]()


def _model_piece(reader: PieceReader, spec: ShardSpec, name: str, tp_rank: int, tp: int) -> torch.Tensor:
    return spec.shard(reader.model(name), tp_rank, tp).contiguous()


def _optim_piece(reader: PieceReader, spec: ShardSpec, state: str, name: str, tp_rank: int, tp: int) -> torch.Tensor:
    return spec.shard(reader.optim(state, name), tp_rank, tp).reshape(-1).contiguous()


def _retarget(spec: ShardSpec, tp: int, divisible_by: int) -> ShardSpec:
    """The same parameter's ShardSpec at another TP size (only the vocabulary padding depends on it)."""
    if spec.padded_size is None:
        return spec
    return ShardSpec(
        spec.full_shape, spec.dim, spec.blocks, padded_vocab_size(spec.full_shape[spec.dim], divisible_by, tp)
    )

"""Offline checkpoint tools: inspect, and reshard to another (tp, pp, vp) layout on one CPU machine.

Resharding streams: for each target rank it rebuilds only that rank's parameters, one logical tensor at a time, from
the source pieces, and writes that rank's file before the next, so memory stays at about one rank's share plus one
tensor. The result is an ordinary checkpoint saved "as if" at the target layout with one DP rank and zero = 0 (which
any DP size and ZeRO stage loads). FP8 scaling state is carried over by module name; factored Adafactor state is
not.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from loom.engine.checkpoint.format import (
    CheckpointError,
    CheckpointLayout,
    CheckpointMetadata,
    commit,
    find_loadable,
    fp8_key,
    hugging_face_hint,
    iteration_dir,
    model_key,
    optim_key,
    staged,
    write_rank_file,
)
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config import LoomConfig
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model import naming
from loom.engine.model.gpt import GPTModel
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.sharding import ShardSpec
from loom.engine.parallel.state import rank_of
from loom.engine.parallel.vocab import padded_vocab_size
from loom.engine.pipeline.stages import stage_layers
from loom.tools.outputs import claim_checkpoint_output


def open_checkpoint(path: Path) -> tuple[Path, CheckpointMetadata]:
    found = find_loadable(path)
    if found is None:
        raise CheckpointError(f"no intact checkpoint at {path}{hugging_face_hint(path)}")
    return found


def write_weights_checkpoint(
    output: Path,
    config: LoomConfig,
    logical: dict[str, torch.Tensor],
    source: str,
    hf_origin: dict | None = None,
    tokenizer: dict | None = None,
) -> Path:
    """Write a weights-only checkpoint (step 0, tp = pp = 1, fp32, no optimizer state) of `config`'s model from
    its logical tensors, as iter_0000000 under `output`: what import-hf and merge-lora produce, and any layout
    loads. `source` names where the tensors came from, for the error when one is missing or misshapen;
    `hf_origin`: the Hugging Face fields of an import (CheckpointMetadata.hf_origin); `tokenizer`: the
    tokenizer the weights were trained with (CheckpointMetadata.tokenizer)."""
    infos = [param_info(param) for param in GPTModel(config.model, None).parameters()]
    specs = {info.name: info.shard_spec for info in infos}
    for name, spec in specs.items():
        if name not in logical:
            raise CheckpointError(f"{source} has no tensor for loom's {name}")
        if tuple(logical[name].shape) != spec.full_shape:
            raise CheckpointError(
                f"{name}: shape {tuple(logical[name].shape)} in {source}, the config says {spec.full_shape}"
            )
    final = iteration_dir(output, 0)
    pieces = {model_key(name, 0): spec.shard(logical[name].float(), 0, 1).contiguous() for name, spec in specs.items()}
    with staged(final) as staging:
        name, record = write_rank_file(staging, 0, pieces)
        metadata = CheckpointMetadata(
            step=0,
            consumed_samples=0,
            tokens=0,
            layout=CheckpointLayout(tp=1, pp=1, vp=1, dp=1, world=1, zero=0, optimizer=None, precision="fp32"),
            optimizer_step=0,
            loss_scaler=None,
            config=config_to_dict(config),
            specs=specs,
            files={name: record},
            index={key: name for key in pieces},
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
    claim_checkpoint_output(output, overwrite, reading=(directory,))
    reader = PieceReader(directory, metadata)
    final = output / directory.name
    specs, files, index = {}, {}, {}
    divisible_by = metadata.config["model"]["make_vocab_divisible_by"]
    fp8_modules = [key.removeprefix("fp8/") for key in metadata.index if key.startswith("fp8/")]
    with staged(final) as staging:
        for pp_rank in range(pp):
            names = [n for n in metadata.specs if _stage_of(n, layers, pp, vp) % pp == pp_rank]
            for tp_rank in range(tp):
                pieces = _rank_pieces(reader, names, tp_rank, tp, divisible_by, specs)
                if tp_rank == 0:  # FP8 scaling state is the same on every TP rank: one copy per stage, as saved
                    modules = [m for m in fp8_modules if _stage_of(m, layers, pp, vp) % pp == pp_rank]
                    pieces.update({fp8_key(m): reader.tensor(fp8_key(m)) for m in modules})
                name, files[name] = write_rank_file(staging, rank_of(tp_rank, 0, pp_rank, tp, 1), pieces)
                index.update({key: name for key in pieces})
                del pieces
        layout = dataclasses.replace(metadata.layout, tp=tp, pp=pp, vp=vp, dp=1, cp=1, world=tp * pp, zero=0)
        resharded = dataclasses.replace(metadata, specs=specs, files=files, index=index, layout=layout)
        return commit(staging, final, resharded)


def _rank_pieces(reader: PieceReader, names: list[str], tp_rank: int, tp: int, divisible_by: int, specs: dict) -> dict:
    pieces = {}
    for name in names:
        spec = _retarget(reader.metadata.specs[name], tp, divisible_by)
        specs[name] = spec
        pieces[model_key(name, tp_rank)] = spec.shard(reader.model(name), tp_rank, tp).contiguous()
        for state in sorted(reader.states(name)):
            local = spec.shard(reader.optim(state, name), tp_rank, tp).reshape(-1).contiguous()
            pieces[optim_key(state, name, tp_rank, 0, local.numel())] = local
    return pieces


def _retarget(spec: ShardSpec, tp: int, divisible_by: int) -> ShardSpec:
    """The same parameter's ShardSpec at another TP size (only the vocabulary padding depends on it)."""
    if spec.padded_size is None:
        return spec
    return ShardSpec(
        spec.full_shape, spec.dim, spec.blocks, padded_vocab_size(spec.full_shape[spec.dim], divisible_by, tp)
    )

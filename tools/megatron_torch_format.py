"""Megatron-LM's older `torch` checkpoint format, read as import-megatron reads torch_dist (megatron_checkpoint.py).

Until torch_dist became its default (2024), Megatron-LM saved each tensor- and pipeline-parallel rank's own state
dict: iter_N/mp_rank_TT/model_optim_rng.pt, or mp_rank_TT_PPP under pipeline parallelism (get_checkpoint_name in
megatron/training/checkpointing.py). In it: `args`, `iteration`, `checkpoint_version` and the model's local pieces
under megatron-core's names (`model`, or `model0`, `model1`, ... for the virtual stages of an interleaved schedule),
each chunk's layers numbered from 0; the optimizer's and random-number states beside them, which are not read.
Files from Megatron-LM's legacy model (megatron/legacy, the only one before megatron-core; removed from Megatron-LM
in 2026, whose tools therefore no longer convert them) nest the same tensors under language_model.embedding, .encoder
(.transformer before 2021) and .output_layer with names of their own: they are renamed to megatron-core's, and the
QKV rows of the first checkpoint versions reordered as Megatron's load reordered them.

The pieces are joined back into the tensors torch_dist holds under the same names, by how megatron-core splits each
layer: column-parallel rows (the embedding's and output layer's vocabulary, QKV, fc1) concatenated, row-parallel
columns (the attention and MLP output projections) concatenated, the rest (norms, the row-parallel biases, learned
positions) taken from the first tensor rank. SwiGLU's fc1 is each rank's [gate; up] slice, so the gates are joined and
then the ups. Layers take their place in the order Megatron's schedule runs the chunks: virtual stage by virtual stage,
pipeline rank by pipeline rank within each.

Files are opened with torch's weights-only unpickler, memory-mapped: a tensor is read from disk when it is joined, so
memory holds one of loom's tensors at a time, not the optimizer's state beside it.
"""

from __future__ import annotations

import argparse
import pickle
import re
import zipfile
from pathlib import Path

import torch

from loom.engine.checkpoint.format import CheckpointError

RANK_FILES = ("model_optim_rng.pt", "model_rng.pt")
"""A rank's file: model, optimizer and random states; model and random states alone where the distributed optimizer
kept its state apart (Megatron-LM from 2022-03 to 2023-05: mp_rank_TT[_PPP]_DDD/optim.pt beside it)."""
_COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer")
_ROW_PARALLEL = ("linear_proj", "linear_fc2")


class _Placeholder:
    """Stands in for a class pickled beside the tensors (an enum member of the arguments such as AttnBackend.auto,
    numpy's random state, Transformer Engine's extra state) that loom reads none of."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def load_pickled(path: Path, mmap: bool = False):
    """What torch.save wrote at `path`, read by torch's weights-only unpickler (no code from the file runs), every
    class in it other than argparse.Namespace stood in for by a placeholder; `mmap`: tensors read when used."""
    try:
        with open(path, "rb") as file:
            if file.read(1) == b"\x80" and not zipfile.is_zipfile(path):  # a pickle first: torch's format before 1.6
                raise CheckpointError(
                    f"{path} was saved by PyTorch before 1.6, whose format loom does not read; re-save it with a newer "
                    "PyTorch (torch.save(torch.load(path, weights_only=False), path)) if you trust it"
                )
        pickled = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        foreign = [name for name in pickled if name != "argparse.Namespace"]
        stand_ins = [(type(name.rpartition(".")[2], (_Placeholder,), {}), name) for name in foreign]
        with torch.serialization.safe_globals([argparse.Namespace, *stand_ins]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read ({str(error).splitlines()[0][:200]}); truncated?") from None


def rank_folder(tp_rank: int, pp_rank: int, pipeline_parallel: bool) -> str:
    """The folder Megatron-LM saves a tensor/pipeline rank's file in (get_checkpoint_name)."""
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" if pipeline_parallel else f"mp_rank_{tp_rank:02d}"


def rank_file(rank_dir: Path) -> Path | None:
    """The model's file in a rank's folder; None where the folder holds none (an optimizer's, or incomplete)."""
    return next((rank_dir / name for name in RANK_FILES if (rank_dir / name).is_file()), None)


def first_rank_file(folder: Path) -> Path:
    """Rank 0's file in the iteration folder `folder`, which holds the run's arguments."""
    for name in (rank_folder(0, 0, False), rank_folder(0, 0, True)):
        if (found := rank_file(folder / name)) is not None:
            return found
    raise CheckpointError(f"Megatron checkpoint {folder} is incomplete: no mp_rank_00/{RANK_FILES[0]}")


# Megatron-LM's legacy model (megatron/legacy, --use-legacy-models; removed in 2026) -> megatron-core's names of the
# same tensors: (pattern of a flattened legacy key, its core name). Before 2021 the blocks were "transformer" and
# "attention", the norms input_layernorm, post_attention_layernorm and final_layernorm.
_LEGACY_BLOCKS = r"language_model\.(?:encoder|transformer)\."
_LEGACY_LAYER = _LEGACY_BLOCKS + r"layers\.(\d+)\."
_LEGACY_ATTENTION = _LEGACY_LAYER + r"(?:self_attention|attention)\."
_LEGACY_NAMES = tuple(
    (re.compile(pattern), name)
    for pattern, name in (
        (r"language_model\.embedding\.(word|position)_embeddings\.", r"embedding.\1_embeddings."),
        (_LEGACY_LAYER + r"input_(?:norm|layernorm)\.", r"decoder.layers.\1.input_layernorm."),
        (_LEGACY_ATTENTION + r"query_key_value\.", r"decoder.layers.\1.self_attention.linear_qkv."),
        (_LEGACY_ATTENTION + r"dense\.", r"decoder.layers.\1.self_attention.linear_proj."),
        (_LEGACY_LAYER + r"post_attention_(?:norm|layernorm)\.", r"decoder.layers.\1.pre_mlp_layernorm."),
        (_LEGACY_LAYER + r"mlp\.dense_h_to_4h\.", r"decoder.layers.\1.mlp.linear_fc1."),
        (_LEGACY_LAYER + r"mlp\.dense_4h_to_h\.", r"decoder.layers.\1.mlp.linear_fc2."),
        (_LEGACY_BLOCKS + r"final_(?:norm|layernorm)\.", "decoder.final_layernorm."),
        (r"language_model\.output_layer\.", "output_layer."),
    )
)  # fmt: skip


def _flattened(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _core_names(state: dict, version: float, args: dict, tp: int) -> dict:
    """A legacy model's state dict (nested: language_model.embedding/encoder/output_layer) under megatron-core's
    names. Its QKV rows are megatron-core's since checkpoint_version 2.0 (per query group: its queries, key and
    value); older ones are reordered as Megatron's load did (fix_query_key_value_ordering): version 0 held [3, heads,
    head size] on each rank, version 1 [heads, head size, 3]."""
    core = {}
    for key, value in _flattened(state).items():
        if key.endswith("._extra_state") or key.startswith("word_embeddings_for_head."):
            continue  # the last pipeline stage's copy of a tied embedding, which the first stage holds
        for pattern, name in _LEGACY_NAMES:
            if pattern.match(key):
                key = pattern.sub(name, key, count=1)
                break
        else:
            raise CheckpointError(f"the legacy model holds {key}, which loom does not know; is it a GPT model?")
        if version < 2.0 and ".linear_qkv." in key:
            heads = args["num_attention_heads"] // tp
            head = args.get("kv_channels") or args["hidden_size"] // args["num_attention_heads"]
            shaped = value.reshape(*((3, heads, head) if version == 0 else (heads, head, 3)), *value.shape[1:])
            value = (shaped.transpose(0, 1) if version == 0 else shaped.transpose(1, 2)).reshape(value.shape)
        core[key] = value
    return core


def _layer_key(key: str) -> tuple[int, str] | None:
    """(local layer, the rest of the key) of a key inside decoder.layers.N., else None."""
    head, _, rest = key.partition("decoder.layers.")
    number, _, inside = rest.partition(".")
    return (int(number), inside) if not head and number.isdigit() else None


def _split_dim(key: str) -> int | None:
    """The dimension megatron-core splits `key` along across tensor ranks; None where each rank holds all of it."""
    owner, _, leaf = key.rpartition(".")
    module = owner.rpartition(".")[2]
    if leaf == "weight" and module in _ROW_PARALLEL:
        return 1
    if leaf in ("weight", "bias") and module in _COLUMN_PARALLEL:
        return 0
    return None


class TorchFormatCheckpoint:
    """The model tensors of a Megatron-LM `torch`-format iteration folder under torch_dist's names and global shapes,
    each joined from the ranks' files when read (the interface of megatron_checkpoint.DistributedCheckpoint)."""

    def __init__(self, folder: Path, args: dict):
        self.folder = folder
        tp = args.get("tensor_model_parallel_size") or args.get("model_parallel_size") or 1  # its name before 2020-10
        pp = args.get("pipeline_model_parallel_size") or 1
        vp = args.get("virtual_pipeline_model_parallel_size") or 1
        if args.get("pipeline_model_parallel_layout"):
            raise CheckpointError(
                f"{folder} was trained with --pipeline-model-parallel-layout, whose layer order this reader does "
                "not follow; convert it to torch_dist with Megatron-LM first"
            )
        self._swiglu = bool(args.get("swiglu"))
        self._tied = not args.get("untie_embeddings_and_output_weights", False)
        found = sorted(p.name for p in folder.glob("mp_rank_*") if rank_file(p) is not None)
        ranks = [(t, p) for t in range(tp) for p in range(pp)]
        paths = {(t, p): rank_file(folder / rank_folder(t, p, pp > 1)) for t, p in ranks}
        missing = [rank_folder(t, p, pp > 1) for (t, p), path in paths.items() if path is None]
        if missing or len(found) != len(ranks):
            said = f"no {missing[0]}/{RANK_FILES[0]}" if missing else f"{len(found)} hold a model's file"
            raise CheckpointError(
                f"Megatron checkpoint {folder} does not match its arguments (tensor {tp} x pipeline {pp}: "
                f"{len(ranks)} mp_rank folders): {said}; is it incomplete, or saved with expert parallelism?"
            )
        # chunks[i][t]: the state dict of the i-th chunk in the order the layers run, on tensor rank t
        files = {rank: load_pickled(path, mmap=True) for rank, path in paths.items()}
        chunk_keys = ["model"] if vp == 1 else [f"model{v}" for v in range(vp)]
        self.chunks: list[list[dict[str, torch.Tensor]]] = []
        self.legacy_model = False
        """Megatron-LM's legacy model (megatron/legacy) wrote it: its tensors renamed to megatron-core's."""
        for key in chunk_keys:
            for p in range(pp):
                states = [files[t, p].get(key) if isinstance(files[t, p], dict) else None for t in range(tp)]
                lacking = next((t for t, state in enumerate(states) if not isinstance(state, dict)), None)
                if lacking is not None:
                    raise CheckpointError(
                        f"{paths[lacking, p]} holds no {key!r} model state, which "
                        f"its arguments say it has ({vp} virtual pipeline stage(s)); was it written by Megatron-LM?"
                    )
                if any("language_model" in state for state in states):
                    if args.get("transformer_impl") == "transformer_engine":
                        raise CheckpointError(
                            f"{folder} holds Megatron-LM's legacy model built of Transformer Engine's layers "
                            "(--use-legacy-models --transformer-impl transformer_engine), whose tensors loom does not "
                            "read; convert it with tools/checkpoint/convert.py --loader legacy "
                            "--loader-transformer-impl transformer_engine --saver core of a Megatron-LM from before "
                            "2026-08 (which still has the legacy model), then import that"
                        )
                    self.legacy_model = True
                    version = files[0, p].get("checkpoint_version", 0)
                    states = [_core_names(state, version, args, tp) for state in states]
                self.chunks.append(states)
        self._where: dict[str, tuple[int, str]] = {}
        offset = 0
        for index, states in enumerate(self.chunks):
            layers = 0
            for key in states[0]:
                if key.endswith("._extra_state") or not isinstance(states[0][key], torch.Tensor):
                    continue  # Transformer Engine's FP8 metadata: nothing of the model
                in_layer = _layer_key(key)
                if in_layer is not None:
                    layers = max(layers, in_layer[0] + 1)
                    global_key = f"decoder.layers.{offset + in_layer[0]}.{in_layer[1]}"
                elif key == "output_layer.weight" and self._tied and index > 0:
                    continue  # the last stage's copy of the tied embedding, which the first stage holds
                else:
                    global_key = key
                if global_key in self._where:
                    raise CheckpointError(f"{folder}: {global_key} is held by two pipeline stages")
                self._where[global_key] = (index, key)
            offset += layers
        self.num_layers = offset
        self.shapes = {key: self._shape(*where) for key, where in self._where.items()}
        self.dtypes = {key: self.chunks[index][0][local].dtype for key, (index, local) in self._where.items()}

    def _shape(self, index: int, local: str) -> tuple[int, ...]:
        pieces = [tuple(state[local].shape) for state in self.chunks[index]]
        dim = _split_dim(local)
        if dim is None or len(pieces) == 1:
            return pieces[0]
        if any(
            len(piece) <= dim or piece[:dim] + piece[dim + 1 :] != pieces[0][:dim] + pieces[0][dim + 1 :]
            for piece in pieces
        ):
            raise CheckpointError(f"{self.folder}: the tensor ranks' pieces of {local} do not fit together: {pieces}")
        return pieces[0][:dim] + (sum(piece[dim] for piece in pieces),) + pieces[0][dim + 1 :]

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """Tensor `key` joined from the tensor ranks' pieces (`index`: never given, each layer has keys of its own)."""
        chunk, local = self._where[key]
        pieces = [state[local] for state in self.chunks[chunk]]
        dim = _split_dim(local)
        try:
            if dim is None or len(pieces) == 1:
                return pieces[0].clone()
            if self._swiglu and local.rpartition(".")[0].endswith("linear_fc1"):
                halves = [piece.chunk(2) for piece in pieces]
                return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])
            return torch.cat(pieces, dim=dim)
        except RuntimeError as error:  # a truncated file's storage ends before the tensor does
            raise CheckpointError(f"{self.folder}: {key} cannot be read ({str(error).splitlines()[0][:200]})") from None

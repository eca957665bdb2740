"""Megatron-LM checkpoints -> loom: `loom ckpt import-megatron`.

Megatron-LM saves (`--ckpt-format torch_dist`, its default) a folder per iteration, iter_NNNNNNN under --save, the
newest named by latest_checkpointed_iteration.txt. In it, PyTorch distributed-checkpoint files (.metadata and
__R_K.distcp) hold every tensor under one global key whatever layout trained it (megatron-core's sharded state dict:
the blocks' tensors stacked on a first dimension of layers, or one key per layer), and common.pt holds the run's
arguments. Both are read here without Megatron: tensors with torch.distributed.checkpoint, one layer of a stacked
tensor at a time (memory holds one loom tensor, as import-hf's does); the arguments with torch's weights-only
unpickler, Megatron's own classes in them (enums such as AttnBackend) stood in for by a placeholder, as loom reads
none of them. The older torch format (a file per rank in mp_rank_* folders) is joined back into the same keys by
megatron_torch_format.py.

The model's shape comes from the arguments; the tensors then have to agree with it. Megatron's fused QKV holds each
query group's heads followed by its key and value head; loom's holds all queries, then keys, then values. Its SwiGLU
fc1 is [gate; up] like loom's; a zero-centred norm weight (--apply-layernorm-1p) is stored minus one; interleaved
rotary pairs (--rotary-interleaved) are loom's rotate-half pairs once each head's rows are reordered. The embedding
keeps Megatron's padded rows: its softmax ran over them. A setting loom cannot compute the same way is refused with
Megatron's flag, so an import never yields another model than the one trained. The weights are the model's as
saved (bf16 under --bf16); the optimizer state, fp32 main weights among it, is not read: fine-tuning starts a fresh
optimizer, as after import-hf.
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from loom.engine.checkpoint.format import MEGATRON_TRACKER as TRACKER
from loom.engine.checkpoint.format import CheckpointError, megatron_backend
from loom.engine.config import ModelConfig
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model import naming
from loom.tools.ckpt import LazyWeights, first_few, write_weights_checkpoint
from loom.tools.megatron_torch_format import TorchFormatCheckpoint, first_rank_file, load_pickled, rank_file
from loom.tools.outputs import claimed_checkpoint_output

COMMON = "common.pt"
"""What megatron-core's dist_checkpointing writes beside the tensors: every value of the state dict that is not
a tensor shard, Megatron-LM's `args` among them."""
LEGACY_CONVERSION = (
    "convert it to torch_dist with Megatron-LM first (train with --ckpt-convert-format torch_dist "
    "--ckpt-convert-save DIR --load IT), then import DIR"
)


def is_torch_format(folder: Path) -> bool:
    """An iteration folder in Megatron-LM's older torch format: a file per tensor/pipeline rank in mp_rank_* folders."""
    return next(folder.glob("mp_rank_*"), None) is not None


def megatron_iteration_folder(source: Path) -> Path:
    """The iteration folder to read: `source` itself, or the one its tracker file names."""
    tracker = source / TRACKER
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        if not (source / name).is_dir():
            raise CheckpointError(f"{tracker} names {name}, which {source} does not hold (deleted or not copied?)")
        source = source / name
    if is_torch_format(source):
        return source
    backend = megatron_backend(source)
    if backend is None and (source / ".metadata").is_file():
        raise CheckpointError(
            f"{source} is a torch.distributed checkpoint without megatron-core's metadata.json (Megatron-LM's "
            f"torch_dcp or fsdp_dtensor format?); loom reads torch_dist: {LEGACY_CONVERSION}"
        )
    if backend is None and source.name.startswith("mp_rank_") and rank_file(source) is not None:
        raise CheckpointError(
            f"{source} is one rank's part of a Megatron-LM checkpoint in the torch format; give the iteration folder "
            f"that holds every rank's, {source.parent}"
        )
    if backend is None:
        newest = sorted(p.name for p in source.glob("iter_*") if p.is_dir())[-1:]
        found = f" (it holds {newest[0]} but no {TRACKER}: give that folder)" if newest else ""
        raise CheckpointError(
            f"{source} is not a Megatron-LM checkpoint{found}; give a --save folder (with {TRACKER}) or an "
            "iter_N folder in it"
        )
    if backend != "torch_dist":
        raise CheckpointError(
            f"{source} is a Megatron checkpoint in the {backend} format; loom reads torch_dist (Megatron-LM's "
            f"default since 2024): {LEGACY_CONVERSION}"
        )
    for needed in (".metadata", COMMON):
        if not (source / needed).is_file():
            raise CheckpointError(f"Megatron checkpoint {source} is incomplete: no {needed}")
    return source


def arguments_file(folder: Path) -> Path:
    """Where an iteration folder keeps the run's arguments: common.pt, or rank 0's file in the older torch format."""
    return first_rank_file(folder) if is_torch_format(folder) else folder / COMMON


def read_megatron_arguments(folder: Path) -> dict:
    """Megatron-LM's arguments (its `args` Namespace as a dict) and `iteration`, from the checkpoint's
    arguments_file, without importing Megatron or running any code from the file."""
    path = arguments_file(folder)
    common = load_pickled(path, mmap=path.name != COMMON)
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(
            f"{path} holds no Megatron-LM arguments ('args'), which give the model's shape: was it written by "
            "Megatron-LM's training loop? (NeMo's checkpoints are not read)"
        )
    return {**vars(args), "iteration": common.get("iteration")}


class _SlicePlanner(dcp.DefaultLoadPlanner):
    """Reads the box (offsets, sizes) of one stored tensor into a tensor of that box's shape: DCP's own
    resharding, asked for a slice instead of the whole tensor."""

    def __init__(self, key: str, offsets: list[int], sizes: list[int]):
        super().__init__()
        self._key = key
        self._box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata[self._key]
        return LoadPlan(create_read_items_for_chunk_list(self._key, stored, [self._box]))

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the box itself: the read items' offsets are already relative to it


class DistributedCheckpoint:
    """The tensors of a torch.distributed.checkpoint folder by key, read whole or one index of the first
    dimension at a time (a layer of Megatron's stacked block tensors) without a process group."""

    legacy_model = False
    """torch_dist holds megatron-core's model: Megatron-LM's legacy one never wrote it."""

    def __init__(self, folder: Path):
        self.folder = folder
        try:
            self._metadata = dcp.FileSystemReader(str(folder)).read_metadata()
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, AttributeError) as error:
            raise CheckpointError(f"{folder / '.metadata'} cannot be read ({error}); truncated?") from None
        stored = self._metadata.state_dict_metadata
        self.shapes = {k: tuple(md.size) for k, md in stored.items() if isinstance(md, TensorStorageMetadata)}
        self.dtypes = {k: md.properties.dtype for k, md in stored.items() if isinstance(md, TensorStorageMetadata)}

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """Tensor `key`, or its `index`-th slice on the first dimension."""
        shape = self.shapes[key]
        offsets, sizes = [0] * len(shape), list(shape)
        if index is not None:
            offsets[0], sizes[0] = index, 1
        into = torch.empty(sizes, dtype=self.dtypes[key])
        try:
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as meant
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(
                    {key: into},
                    storage_reader=dcp.FileSystemReader(str(self.folder)),
                    planner=_SlicePlanner(key, offsets, sizes),
                    no_dist=True,
                )
        except Exception as error:  # DCP wraps a reader's OSError in CheckpointException (one per rank)
            raise CheckpointError(f"{self.folder}: {key} cannot be read ({str(error).splitlines()[0][:200]})") from None
        return into[0] if index is not None else into


def _argument(args: dict, *names: str, default=None):
    """The first of `names` Megatron-LM's arguments hold (versions renamed some: norm_epsilon is layernorm_epsilon
    since the arguments are generated from TransformerConfig)."""
    return next((args[name] for name in names if args.get(name) is not None), default)


# What loom cannot compute as Megatron did: (argument, the value that is loom's, Megatron's flag, what it is).
_UNREPRESENTABLE = (
    ("multi_latent_attention", False, "--multi-latent-attention", "multi-latent attention"),
    ("qk_l2_norm", False, "--qk-l2-norm", "L2 norms on queries and keys"),
    ("attention_output_gate", False, "--attention-output-gate", "a gated attention output"),
    (
        "apply_residual_connection_post_layernorm",
        False,
        "--apply-residual-connection-post-layernorm",
        "BERT's residual order",
    ),
    ("heterogeneous_layers_config_path", None, "--heterogeneous-layers-config-path", "blocks of different shapes"),
    ("hybrid_layer_pattern", None, "--hybrid-layer-pattern", "Mamba layers"),
    ("hybrid_override_pattern", None, "--hybrid-override-pattern", "Mamba layers"),
    ("experimental_attention_variant", None, "--experimental-attention-variant", "another attention"),
    ("quick_geglu", False, "--quick-geglu", "a quick-GeGLU MLP"),
    ("window_size", None, "--window-size", "sliding-window attention"),
    ("no_rope_freq", None, "--no-rope-freq", "layers without rotary positions"),
    ("softmax_type", "vanilla", "--softmax-type", "another attention softmax"),
    ("use_mup", False, "--use-mup", "muP's scaled attention, embeddings and logits"),
    ("glu_linear_offset", 0.0, "--glu-linear-offset", "an offset inside the gated MLP"),
    ("activation_func_clamp_value", None, "--activation-func-clamp-value", "a clamped MLP activation"),
)


def model_from_megatron_arguments(args: dict, shapes: dict[str, tuple[int, ...]], legacy_model: bool = False) -> dict:
    """loom's [model] for Megatron-LM's arguments `args` (and the stored tensors' `shapes`, for the padded
    vocabulary and learned positions); CheckpointError naming Megatron's flag for what loom cannot represent.
    `legacy_model`: Megatron-LM's legacy model (megatron/legacy) wrote it, whose rotary embedding took neither
    --rotary-base nor --use-rope-scaling."""
    experts = args.get("num_experts") or args.get("num_moe_experts")
    if experts:
        raise CheckpointError(
            f"the model is a mixture of experts (--num-experts {experts}); loom imports those from Hugging Face's "
            "files (`loom ckpt import-hf`: Mixtral, Qwen3-MoE, OLMoE), not yet from Megatron-LM's"
        )
    for name, loom_value, flag, what in _UNREPRESENTABLE:
        if args.get(name) not in (loom_value, None):  # None: an older Megatron without the setting
            raise CheckpointError(f"the model uses {what} ({flag} {args[name]}), which loom does not have")
    heads, hidden = args["num_attention_heads"], args["hidden_size"]
    # Megatron-LM 23.04 and 23.06 said rotary positions with --use-rotary-position-embeddings
    positions = args.get("position_embedding_type") or (
        "rope" if args.get("use_rotary_position_embeddings") else "learned_absolute"
    )
    if positions == "learned_absolute" and args.get("add_position_embedding") is False:
        positions = "none (--no-position-embedding)"
    if positions == "rope" and POSITIONS in shapes:
        raise CheckpointError(
            "the model adds learned positions and rotates (--use-rotary-position-embeddings without "
            "--no-position-embedding); loom has one or the other"
        )
    if positions not in ("rope", "learned_absolute"):
        raise CheckpointError(
            f"the model's positions are {positions} (--position-embedding-type); loom imports rope and "
            "learned_absolute from Megatron-LM"
        )
    normalization = args.get("normalization") or "LayerNorm"
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise CheckpointError(f"the model's norm is {normalization} (--normalization); loom has LayerNorm and RMSNorm")
    vocab_rows, _ = shapes[EMBEDDING]
    model = {
        "num_layers": args["num_layers"],
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": args["num_query_groups"] if args.get("group_query_attention") else heads,
        "head_dim": args.get("kv_channels") or hidden // heads,
        "ffn_hidden_size": args.get("ffn_hidden_size") or 4 * hidden,
        # The stored rows, padding included: Megatron's softmax ran over all of them.
        "vocab_size": vocab_rows,
        "max_position_embeddings": _argument(args, "max_position_embeddings", "seq_length"),
        "position_embedding": "rope" if positions == "rope" else "learned",
        "norm": normalization.lower(),
        "norm_eps": _argument(args, "layernorm_epsilon", "norm_epsilon", default=1e-5),
        "activation": _activation(args, legacy_model),
        "bias": bool(args.get("add_bias_linear", True)),
        # Before megatron-core 0.10 a run with biases saved add_qkv_bias False, its QKV biased all the same
        "qkv_bias": bool(args.get("add_qkv_bias")) and not args.get("add_bias_linear", True),
        "qk_norm": bool(args.get("qk_layernorm")),
        "attention_scale": args.get("softmax_scale"),
        "tie_embeddings": not args.get("untie_embeddings_and_output_weights", False),
    }
    if positions == "rope":
        model["rope_theta"] = 10000.0 if legacy_model else float(args.get("rotary_base") or 10000)
        model["rotary_percent"] = float(args.get("rotary_percent") or 1.0)
        interpolation = args.get("rotary_seq_len_interpolation_factor")
        if interpolation is not None and args.get("use_rope_scaling") and not legacy_model:
            raise CheckpointError(
                f"the model interpolates its rotary positions (--rotary-seq-len-interpolation-factor {interpolation})"
                " on top of --use-rope-scaling; loom imports one or the other"
            )
        if interpolation is not None:  # positions divided by the factor: every frequency, as loom's linear scaling
            model.update(rope_scaling="linear", rope_scaling_factor=float(interpolation))
        if args.get("use_rope_scaling") and not legacy_model:
            # megatron-core's Llama 3 scaling: its low/high frequency factors and original length are fixed
            model.update(
                rope_scaling="llama3",
                rope_scaling_factor=MEGATRON_ROPE_SCALING_FACTOR,
                rope_low_freq_factor=1.0,
                rope_high_freq_factor=4.0,
                rope_original_max_positions=8192,
            )
    else:
        model["max_position_embeddings"] = shapes[POSITIONS][0]
    return model


MEGATRON_ROPE_SCALING_FACTOR = 8.0
"""The llama3 scaling factor megatron-core's GPTModel computes with: Megatron-LM's model builders pass it
rope_scaling alone, so --rope-scaling-factor never reached the model (pretrain_gpt since core 0.11)."""


def ignored_settings(args: dict, legacy_model: bool = False) -> list[str]:
    """Megatron-LM arguments its model never read, which the import therefore does not follow either."""
    rotary = (args.get("position_embedding_type") or "") == "rope" or args.get("use_rotary_position_embeddings")
    if legacy_model and rotary:
        return [
            f"{flag}: Megatron's legacy model never read it (its rotary base was 10000, unscaled), and neither does "
            "the import"
            for flag, given in (
                (f"--rotary-base {args.get('rotary_base')}", args.get("rotary_base") not in (None, 10000)),
                ("--use-rope-scaling", args.get("use_rope_scaling")),
            )
            if given
        ]
    factor = args.get("rope_scaling_factor")
    if args.get("use_rope_scaling") and factor not in (None, MEGATRON_ROPE_SCALING_FACTOR):
        return [
            f"--rope-scaling-factor {factor}: Megatron's model builders never passed it on, its model scaled by "
            f"{MEGATRON_ROPE_SCALING_FACTOR:g}, and so does the import"
        ]
    return []


def _activation(args: dict, legacy_model: bool) -> str:
    """model.activation for Megatron's arguments: --swiglu, --squared-relu (which Megatron's legacy MLP took only
    without --openai-gelu and --onnx-safe, its GELU choices), else GELU."""
    if args.get("swiglu"):
        return "swiglu"
    legacy_gelu = legacy_model and (args.get("openai_gelu") or args.get("onnx_safe"))
    return "squared_relu" if args.get("squared_relu") and not legacy_gelu else "gelu"


def gelu_is_exact(args: dict, legacy_model: bool = False) -> bool:
    """Whether Megatron computed the MLP's GELU exactly (erf), where loom computes the tanh approximation: its
    fused bias-GELU kernel (--bias-gelu-fusion, the default with biases) and Transformer Engine's
    (--use-te-activation-func) are the tanh form, F.gelu otherwise; the legacy model (`legacy_model`) also took
    --openai-gelu (tanh) and --onnx-safe (erf)."""
    if legacy_model and not args.get("swiglu") and (args.get("openai_gelu") or args.get("onnx_safe")):
        return not args.get("openai_gelu")
    # Before --bias-gelu-fusion (2020-09): the tanh form until --openai-gelu came (2020-04), then the exact one
    fused = args.get("bias_gelu_fusion", "openai_gelu" not in args) and args.get("add_bias_linear", True)
    gelu = not (args.get("swiglu") or args.get("squared_relu"))
    return gelu and not fused and not args.get("use_te_activation_func")


EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
_OUTSIDE_BLOCKS = {
    naming.EMBEDDING: EMBEDDING,
    naming.POSITION_EMBEDDING: POSITIONS,
    naming.FINAL_NORM_WEIGHT: "decoder.final_layernorm.weight",
    "final_norm.bias": "decoder.final_layernorm.bias",
    naming.OUTPUT: OUTPUT,
}
# loom's name inside a block (without .weight/.bias) -> Megatron's names of it inside decoder.layers, each with the
# leaf (weight, bias) after it: TE's layer-norm-fused linear keeps the norm's, megatron-core's local layers their own.
_IN_BLOCK = {
    "input_norm": ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    "attention.qkv": ("self_attention.linear_qkv.",),
    "attention.proj": ("self_attention.linear_proj.",),
    "attention.q_norm": ("self_attention.q_layernorm.",),
    "attention.k_norm": ("self_attention.k_layernorm.",),
    "mlp_norm": ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
    "mlp.fc1": ("mlp.linear_fc1.",),
    "mlp.fc2": ("mlp.linear_fc2.",),
}


def megatron_names(name: str) -> tuple[tuple[str, ...], int | None]:
    """Megatron's keys that may hold loom's tensor `name` (the first is what megatron-core writes today; a block's
    are its stacked keys) and the block's layer (None outside the blocks)."""
    in_block = naming.split_block_param_name(name)
    if in_block is None:
        key = _OUTSIDE_BLOCKS.get(name)
        return ((key,) if key else ()), None
    layer, local = in_block
    owner, _, leaf = local.rpartition(".")
    return tuple(f"decoder.layers.{prefix}{leaf}" for prefix in _IN_BLOCK.get(owner, ())), layer


_MODEL = ("embedding.", "decoder.", "output_layer.")
"""Where the model's stored keys begin (the optimizer's state is under optimizer. or chained_N.optimizer., the
random-number and rerun states elsewhere, the multi-token prediction layers under mtp.): a tensor here that loom
does not take is refused, not dropped."""


class _MegatronWeights:
    """Where each of loom's tensors is in the distributed checkpoint: a key, and a layer index where the blocks'
    tensors are stacked (megatron-core's default) or None where each layer has keys of its own."""

    def __init__(self, stored: DistributedCheckpoint, num_layers: int):
        self.stored = stored
        self.num_layers = num_layers

    def locate(self, name: str) -> tuple[tuple[str, ...], int | None] | None:
        """The stored key(s) holding loom's `name` (two halves to join for a SwiGLU fc1 saved with
        singleton_local_shards: _w the gate, _v the up projection) and the layer of a stacked key."""
        keys, layer = megatron_names(name)
        for stacked in keys:
            if layer is None:
                if stacked in self.stored.shapes:
                    return (stacked,), None
                continue
            own = stacked.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
            if stacked in self.stored.shapes and self.stored.shapes[stacked][0] == self.num_layers:
                return (stacked,), layer
            if own in self.stored.shapes:
                return (own,), None
            if f"{own}_w" in self.stored.shapes and f"{own}_v" in self.stored.shapes:
                return (f"{own}_w", f"{own}_v"), None
        return None

    def shape(self, located: tuple[tuple[str, ...], int | None]) -> tuple[int, ...]:
        keys, layer = located
        shapes = [self.stored.shapes[key][1:] if layer is not None else self.stored.shapes[key] for key in keys]
        return (sum(shape[0] for shape in shapes), *shapes[0][1:])

    def read(self, located: tuple[tuple[str, ...], int | None]) -> torch.Tensor:
        keys, layer = located
        parts = [self.stored.read(key, layer) for key in keys]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _qkv_from_grouped(tensor: torch.Tensor, model: dict) -> torch.Tensor:
    """Megatron's QKV rows (per query group: its query heads, then its key and value head) in loom's order (all
    queries, then keys, then values)."""
    groups, head = model["num_kv_heads"], model["head_dim"]
    per_group = tensor.reshape(groups, -1, head, *tensor.shape[1:])
    queries = model["num_heads"] // groups
    q, k, v = per_group.split([queries, 1, 1], dim=1)
    return torch.cat([part.reshape(-1, *tensor.shape[1:]) for part in (q, k, v)])


def _rotate_half_rows(tensor: torch.Tensor, heads: int, rotary_dim: int) -> torch.Tensor:
    """Query or key rows of interleaved rotary pairs (2i, 2i+1) reordered so the pairs are (i, i + d/2), loom's,
    among each head's first `rotary_dim` rows (the rows past them are not rotated, and stay)."""
    per_head = tensor.reshape(heads, -1, *tensor.shape[1:])
    turned = [torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)]
    order = torch.cat([*turned, torch.arange(rotary_dim, per_head.shape[1])])
    return per_head[:, order].reshape(tensor.shape)


def from_megatron(stored: DistributedCheckpoint, model: dict, args: dict, loom_names: list[str]) -> LazyWeights:
    """Megatron's stored tensors -> loom's logical tensors `loom_names`, each read when asked for."""
    weights = _MegatronWeights(stored, model["num_layers"])
    located = {}
    for name in loom_names:
        where = weights.locate(name)
        if where is None:
            raise CheckpointError(f"{stored.folder} has no tensor for loom's {name}; do its arguments describe it?")
        located[name] = where
    used = {key for keys, _ in located.values() for key in keys}
    unused = sorted(key for key in stored.shapes if key not in used and key.startswith(_MODEL))
    if unused:
        raise CheckpointError(
            f"{stored.folder} has tensors its arguments do not describe ({first_few(unused)}); importing would drop "
            "them"
        )
    centred = bool(_argument(args, "layernorm_zero_centered_gamma", "apply_layernorm_1p", default=False))
    interleaved = bool(args.get("rotary_interleaved")) and model["position_embedding"] == "rope"
    head, turned = model["head_dim"], ModelConfig(**model).rotary_dim

    def make(name: str) -> torch.Tensor:
        tensor = weights.read(located[name])
        local = (naming.split_block_param_name(name) or (None, name))[1]
        if centred and local.endswith("norm.weight"):
            tensor = tensor.float() + 1
        if local.startswith("attention.qkv."):
            tensor = _qkv_from_grouped(tensor, model)
            if interleaved:
                q_rows = model["num_heads"] * head
                q, kv = tensor.split([q_rows, tensor.shape[0] - q_rows])
                k, v = kv.chunk(2)
                tensor = torch.cat(
                    [
                        _rotate_half_rows(q, model["num_heads"], turned),
                        _rotate_half_rows(k, model["num_kv_heads"], turned),
                        v,
                    ]
                )
        elif interleaved and local in (naming.Q_NORM_WEIGHT, naming.K_NORM_WEIGHT):
            tensor = _rotate_half_rows(tensor, 1, turned)  # a head's norm weights follow its rows
        return tensor

    return LazyWeights({name: weights.shape(where) for name, where in located.items()}, make)


def tokenizer_note(args: dict) -> str:
    """Which tokenizer Megatron-LM trained with, and how loom is given it (data.tokenizer)."""
    from loom.engine.names_elsewhere import GPT2_FILES

    kind, model = args.get("tokenizer_type"), args.get("tokenizer_model")
    if model:
        return (
            f"Megatron trained it with {kind} {model}: give loom that tokenizer with --data.tokenizer (a "
            "SentencePiece .model, or a Hugging Face tokenizer's tokenizer.json)"
        )
    if args.get("vocab_file"):
        return f"Megatron trained it with {kind} ({args['vocab_file']}, {args.get('merge_file')}); {GPT2_FILES}"
    return f"Megatron trained it with {kind or 'a tokenizer its arguments do not name'}"


def import_megatron(source: Path, output: Path, overwrite: bool = False) -> tuple[Path, str]:
    """Write a loom checkpoint (step 0, weights only, tp=1 pp=1 pieces) of the Megatron-LM checkpoint `source` (a
    --save folder or an iter_N folder in it) under `output` (claimed as tools/outputs.py says). Returns the
    checkpoint written and a line saying what it is."""
    from loom.engine.model.gpt import GPTModel
    from loom.engine.parallel.param_info import param_info

    folder = megatron_iteration_folder(source)
    if (
        output.resolve() in (folder.resolve(), *folder.resolve().parents[:1])
        or folder.resolve() in output.resolve().parents
    ):
        # Megatron's iter_N folders are named as loom's: claimed as checkpoints, --overwrite would move them aside
        raise CheckpointError(f"--output {output} holds {folder}, which this command reads; write elsewhere")
    args = read_megatron_arguments(folder)
    stored = TorchFormatCheckpoint(folder, args) if is_torch_format(folder) else DistributedCheckpoint(folder)
    if EMBEDDING not in stored.shapes:
        raise CheckpointError(f"{folder} has no {EMBEDDING}; is it a GPT model's checkpoint?")
    legacy_model = stored.legacy_model
    try:
        model = model_from_megatron_arguments(args, stored.shapes, legacy_model)
    except KeyError as error:
        raise CheckpointError(f"{arguments_file(folder)}: the arguments have no {error.args[0]!r}") from None
    train = {"seq_length": min(2048, model["max_position_embeddings"]), "global_batch_size": 8}
    config = config_from_dict({"model": model, "train": train})
    names = [param_info(param).name for param in GPTModel(config.model, None).parameters()]
    logical = from_megatron(stored, config_to_dict(config)["model"], args, names)
    if gelu_is_exact(args, legacy_model):
        print(
            "warning: Megatron computed this model's GELU exactly (erf: no fused bias-GELU), loom computes its tanh "
            "approximation; they differ by at most 5e-4 per activation, and fine-tuning absorbs it",
            file=sys.stderr,
        )
    for ignored in ignored_settings(args, legacy_model):
        print(f"note: {ignored}", file=sys.stderr)
    if any(key.startswith("mtp") for key in stored.shapes):
        print(
            "note: the multi-token prediction layers (--mtp-num-layers) are not imported: loom predicts the next "
            "token only",
            file=sys.stderr,
        )
    with claimed_checkpoint_output(output, overwrite, reading=(folder,)):
        final = write_weights_checkpoint(output, config, logical, f"the Megatron-LM checkpoint {folder}")
    parameters = sum(math.prod(shape) for shape in logical.shapes.values())
    described = (
        f"Megatron-LM's iteration {args.get('iteration')} ({args.get('consumed_train_samples') or 0:,} samples "
        f"trained), {model['num_layers']} layers x {model['hidden_size']}, {parameters / 1e6:,.1f}M parameters "
        f"stored in {str(stored.dtypes[EMBEDDING]).removeprefix('torch.')}, written in float32. {tokenizer_note(args)}"
    )
    return final, described

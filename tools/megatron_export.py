"""loom -> Megatron-LM: `loom ckpt export-megatron`, the way back of import-megatron (tools/megatron_checkpoint.py).

What Megatron-LM's torch_dist save writes, for the model alone: SAVE/latest_checkpointed_iteration.txt and
SAVE/iter_NNNNNNN/ holding the tensors under megatron-core's global keys, the blocks' stacked on a first dimension of
layers (the layout Megatron-LM loads by default), written a layer at a time through a torch.distributed.checkpoint
planner, so memory holds one loom tensor; an empty `_extra_state` for each layer module that keeps one and for the
final norm (Transformer Engine's and megatron-core's layers take None as "nothing saved"; keys a model lacks are
ignored on load); common.pt with the Megatron-LM arguments describing the model, the step and the samples consumed;
megatron-core's metadata.json. Megatron-LM builds its model from its own command line, whose model flags are printed
(--use-checkpoint-args restores neither --norm-epsilon nor rope scaling), and loads this into any tensor/pipeline
layout (its loader reshards): with --finetune at iteration 0, or, from iter_N, with --no-load-optim --no-load-rng
at iteration N, its optimizer and learning-rate schedule starting afresh.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from loom.engine.atomic import write_text_atomically
from loom.engine.checkpoint.format import MEGATRON_TRACKER, CheckpointError
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model import naming
from loom.engine.parallel.vocab import padded_vocab_size
from loom.tools.ckpt import open_checkpoint
from loom.tools.hf import EXPORT_DTYPES
from loom.tools.hf_forms import GRANITE_MULTIPLIERS
from loom.tools.lora import ModelWeights
from loom.tools.megatron_checkpoint import COMMON, EMBEDDING, MEGATRON_ROPE_SCALING_FACTOR, OUTPUT, megatron_names
from loom.tools.outputs import claimed_megatron_output

EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.core_attention",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
"""The layer modules whose (empty) `_extra_state` Megatron-LM's layer specs save: Transformer Engine's linear and
attention modules (their FP8 metadata), megatron-core's local linear layers."""

FINAL_NORM_EXTRA_STATE = "decoder.final_layernorm._extra_state/shard_0_1"
"""With Transformer Engine installed, megatron-core's final norm is TE's whatever the layer spec, and its (empty)
extra state is asked for on load: a checkpoint without it fails there ("Missing key in checkpoint")."""

MEGATRON_VOCAB_DIVISOR = 128
"""Megatron-LM's default --make-vocab-size-divisible-by (check_checkpoint_args compares it under --vocab-file)."""

MEGATRON_METADATA = (
    '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
    '"common_backend_version": 1}'
)
"""megatron-core's metadata.json: which strategies wrote the tensors and common.pt."""

LLAMA3_SCALING_IN_MEGATRON = {
    "rope_scaling_factor": MEGATRON_ROPE_SCALING_FACTOR,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_positions": 8192,
}
"""megatron-core's llama3 rope scaling has these fixed (the factor is a flag its model builders never pass on)."""


def megatron_arguments(model: dict, train: dict, step: int, consumed: int, dtype: str) -> argparse.Namespace:
    """Megatron-LM's arguments for loom's [model] (ModelConfig's fields) trained as `train` says; CheckpointError
    for what Megatron cannot compute the same way."""
    granite = {field: model[field] for field in GRANITE_MULTIPLIERS}
    if any(value != 1.0 for value in granite.values()):
        raise CheckpointError(
            f"the model scales its embeddings, residual branches or logits ({granite}); megatron-core's GPT model "
            "does none of these"
        )
    if model["num_experts"] is not None:
        raise CheckpointError(
            f"the model is a mixture of {model['num_experts']} experts (model.num_experts); loom exports Megatron-LM's "
            "dense GPT models only (export it to Hugging Face with `loom ckpt export-hf`)"
        )
    if model["activation"] == "geglu":
        raise CheckpointError(
            "the model's MLP is a gated GELU (model.activation = geglu, Gemma's); Megatron-LM's arguments gate "
            "SiLU alone (--swiglu)"
        )
    if model["norm_placement"] != "input":
        raise CheckpointError(
            f"the model normalises each block's attention and MLP outputs (model.norm_placement = "
            f"{model['norm_placement']}, OLMo 2's or Gemma's order); megatron-core's GPT model normalises their inputs"
        )
    if model["attention_softcap"] is not None or model["logits_softcap"] is not None:
        raise CheckpointError(
            "the model soft-caps its attention scores or logits (model.attention_softcap, model.logits_softcap, "
            "Gemma 2's); megatron-core's GPT model caps neither"
        )
    if model["sliding_window"] is not None and model["full_attention_interval"] != 1:
        raise CheckpointError(
            f"the model attends within a sliding window (model.sliding_window = {model['sliding_window']}); loom "
            "exports Megatron-LM's full causal attention only"
        )
    if model["qk_norm"] and not model["qk_norm_per_head"]:
        raise CheckpointError(
            "the model normalises its queries and keys across all heads (model.qk_norm_per_head = false); "
            "megatron-core's --qk-layernorm normalises each head"
        )
    if model["rope_scaling"] in ("longrope", "yarn") and model["position_embedding"] == "rope":
        raise CheckpointError(
            f"the model's rotary embedding is {model['rope_scaling']}-scaled (model.rope_scaling); loom exports "
            "Megatron-LM's Llama 3.1 scaling (--use-rope-scaling), its linear interpolation "
            "(--rotary-seq-len-interpolation-factor) or none"
        )
    if model["rope_scaling"] == "llama3" and model["position_embedding"] == "rope":
        fixed = {k: model[k] for k, v in LLAMA3_SCALING_IN_MEGATRON.items() if model[k] != v}
        if fixed:
            raise CheckpointError(
                f"the model's llama3 rope scaling has {fixed}; megatron-core's model fixes them at "
                f"{ {k: LLAMA3_SCALING_IN_MEGATRON[k] for k in fixed} } (--rope-scaling-factor never reaches it)"
            )
    factor = model["rope_scaling_factor"]
    if model["rope_scaling"] == "linear" and model["position_embedding"] == "rope" and not float(factor).is_integer():
        raise CheckpointError(
            f"the model's linear rope scaling factor is {factor}; Megatron-LM's --rotary-seq-len-interpolation-factor "
            "takes whole numbers"
        )
    heads, kv_heads = model["num_heads"], model["num_kv_heads"] or model["num_heads"]
    rope = model["position_embedding"] == "rope"
    theta = model["rope_theta"]
    return argparse.Namespace(
        num_layers=model["num_layers"],
        hidden_size=model["hidden_size"],
        ffn_hidden_size=model["ffn_hidden_size"],
        num_attention_heads=heads,
        group_query_attention=kv_heads != heads,
        num_query_groups=kv_heads,
        kv_channels=model["head_dim"],
        seq_length=train["seq_length"],
        max_position_embeddings=model["max_position_embeddings"],
        position_embedding_type="rope" if rope else "learned_absolute",
        add_position_embedding=True,
        use_rotary_position_embeddings=rope,
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        rotary_percent=model["rotary_percent"],
        rotary_interleaved=False,
        use_rope_scaling=rope and model["rope_scaling"] == "llama3",
        rope_scaling_factor=model["rope_scaling_factor"],
        rotary_seq_len_interpolation_factor=int(factor) if rope and model["rope_scaling"] == "linear" else None,
        normalization="RMSNorm" if model["norm"] == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=model["norm_eps"],
        norm_epsilon=model["norm_eps"],
        layernorm_zero_centered_gamma=False,
        apply_layernorm_1p=False,
        swiglu=model["activation"] == "swiglu",
        squared_relu=model["activation"] == "squared_relu",
        add_bias_linear=model["bias"],
        add_qkv_bias=model["bias"] or model["qkv_bias"],
        qk_layernorm=model["qk_norm"],
        softmax_scale=model["attention_scale"],
        bias_gelu_fusion=model["bias"] and model["activation"] == "gelu",  # Megatron fuses no other bias activation
        untie_embeddings_and_output_weights=not model["tie_embeddings"],
        hidden_dropout=model["dropout"],
        attention_dropout=model["dropout"],
        vocab_size=model["vocab_size"],
        padded_vocab_size=padded_vocab_size(model["vocab_size"], model["make_vocab_divisible_by"], 1),
        make_vocab_size_divisible_by=model["make_vocab_divisible_by"],
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=EXPORT_DTYPES[dtype],
        iteration=step,
        consumed_train_samples=consumed,
        consumed_valid_samples=0,
        # What Megatron-LM's load reads of its own runs' arguments: a save without optimizer or RNG state says so
        # (its load then builds no RNG state to read), and check_checkpoint_args compares tokenizer_type, without a
        # default, when a run gives --vocab-file; loom does not know Megatron's tokenizer flags
        no_save_optim=True,
        no_save_rng=True,
        tokenizer_type=None,
        ckpt_format="torch_dist",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )


def megatron_flags(args: argparse.Namespace) -> str:
    """The Megatron-LM command-line flags that build the model `args` describes."""
    flags = [
        f"--num-layers {args.num_layers}",
        f"--hidden-size {args.hidden_size}",
        f"--ffn-hidden-size {args.ffn_hidden_size}",
        f"--num-attention-heads {args.num_attention_heads}",
        *([f"--kv-channels {args.kv_channels}"] * (args.kv_channels * args.num_attention_heads != args.hidden_size)),
        *([f"--group-query-attention --num-query-groups {args.num_query_groups}"] * args.group_query_attention),
        f"--max-position-embeddings {args.max_position_embeddings}",
        f"--position-embedding-type {args.position_embedding_type}",
        *([f"--rotary-base {args.rotary_base}"] * args.use_rotary_position_embeddings),
        *(
            [f"--rotary-percent {args.rotary_percent}"]
            * (args.use_rotary_position_embeddings and args.rotary_percent < 1)
        ),
        *([f"--use-rope-scaling --rope-scaling-factor {args.rope_scaling_factor}"] * args.use_rope_scaling),
        *(
            [f"--rotary-seq-len-interpolation-factor {args.rotary_seq_len_interpolation_factor}"]
            if args.rotary_seq_len_interpolation_factor is not None
            else []
        ),
        f"--normalization {args.normalization}",
        f"--norm-epsilon {args.norm_epsilon}",
        *(["--swiglu"] * args.swiglu),
        *(["--squared-relu"] * args.squared_relu),
        # with biases Megatron fuses bias and GELU by default, which its config refuses for a squared ReLU
        *(["--no-bias-gelu-fusion"] * (args.squared_relu and args.add_bias_linear)),
        *(["--disable-bias-linear"] * (not args.add_bias_linear)),
        *(["--add-qkv-bias"] * (args.add_qkv_bias and not args.add_bias_linear)),
        *(["--qk-layernorm"] * args.qk_layernorm),
        *([f"--softmax-scale {args.softmax_scale}"] * (args.softmax_scale is not None)),
        *(["--untie-embeddings-and-output-weights"] * args.untie_embeddings_and_output_weights),
        f"--hidden-dropout {args.hidden_dropout} --attention-dropout {args.attention_dropout}",
        *(
            [f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}"]
            * (args.make_vocab_size_divisible_by != MEGATRON_VOCAB_DIVISOR)
        ),
        *([f"--{'bf16' if args.bf16 else 'fp16'}"] * (args.bf16 or args.fp16)),
    ]
    return " ".join(flags)


class _LayerByLayerPlanner(dcp.DefaultSavePlanner):
    """Saves the tensors `shapes` describes, each made by `make(key, layer)` when its bytes are due: a stacked
    key (layers first) as one chunk per layer, which DCP records as one tensor of the stacked shape; and `objects`
    as pickled bytes (megatron-core's ShardedObjects)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], bool]], dtype: torch.dtype, make, objects: list[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._shapes, self._dtype, self._make, self._objects = shapes, dtype, make, objects

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.mappings, self.is_coordinator = {}, {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        properties = TensorProperties(dtype=self._dtype)
        for key, (shape, stacked) in self._shapes.items():
            chunks = range(shape[0]) if stacked else [None]
            for layer in chunks:
                offsets = torch.Size([layer or 0] + [0] * (len(shape) - 1))
                sizes = torch.Size([1, *shape[1:]]) if stacked else torch.Size(shape)
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, offsets),
                        type=WriteItemType.SHARD if stacked else WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                            properties=properties,
                            size=torch.Size(shape),
                        ),
                    )
                )
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self._objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            empty = io.BytesIO()
            torch.save([None], empty)  # megatron-core keeps a ShardedObject's value in a list, as it saves them
            return empty
        key = write_item.index.fqn
        stacked = self._shapes[key][1]
        tensor = self._make(key, write_item.index.offset[0] if stacked else None)
        return (tensor.unsqueeze(0) if stacked else tensor).to(self._dtype).contiguous()


def _regroup_qkv(tensor: torch.Tensor, model: dict) -> torch.Tensor:
    """loom's QKV rows (all queries, then keys, then values) in Megatron's order (per query group: its query
    heads, then its key and value head): the inverse of megatron_checkpoint._qkv_from_grouped."""
    groups, head = model["num_kv_heads"] or model["num_heads"], model["head_dim"]
    q_rows = model["num_heads"] * head
    q, k, v = tensor.split([q_rows, groups * head, groups * head])
    rest = tensor.shape[1:]
    per_group = [part.reshape(groups, -1, head, *rest) for part in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(tensor.shape)


def export_megatron(
    source: Path, output: Path, base: Path | None = None, overwrite: bool = False, dtype: str = "float32"
) -> tuple[Path, str]:
    """Write the model of the loom checkpoint `source` (a LoRA run's with its adapters folded in) as a Megatron-LM
    torch_dist checkpoint under `output` (a --save folder of its own). Returns the iteration folder written and the
    Megatron-LM flags that build the model."""
    directory, metadata = open_checkpoint(source)
    config = config_to_dict(config_from_dict(metadata.config))  # fills fields older checkpoints lack
    model = config["model"]
    args = megatron_arguments(model, config["train"], metadata.step, metadata.consumed_samples, dtype)
    weights = ModelWeights(directory, metadata, base)
    local_of: dict[str, str] = {}  # Megatron key -> loom's name, or its name inside a block for a stacked key
    shapes: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, shape in weights.shapes.items():
        keys, layer = megatron_names(name)
        if not keys:
            raise CheckpointError(f"loom's {name} has no Megatron-LM place")
        key = keys[0]
        if key in (EMBEDDING, OUTPUT):
            shape = (args.padded_vocab_size, *shape[1:])
        if layer is None:
            shapes[key], local_of[key] = (tuple(shape), False), name
        elif layer == 0:
            shapes[key], local_of[key] = ((model["num_layers"], *shape), True), naming.split_block_param_name(name)[1]

    def make(key: str, layer: int | None) -> torch.Tensor:
        tensor = weights[local_of[key] if layer is None else naming.block_param_name(layer, local_of[key])]
        if key in (EMBEDDING, OUTPUT) and tensor.shape[0] < args.padded_vocab_size:  # loom's padding rows: zeros
            tensor = torch.cat([tensor, tensor.new_zeros(args.padded_vocab_size - tensor.shape[0], *tensor.shape[1:])])
        if key.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            tensor = _regroup_qkv(tensor, model)
        return tensor

    objects = [
        f"decoder.layers.{module}._extra_state/shard_{layer}_{model['num_layers']}"
        for module in EXTRA_STATE_MODULES
        for layer in range(model["num_layers"])
    ] + [FINAL_NORM_EXTRA_STATE]
    planner = _LayerByLayerPlanner(shapes, EXPORT_DTYPES[dtype], make, objects)
    # A weights-only step 0 (an import, a merge) is what Megatron calls a release: loaded without optimizer, RNG or
    # iteration, as its own converters write them
    iteration = output / (f"iter_{metadata.step:07d}" if metadata.step else "release")
    staging = iteration.with_name(iteration.name + ".tmp")
    with claimed_megatron_output(output, overwrite):  # before any weight is read
        print(f"exporting step {metadata.step}: {directory}", flush=True)
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as meant
                warnings.simplefilter("ignore", UserWarning)
                writer = dcp.FileSystemWriter(str(staging), thread_count=1)
                dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
            common = {"args": args, "checkpoint_version": 3.0, "iteration": metadata.step}
            torch.save({**common, "content_metadata": {"singleton_local_shards": False}}, staging / COMMON)
            write_text_atomically(staging / "metadata.json", MEGATRON_METADATA)
            staging.rename(iteration)
            # last: what Megatron-LM's --load reads first, so the export is complete once it is there
            write_text_atomically(output / MEGATRON_TRACKER, str(metadata.step or "release"))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(iteration, ignore_errors=True)
            raise
    if model["activation"] == "gelu" and not model["bias"]:
        print(
            "warning: without biases Megatron computes GELU exactly (erf), loom its tanh approximation: they differ "
            "by at most 5e-4 per activation",
            file=sys.stderr,
        )
    if args.padded_vocab_size > model["vocab_size"]:
        print(
            f"warning: Megatron's softmax runs over the {args.padded_vocab_size - model['vocab_size']} padding rows "
            f"(zeros: logit 0) that pad the vocabulary of {model['vocab_size']} to {args.padded_vocab_size}; loom "
            "masks them, so Megatron's loss is a little higher",
            file=sys.stderr,
        )
    return iteration, megatron_flags(args)

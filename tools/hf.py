"""Hugging Face interchange: a loom checkpoint <-> safetensors + config.json (GPT-2-shaped models: the GPT-2
format, whose names tools/hf_gpt2.py holds; which class a model is, and its config.json: tools/hf_forms.py).

The mapping is the one place that knows Hugging Face's Llama names. loom's fused tensors are split on export (QKV ->
q_proj, k_proj, v_proj; SwiGLU fc1 -> gate_proj, up_proj) and joined on import; loom's rotary embedding already uses
Hugging Face's rotate-half convention, so no permutation of the query/key rows is needed. A Qwen2's names are
Llama's with q/k/v_proj.bias, a Qwen3's add q_norm and k_norm, a Granite's are Llama's, a Phi-3 (Phi-4 too)
keeps QKV and gate+up fused as loom does (qkv_proj, gate_up_proj), an OLMo 2 has q_norm and k_norm across all
heads and its norms after attention and the MLP (its post_attention_layernorm is attention's, not the MLP's), and a
Nemotron has LayerNorm biases, its norm weights stored minus one and up_proj alone before a squared ReLU; a Gemma's
are Llama's, its RMSNorm weights stored minus one (its gated GELU and sqrt(hidden_size) embedding scale are
[model] settings); a mixture of experts' (Mixtral's, Qwen3-MoE's, OLMoE's, Qwen2-MoE's: tools/hf_moe.py) name each
expert's tensors apart, which loom stacks. An import never yields a different model than the one on disk.
transformers is not needed here: the files are written with safetensors and json; tests load them with transformers.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loom.engine.atomic import (
    save_tensors_atomically,
    stream_tensors_atomically,
    torch_dtype_of,
    write_text_atomically,
)
from loom.engine.checkpoint.format import CheckpointError, sha256_of, unrecorded_tokenizer
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model import naming
from loom.tools.ckpt import LazyWeights, first_few, open_checkpoint, write_weights_checkpoint
from loom.tools.hf_forms import (
    HF_TOKEN_ID_FIELDS,
    LOOM_TOKEN_IDS,
    check_llama_form,
    hf_config,
    model_from_hf_config,
    nemotron_form,
    phi3_form,
    read_hf_config,
)
from loom.tools.hf_gemma import gemma3_text_config, gemma_form, text_model_names, with_class_defaults
from loom.tools.hf_gpt2 import (
    embedding_key,
    from_gpt2,
    gpt2_config,
    gpt2_module,
    has_gpt2_form,
    model_from_gpt2_config,
    to_gpt2,
)
from loom.tools.hf_moe import (
    FUSED_EXPERTS_IN_BLOCK,
    GLM4_MOE_IN_BLOCK,
    MINIMAX_M2_IN_BLOCK,
    MIXTRAL_IN_BLOCK,
    QWEN2_MOE_IN_BLOCK,
    QWEN_MOE_IN_BLOCK,
    expert_names,
    fused_expert_names,
    kept_in_fp32,
    moe_generation,
)
from loom.tools.hf_tokenizer import check_moved_tokenizer, export_tokenizer
from loom.tools.lora import ModelWeights, adapted_weights, base_of
from loom.tools.outputs import HF_TOKENIZER_FILES, claimed_checkpoint_output, claimed_export_output

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Hugging Face's names for loom's: outside the blocks, and inside block i (under model.layers.<i>.). A fused
# loom tensor (QKV, SwiGLU gate+up) maps to several Hugging Face tensors stacked along dim 0 in this order.
_OUTSIDE_BLOCKS = {
    naming.EMBEDDING: "model.embed_tokens.weight",
    naming.FINAL_NORM_WEIGHT: "model.norm.weight",
    naming.FINAL_NORM_BIAS: "model.norm.bias",
    naming.OUTPUT: "lm_head.weight",
}
_IN_BLOCK = {
    naming.QKV_WEIGHT: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    naming.QKV_BIAS: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    naming.Q_NORM_WEIGHT: ("self_attn.q_norm.weight",),
    naming.K_NORM_WEIGHT: ("self_attn.k_norm.weight",),
    naming.ATTENTION_OUTPUT_WEIGHT: ("self_attn.o_proj.weight",),
    naming.FC1_WEIGHT: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    naming.FC2_WEIGHT: ("mlp.down_proj.weight",),
    naming.INPUT_NORM_WEIGHT: ("input_layernorm.weight",),
    naming.MLP_NORM_WEIGHT: ("post_attention_layernorm.weight",),
}
# Phi-3's (and Phi-4's) names: Llama's, with QKV and SwiGLU's gate+up fused as loom fuses them, rows in loom's order.
_PHI3_IN_BLOCK = {
    **_IN_BLOCK,
    naming.QKV_WEIGHT: ("self_attn.qkv_proj.weight",),
    naming.FC1_WEIGHT: ("mlp.gate_up_proj.weight",),
}

# OLMo 2's names: Llama's, its norms on what attention and the MLP return (model.norm_placement = output), so that
# its post_attention_layernorm is attention's norm, not the MLP's as in Llama.
_OLMO2_IN_BLOCK = {
    **_IN_BLOCK,
    naming.INPUT_NORM_WEIGHT: ("post_attention_layernorm.weight",),
    naming.MLP_NORM_WEIGHT: ("post_feedforward_layernorm.weight",),
}


# Nemotron's names: Llama's, with LayerNorm's biases and a non-gated MLP (up_proj alone before the squared ReLU).
_NEMOTRON_IN_BLOCK = {
    **_IN_BLOCK,
    naming.FC1_WEIGHT: ("mlp.up_proj.weight",),
    naming.INPUT_NORM_BIAS: ("input_layernorm.bias",),
    naming.MLP_NORM_BIAS: ("post_attention_layernorm.bias",),
}


# Gemma 2's and 3's names: Llama's, with a norm on what attention and the MLP return besides the ones on what enters
# them (model.norm_placement = both), so that its post_attention_layernorm is attention's output norm.
_GEMMA_SANDWICH_IN_BLOCK = {
    **_IN_BLOCK,
    naming.ATTENTION_OUTPUT_NORM_WEIGHT: ("post_attention_layernorm.weight",),
    naming.MLP_NORM_WEIGHT: ("pre_feedforward_layernorm.weight",),
    naming.MLP_OUTPUT_NORM_WEIGHT: ("post_feedforward_layernorm.weight",),
}


def _block_names(model: dict, phi3: bool) -> dict[str, tuple[str, ...]]:
    """Hugging Face's names inside a block for loom's, in the form the model has (`phi3`: phi3_form)."""
    if model["num_experts"] is not None:
        generation = moe_generation(model)
        tables = {
            "mixtral": MIXTRAL_IN_BLOCK,
            "qwen2_moe": QWEN2_MOE_IN_BLOCK,
            "minimax_m2": MINIMAX_M2_IN_BLOCK,
            "glm4_moe": GLM4_MOE_IN_BLOCK,
        }  # beside Llama's names, which a dense block among the experts keeps (model.moe_dense_layers)
        return {**_IN_BLOCK, **tables.get(generation, QWEN_MOE_IN_BLOCK)}
    if nemotron_form(model):
        return _NEMOTRON_IN_BLOCK
    if model["norm_placement"] == "both":
        return _GEMMA_SANDWICH_IN_BLOCK
    if model["norm_placement"] == "output":
        return _OLMO2_IN_BLOCK
    return _PHI3_IN_BLOCK if phi3 else _IN_BLOCK


_BLOCK_NORM_WEIGHTS = (naming.INPUT_NORM_WEIGHT, naming.MLP_NORM_WEIGHT)
_GEMMA_NORM_WEIGHTS = (
    *_BLOCK_NORM_WEIGHTS,
    naming.ATTENTION_OUTPUT_NORM_WEIGHT,
    naming.MLP_OUTPUT_NORM_WEIGHT,
    naming.Q_NORM_WEIGHT,
    naming.K_NORM_WEIGHT,
)


def _stored_minus_one(name: str, model: dict) -> bool:
    """Whether Hugging Face's file holds loom's tensor `name` minus one: a Nemotron's LayerNorm1P scales by 1 + its
    block and final norms' weights, a Gemma's RMSNorm by 1 + every norm's (its query/key norms' too)."""
    if name == naming.FINAL_NORM_WEIGHT:
        return nemotron_form(model) or gemma_form(model)
    if nemotron_form(model):
        return name.endswith(_BLOCK_NORM_WEIGHTS)
    return gemma_form(model) and name.endswith(_GEMMA_NORM_WEIGHTS)


def _fused_sizes(model: dict) -> dict[str, list[int]]:
    """Rows of each Hugging Face tensor inside a fused loom tensor, by loom's name inside the block (the experts':
    rows of their stack flattened to 2-D, expert by expert)."""
    q_rows, kv_rows = model["num_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"]
    experts, ffn = model["num_experts"] or 0, model["ffn_hidden_size"]
    expert_ffn = model.get("moe_ffn_hidden_size") or ffn
    return {
        naming.QKV_WEIGHT: [q_rows, kv_rows, kv_rows],
        naming.QKV_BIAS: [q_rows, kv_rows, kv_rows],
        naming.FC1_WEIGHT: [ffn, ffn],
        naming.EXPERTS_FC1_WEIGHT: [expert_ffn, expert_ffn] * experts,
        naming.EXPERTS_FC2_WEIGHT: [model["hidden_size"]] * experts,
        naming.SHARED_EXPERT_FC1_WEIGHT: [model["moe_shared_ffn_hidden_size"]] * 2,
    }


_STACKED_EXPERTS = (naming.EXPERTS_FC1_WEIGHT, naming.EXPERTS_FC2_WEIGHT)
"""loom's tensors that stack each expert's along a first dimension (Hugging Face's files keep them apart)."""


def _stacks_experts(name: str) -> bool:
    return name.endswith(_STACKED_EXPERTS)


def _loom_names(model: dict) -> list[str]:
    """Every logical tensor of a Llama-shaped loom model (a Qwen2's: its QKV biases too; a Nemotron's: its
    LayerNorms' biases)."""
    layernorm = model["norm"] == "layernorm"
    outside = [naming.EMBEDDING, naming.FINAL_NORM_WEIGHT] + ([naming.FINAL_NORM_BIAS] if layernorm else [])
    outside += [] if model["tie_embeddings"] else [naming.OUTPUT]
    dense_blocks = model.get("moe_dense_layers", 0) if model["num_experts"] is not None else model["num_layers"]
    return outside + [
        naming.block_param_name(i, local)
        for i in range(model["num_layers"])
        for local in _in_block(model, i >= dense_blocks)
    ]


def _in_block(model: dict, moe: bool) -> list[str]:
    """loom's tensors inside a block (`moe`: one with experts)."""
    layernorm, sandwich = model["norm"] == "layernorm", model["norm_placement"] == "both"
    optional = {
        naming.FC1_WEIGHT: not moe,
        naming.FC2_WEIGHT: not moe,
        naming.ROUTER_WEIGHT: moe,
        naming.EXPERTS_FC1_WEIGHT: moe,
        naming.EXPERTS_FC2_WEIGHT: moe,
        naming.SHARED_EXPERT_FC1_WEIGHT: moe and model["moe_shared_ffn_hidden_size"] is not None,
        naming.SHARED_EXPERT_FC2_WEIGHT: moe and model["moe_shared_ffn_hidden_size"] is not None,
        naming.SHARED_EXPERT_GATE_WEIGHT: moe and model["moe_shared_expert_gate"],
        naming.EXPERT_BIAS: moe and model.get("moe_expert_bias", False),
        naming.QKV_BIAS: model["qkv_bias"],
        naming.Q_NORM_WEIGHT: model["qk_norm"],
        naming.K_NORM_WEIGHT: model["qk_norm"],
        naming.INPUT_NORM_BIAS: layernorm,
        naming.MLP_NORM_BIAS: layernorm,
        naming.ATTENTION_OUTPUT_NORM_WEIGHT: sandwich,
        naming.MLP_OUTPUT_NORM_WEIGHT: sandwich,
    }
    every = (
        *_IN_BLOCK,
        naming.INPUT_NORM_BIAS,
        naming.MLP_NORM_BIAS,
        naming.ATTENTION_OUTPUT_NORM_WEIGHT,
        naming.MLP_OUTPUT_NORM_WEIGHT,
        naming.ROUTER_WEIGHT,
        *_STACKED_EXPERTS,
        naming.SHARED_EXPERT_FC1_WEIGHT,
        naming.SHARED_EXPERT_FC2_WEIGHT,
        naming.SHARED_EXPERT_GATE_WEIGHT,
        naming.EXPERT_BIAS,
    )
    return [local for local in every if optional.get(local, True)]


def _hf_names(name: str, block_names: dict[str, tuple[str, ...]], experts: int | None) -> tuple[str, ...]:
    """Hugging Face's tensor(s) holding loom's tensor `name` (`block_names`: _block_names' table; `experts`:
    model.num_experts)."""
    in_block = naming.split_block_param_name(name)
    if in_block is None:
        return (_OUTSIDE_BLOCKS[name],)
    layer, local = in_block
    names = expert_names(block_names[local], experts) if _stacks_experts(local) else block_names[local]
    return tuple(f"model.layers.{layer}.{hf}" for hf in names)


def to_hf(logical: Mapping[str, torch.Tensor], model: dict, phi3: bool = False) -> LazyWeights:
    """loom logical tensors -> Hugging Face Llama (or Phi-3: phi3_form; or OLMo 2) state dict, each tensor made
    when asked for."""
    logical = LazyWeights.of(logical)
    sizes, block_names = _fused_sizes(model), _block_names(model, phi3)
    shapes, part_of = {}, {}
    for name in _loom_names(model):
        hf_names, shape = _hf_names(name, block_names, model["num_experts"]), logical.shapes[name]
        if _stacks_experts(name):
            shape = (shape[0] * shape[1], *shape[2:])
        rows = [shape[0]] if len(hf_names) == 1 else sizes[naming.split_block_param_name(name)[1]]
        for index, (hf_name, count) in enumerate(zip(hf_names, rows, strict=True)):
            shapes[hf_name] = (count, *shape[1:])
            part_of[hf_name] = (name, index, rows)
    last: dict[str, torch.Tensor] = {}  # the loom tensor whose parts are being asked for, made once for them all

    def make(hf_name: str) -> torch.Tensor:
        name, index, rows = part_of[hf_name]
        if name not in last:
            last.clear()
            last[name] = logical[name].flatten(0, 1) if _stacks_experts(name) else logical[name]
        return last[name].split(rows)[index].contiguous()

    return LazyWeights(shapes, make)


def from_hf(tensors: Mapping[str, torch.Tensor], model: dict, phi3: bool = False) -> LazyWeights:
    """Hugging Face Llama state dict (`phi3`: a Phi-3's; or an OLMo 2's) -> loom logical tensors, each made when
    asked for."""
    tensors = LazyWeights.of(tensors)
    shapes, parts_of, used, block_names = {}, {}, set(), _block_names(model, phi3)
    first_experts = model.get("moe_dense_layers", 0) if model["num_experts"] is not None else 0
    if f"model.layers.{first_experts}.{FUSED_EXPERTS_IN_BLOCK[naming.EXPERTS_FC1_WEIGHT][0]}" in tensors.shapes:
        block_names = {**block_names, **fused_expert_names(model)}  # transformers 5's own layout: stacked already
    for name in _loom_names(model):
        hf_names = parts_of[name] = _hf_names(name, block_names, model["num_experts"])
        used.update(hf_names)
        parts = [tensors.shapes[hf] for hf in hf_names]
        # (each expert's own tensors stack only if every one has the same shape: rows moved between two experts
        # sum to the same total)
        uneven = len({part if _stacks_experts(name) else part[1:] for part in parts}) > 1
        if len(parts) > 1 and (min(map(len, parts)) == 0 or uneven):
            shown = first_few([str(part) for part in parts])
            raise CheckpointError(
                f"{first_few(list(hf_names))} have shapes {shown}, which do not stack into loom's {name}"
            )
        shapes[name] = parts[0] if len(parts) == 1 else (sum(part[0] for part in parts), *parts[0][1:])
        if _stacks_experts(name) and len(shapes[name]) == 2:  # each expert's own rows, stacked here
            experts = model["num_experts"]
            shapes[name] = (experts, shapes[name][0] // experts, *shapes[name][1:])
    # What writers save beside a Llama that carries nothing more: RoPE's recomputable table, a tied head's copy.
    ignorable = {"lm_head.weight"} if model["tie_embeddings"] else set()
    unused = sorted(
        k for k in tensors if k not in used and k not in ignorable and not k.endswith("rotary_emb.inv_freq")
    )
    if unused:
        raise CheckpointError(
            f"the model has tensors its config.json does not describe ({first_few(unused)}); the config and the "
            "weights disagree (num_hidden_layers?), and importing would drop them"
        )

    def make(name: str) -> torch.Tensor:
        parts = [tensors[hf] for hf in parts_of[name]]
        if _stored_minus_one(name, model):
            return parts[0].float() + 1
        return parts[0] if len(parts) == 1 else torch.cat(parts).view(shapes[name])

    return LazyWeights(shapes, make)


def export_hf(
    source: Path,
    output: Path,
    base: Path | None = None,
    overwrite: bool = False,
    dtype: str | None = None,
    tokenizer: Path | None = None,
) -> Path:
    """Write model.safetensors + config.json for the checkpoint at `source` (a LoRA run's with its adapters
    folded into its base, found where it was trained or at `base`) into `output` (claimed as tools/outputs.py
    says), in `dtype` (an EXPORT_DTYPES name; None: the dtype an imported model came in, else float32, the
    weights as loom keeps them); `tokenizer`: where the tokenizer the model trained with is now, if it moved."""
    directory, metadata = open_checkpoint(source)
    model = config_to_dict(config_from_dict(metadata.config))["model"]  # fills fields older checkpoints lack
    gpt2 = has_gpt2_form(model)
    if not gpt2:
        check_llama_form(model, gpt2_too=True)
    weights = ModelWeights(directory, metadata, base)
    model.update(weights.router_training())  # a LoRA run's router settings are its base's
    origin = weights.model_metadata  # a LoRA checkpoint's Hugging Face origin is its base's
    trained_with = weights.tokenizer
    if trained_with is None and origin.hf_source is None:
        trained_with = unrecorded_tokenizer(metadata.config)  # an older checkpoint: its config names it, unchecked
    if tokenizer is not None:
        check_moved_tokenizer(trained_with, tokenizer, model["vocab_size"])
    dtype = dtype or origin.hf_dtype or "float32"

    # Each weight read, cast and written on its own: the whole model held in memory took 1-2.5x the checkpoint
    fp32 = kept_in_fp32(model)  # an MoE router's and its biases, as their classes keep them

    def exported(name: str) -> torch.Tensor:  # a Nemotron's or Gemma's norm weights minus one before the cast
        tensor = weights[name].float() - 1 if _stored_minus_one(name, model) else weights[name]
        return tensor.float() if name.endswith(fp32) else tensor.to(EXPORT_DTYPES[dtype])

    cast = LazyWeights(weights.shapes, exported)
    phi3 = phi3_form(model, origin.hf_model_type)
    tensors = to_gpt2(cast, model) if gpt2 else to_hf(cast, model, phi3)
    fp32_names = tuple(hf for local in fp32 for hf in _block_names(model, phi3)[local])
    declared = {
        hf_name: (torch.float32 if hf_name.endswith(fp32_names) else EXPORT_DTYPES[dtype], shape)
        for hf_name, shape in tensors.shapes.items()
    }
    with claimed_export_output(output, overwrite):  # before any weight is read
        print(f"exporting step {metadata.step}: {directory}", flush=True)  # which is a run's newest intact one, say
        output.mkdir(parents=True, exist_ok=True)
        stream_tensors_atomically(declared, tensors.__getitem__, output / "model.safetensors", {"format": "pt"})
        not_written = export_tokenizer(
            output, trained_with, origin, model["max_position_embeddings"], model["vocab_size"], tokenizer
        )
        token_ids = LOOM_TOKEN_IDS if origin.hf_token_ids is None else origin.hf_token_ids
        config = gpt2_config(model, token_ids, dtype) if gpt2 else hf_config(model, token_ids, dtype, phi3)
        write_text_atomically(output / "config.json", json.dumps(config, indent=2))  # last: the export is complete
    if not_written:
        print(f"warning: {not_written}", file=sys.stderr)
    elif trained_with is not None and trained_with["sha256"] is None:
        exported = f"{tokenizer} (--tokenizer)" if tokenizer else f"{trained_with['path']}, which its config names,"
        print(
            f"warning: the checkpoint records no checksum of its tokenizer (it predates loom's record): exported "
            f"{exported} unchecked",
            file=sys.stderr,
        )
    return output


class _SafetensorsFolder(LazyWeights):
    """The tensors of a folder's *.safetensors files by name, each read when asked for (an 8B import that read them
    all first held the model twice over); their shapes and dtypes come from the files' headers."""

    def __init__(self, files: list[Path]):
        self._handles, self._file_of, self.dtypes, shapes = {}, {}, {}, {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
                for key in handle.keys():
                    header = handle.get_slice(key)
                    shapes[key], self.dtypes[key], self._file_of[key] = (
                        tuple(header.get_shape()),
                        header.get_dtype(),
                        file,
                    )
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"{file} is not a readable safetensors file (truncated?): {error}") from None
            self._handles[file] = handle
        super().__init__(shapes)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.shapes:
            raise KeyError(key)
        return self._handles[self._file_of[key]].get_tensor(key)


PEFT_ADAPTER = "adapter_model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def _read_hf_tensors(source: Path) -> _SafetensorsFolder:
    """The model's weights: the files its shard index lists, else every *.safetensors but a PEFT adapter's."""
    index = source / SHARD_INDEX
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if not all(isinstance(name, str) for name in listed):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index} is not a shard index (no weight_map of tensor names to files)") from None
        missing = [name for name in listed if not (source / name).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {', '.join(missing[:3])}, which {source} does not hold")
        return _SafetensorsFolder([source / name for name in listed])
    files = sorted(path for path in source.glob("*.safetensors") if path.name != PEFT_ADAPTER)
    if (source / PEFT_ADAPTER).is_file():
        print(
            f"warning: {source / PEFT_ADAPTER} (a PEFT adapter) is not imported: the base model beside it is; "
            "fine-tune adapters of loom's own with --lora.rank, or merge it in with peft first",
            file=sys.stderr,
        )
    if not files and (source / PEFT_ADAPTER).is_file():
        raise CheckpointError(f"{source} holds only a PEFT adapter ({PEFT_ADAPTER}), not a model to import")
    if not files:
        others = sorted(p.name for p in source.glob("*.bin")) + sorted(p.name for p in source.glob("*.pt*"))
        found = (
            f" (found {', '.join(others[:3])}: load and save_pretrained it with safe_serialization)" if others else ""
        )
        raise CheckpointError(f"{source} holds no *.safetensors weights{found}")
    return _SafetensorsFolder(files)


def import_hf(source: Path, output: Path, overwrite: bool = False) -> Path:
    """Write a loom checkpoint (step 0, weights only, tp=1 pp=1 pieces) under `output` (claimed as
    tools/outputs.py says)."""
    hf = read_hf_config(source)
    image_text = hf.get("model_type") == "gemma3"  # Gemma 3 4B and up: its text model is imported
    hf = gemma3_text_config(hf) if image_text else with_class_defaults(hf)
    gpt2 = hf.get("model_type") == "gpt2"
    try:
        model = model_from_gpt2_config(hf) if gpt2 else model_from_hf_config(hf)
    except KeyError as error:
        kind = "GPT-2" if gpt2 else "Llama"
        raise CheckpointError(f"{source / 'config.json'} has no {error.args[0]!r}; is it a {kind} config?") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source / 'config.json'} has a value of the wrong kind ({error})") from None
    if not gpt2 and model["max_position_embeddings"] < hf["max_position_embeddings"]:
        print(
            f"note: {source / 'config.json'} attends over a sliding window of {hf['sliding_window']} tokens, loom "
            f"over the whole sequence: imported with max_position_embeddings = {model['max_position_embeddings']} "
            f"(not {hf['max_position_embeddings']}), the length up to which the two compute the same",
            file=sys.stderr,
        )
    # The imported checkpoint's run settings are what `loom eval` and fine-tuning start from: sequences no
    # longer than the model's positions, and a batch one CPU rank gets through.
    train = {"seq_length": min(2048, model["max_position_embeddings"]), "global_batch_size": 8}
    tensors = _read_hf_tensors(source)  # their headers: a weight is read only when it is written
    if image_text:
        tensors = _text_model_tensors(tensors, source)
    if hf.get("num_nextn_predict_layers"):
        tensors = _without_prediction_layers(tensors, source, hf["num_hidden_layers"])
    embedding = embedding_key(tensors) if gpt2 else "model.embed_tokens.weight"
    if (
        model["tie_embeddings"]
        and {"lm_head.weight", embedding} <= tensors.keys()
        and not torch.equal(tensors["lm_head.weight"], tensors[embedding])
    ):
        # transformers then keeps both ("will NOT tie them"): the model on disk has its own output layer
        model["tie_embeddings"] = False
        print(
            f"warning: {source / 'config.json'} ties the embeddings, but lm_head.weight differs from "
            f"{embedding}: imported untied, as transformers loads it",
            file=sys.stderr,
        )
    config = config_from_dict({"model": model, "train": train})
    try:
        loom_model = config_to_dict(config)["model"]
        phi3 = hf.get("model_type") == "phi3"
        logical = from_gpt2(tensors, loom_model) if gpt2 else from_hf(tensors, loom_model, phi3)
    except KeyError as error:
        raise CheckpointError(
            f"{source} has no tensor {error.args[0]!r}, which its config.json (model_type {hf.get('model_type')!r}) "
            "implies; do the config and the weights belong together?"
        ) from None
    except CheckpointError as error:
        raise CheckpointError(f"{source}: {error}") from None
    origin = {
        "hf_source": str(source.resolve()),
        "hf_token_ids": {field: hf[field] for field in HF_TOKEN_ID_FIELDS if hf.get(field) is not None},
        "hf_dtype": _stored_dtype(tensors, embedding),
        "hf_model_type": "gemma3" if image_text else hf.get("model_type"),  # the folder's class, for PEFT
        "hf_tokenizer": {name: sha256_of(source / name) for name in HF_TOKENIZER_FILES if (source / name).is_file()}
        or None,
    }
    with claimed_checkpoint_output(output, overwrite):  # once all is known good: --overwrite moves the old one aside
        return write_weights_checkpoint(output, config, logical, "the Hugging Face model", hf_origin=origin)


def _text_model_tensors(tensors: _SafetensorsFolder, source: Path) -> LazyWeights:
    """A Gemma 3 image-text model's text-model tensors under Gemma3ForCausalLM's names (said, with what is left)."""
    names, left = text_model_names(list(tensors))
    text = LazyWeights({new: tensors.shapes[old] for new, old in names.items()}, lambda new: tensors[names[new]])
    text.dtypes = {new: tensors.dtypes[old] for new, old in names.items()}
    print(
        f"note: {source} is an image-text Gemma 3: its text model is imported ({len(names)} tensors), its vision "
        f"tower and projector ({len(left)} tensors) are not; it exports as a Gemma3ForCausalLM",
        file=sys.stderr,
    )
    return text


def _without_prediction_layers(tensors: _SafetensorsFolder, source: Path, layers: int) -> LazyWeights:
    """The tensors but those of the multi-token-prediction layers GLM-4.5's and DeepSeek-V3's files keep after the
    model's own (model.layers.<num_hidden_layers>... : num_nextn_predict_layers), which transformers' classes do not
    compute either (said, with how many)."""
    kept = [name for name in tensors if not _layer_at_or_after(name, layers)]
    if len(kept) == len(tensors.shapes):
        return tensors
    weights = LazyWeights({name: tensors.shapes[name] for name in kept}, tensors.__getitem__)
    weights.dtypes = {name: tensors.dtypes[name] for name in kept}
    print(
        f"note: {source} keeps multi-token-prediction layers after its {layers} ({len(tensors.shapes) - len(kept)} "
        "tensors): they are left out, as transformers leaves them",
        file=sys.stderr,
    )
    return weights


def _layer_at_or_after(name: str, layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers


def _stored_dtype(tensors: _SafetensorsFolder, key: str) -> str | None:
    """The dtype the model's weights (its tensor `key`) are stored in (what config.json's torch_dtype should say,
    and not always does), as an EXPORT_DTYPES name; None for one loom does not write."""
    try:
        stored = torch_dtype_of(tensors.dtypes[key], key)
    except ValueError:
        return None
    return next((name for name, dtype in EXPORT_DTYPES.items() if dtype == stored), None)


def export_peft_adapter(
    source: Path, output: Path, base: Path | None = None, base_model: str | None = None, overwrite: bool = False
) -> Path:
    """Write a LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) for the model export_hf writes of its base. A fused loom adapter maps exactly: in the
    Llama form qkv's one A serves q_proj, k_proj and v_proj, each with its rows of B (likewise gate/up); in GPT-2's
    each loom layer is one Conv1D (c_attn, c_proj, c_fc).
    base_model_name_or_path is `base_model` if given, else the Hugging Face folder the base was imported from
    (its checkpoint, found where it was trained or at `base`, records it)."""
    directory, metadata = open_checkpoint(source)
    if metadata.lora_base is None:
        raise CheckpointError(f"{directory} is not a LoRA checkpoint; --adapter-only exports a LoRA run's adapters")
    try:
        base_metadata = base_of(directory, metadata, base, verify_hashes=False)[1]
    except CheckpointError:  # the base moved or changed: the adapters themselves still export, unnamed
        base_metadata = None
    if base_model is None and base_metadata is not None:
        if base_metadata.hf_model_type == "gemma3":  # its text model sits under model.language_model there
            raise CheckpointError(
                f"the base was imported from an image-text Gemma 3 ({base_metadata.hf_source}), whose text model "
                "the adapters do not name as PEFT would find it: export the base with `loom ckpt export-hf` (a "
                "Gemma3ForCausalLM) and give that folder as --base-model"
            )
        base_model = base_metadata.hf_source
    config = config_from_dict(metadata.config)
    model = config_to_dict(config)["model"]
    # a Phi-3's adapters sit on its fused modules (qkv_proj, gate_up_proj), as export_hf writes its base
    phi3 = phi3_form(model, (base_metadata or metadata).hf_model_type)
    gpt2 = has_gpt2_form(model)
    if not gpt2:
        check_llama_form(model, gpt2_too=True)
    reader, sizes = PieceReader(directory, metadata), _fused_sizes(model)
    tensors, modules = {}, set()
    for weight, (a_name, b_name) in adapted_weights(metadata.specs).items():
        a, b = reader.model(a_name).float(), reader.model(b_name).float()
        if gpt2:  # one Conv1D per loom layer, named whole: c_proj is both the attention's and the MLP's last
            module = gpt2_module(weight)
            modules.add(module)
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            continue
        hf_weights = _hf_names(weight, _block_names(model, phi3), model["num_experts"])
        b_parts = b.split(sizes[naming.split_block_param_name(weight)[1]]) if len(hf_weights) > 1 else (b,)
        for hf_weight, b_part in zip(hf_weights, b_parts, strict=True):
            module = hf_weight.removesuffix(".weight")
            modules.add(module.rpartition(".")[2])
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b_part.contiguous()
    lora = config.lora
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": gpt2,  # GPT-2's Conv1D keeps its weight [in, out]
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    with claimed_export_output(output, overwrite):  # weights without their adapter_config.json: PEFT cannot load them
        print(f"exporting the adapters of step {metadata.step}: {directory}", flush=True)
        output.mkdir(parents=True, exist_ok=True)
        save_tensors_atomically(tensors, output / "adapter_model.safetensors", metadata={"format": "pt"})
        write_text_atomically(output / "adapter_config.json", json.dumps(adapter_config, indent=2))
    return output

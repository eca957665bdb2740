"""Hugging Face interchange: a loom checkpoint <-> Llama-format safetensors + config.json (GPT-2-shaped models: the
GPT-2 format, whose names tools/hf_gpt2.py holds).

The mapping is the one place that knows Hugging Face's Llama names. loom's fused tensors are split on export (QKV ->
q_proj, k_proj, v_proj; SwiGLU fc1 -> gate_proj, up_proj) and joined on import; loom's rotary embedding already uses
Hugging Face's rotate-half convention, so no permutation of the query/key rows is needed. Only Llama-shaped models
(RMSNorm, SwiGLU, RoPE, no biases) have a Llama form; with biases on QKV alone (model.qkv_bias) the same model is a
Qwen2, whose names are Llama's with q/k/v_proj.bias, and with query/key norms (model.qk_norm) a Qwen3 (q_norm,
k_norm). A Phi-3 (Phi-4 too) is a Llama whose files keep QKV and gate+up fused as loom does: it imports and
exports back as one (CheckpointMetadata.hf_model_type), and so does any model that turns part of each head
(partial_rotary_factor, model.rotary_percent), which only transformers' Phi-3 class computes. A Granite is a Llama
with four scalars (embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling:
GRANITE_MULTIPLIERS), and a loom model that sets any exports as one. On import, the rotary settings are read
wherever transformers put them (`rope_parameters` since 5.0, `rope_theta`/`rope_scaling` before), Llama 3.1's
llama3 scaling and Phi-3.5's longrope are kept, and any setting loom cannot represent (Llama's attention_bias or
mlp_bias, other RoPE types, another activation) is refused with one line naming it: an import never yields a
different model than the one on disk. transformers is not needed here: the files are written with safetensors and
json; tests load them with transformers.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loom.data_tools.tokenizer import BOS_ID, EOS_ID
from loom.engine.atomic import (
    save_tensors_atomically,
    stream_tensors_atomically,
    torch_dtype_of,
    write_text_atomically,
)
from loom.engine.checkpoint.format import CheckpointError, sha256_of, unrecorded_tokenizer
from loom.engine.checkpoint.load import PieceReader
from loom.engine.config import ModelConfig
from loom.engine.config_io import config_from_dict, config_to_dict
from loom.engine.model import naming
from loom.tools.ckpt import LazyWeights, first_few, open_checkpoint, write_weights_checkpoint
from loom.tools.hf_gpt2 import (
    GPT2_SHAPE,
    embedding_key,
    from_gpt2,
    gpt2_config,
    gpt2_module,
    has_gpt2_form,
    model_from_gpt2_config,
    to_gpt2,
)
from loom.tools.hf_tokenizer import check_moved_tokenizer, export_tokenizer
from loom.tools.lora import ModelWeights, adapted_weights, base_of
from loom.tools.outputs import HF_TOKENIZER_FILES, claimed_checkpoint_output, claimed_export_output


def _check_llama(model: dict, gpt2_too: bool = False) -> None:
    wrong = {
        k: model[k]
        for k, v in (("norm", "rmsnorm"), ("activation", "swiglu"), ("position_embedding", "rope"), ("bias", False))
        if model[k] != v
    }
    if model["qk_norm"] and model["qkv_bias"]:  # Qwen3's attention_bias would bias o_proj too
        wrong["qkv_bias with qk_norm"] = True
    if model["rotary_percent"] < 1 and (model["qk_norm"] or model["qkv_bias"]):  # only Phi-3's class turns part
        wrong["rotary_percent with " + ("qk_norm" if model["qk_norm"] else "qkv_bias")] = model["rotary_percent"]
    if model["rotary_percent"] < 1 and model["rope_scaling"] == "llama3":  # Phi3Config takes default and longrope
        wrong["rotary_percent with llama3 rope scaling"] = model["rotary_percent"]
    narrow = model["head_dim"] * model["num_heads"] != model["hidden_size"]
    if model["rotary_percent"] < 1 and model["rope_scaling"] == "longrope" and narrow:
        # Phi3Config sizes longrope's factor lists from hidden_size / num_heads, whatever head_dim says
        wrong["rotary_percent and longrope with a head_dim other than hidden_size / num_heads"] = model["head_dim"]
    if _granite_form(model) and (model["qk_norm"] or model["qkv_bias"] or model["rotary_percent"] < 1):
        # only Granite's class scales embeddings, residual branches, scores and logits
        wrong["Granite's multipliers with qk_norm, qkv_bias or rotary_percent"] = True
    if wrong and gpt2_too:
        unlike_gpt2 = {k: model[k] for k, v in GPT2_SHAPE.items() if model[k] != v}
        raise CheckpointError(
            "only Llama-shaped models (rmsnorm, swiglu, rope, no biases but QKV's) and GPT-2-shaped ones (layernorm, "
            "gelu, learned positions, biases, no query/key norms, as many KV heads as heads, each hidden_size / heads "
            f"wide) export to Hugging Face; this one has {min(wrong, unlike_gpt2, key=len) or wrong}"
        )
    if wrong:
        raise CheckpointError(f"only Llama-shaped models export to the Llama format; this one has {wrong}")


def _hf_rope(model: dict) -> dict:
    """rope_parameters as transformers >= 5 writes it; the same values also go out in the older top-level
    rope_theta / rope_scaling form, so transformers 4 reads the file too."""
    rope = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    if model["rotary_percent"] < 1:
        rope["partial_rotary_factor"] = model["rotary_percent"]
    if model["rope_scaling"] == "longrope":
        rope.update(
            rope_type="longrope",
            short_factor=model["rope_short_factors"],
            long_factor=model["rope_long_factors"],
            attention_factor=ModelConfig(**model).longrope_attention_factor,
            original_max_position_embeddings=model["rope_original_max_positions"],
        )
    if model["rope_scaling"] == "llama3":
        rope.update(
            rope_type="llama3",
            factor=model["rope_scaling_factor"],
            low_freq_factor=model["rope_low_freq_factor"],
            high_freq_factor=model["rope_high_freq_factor"],
            original_max_position_embeddings=model["rope_original_max_positions"],
        )
    return rope


# The special tokens of loom's tokenizers (`loom data tokenizer`: unk 0, bos 1, eos 2, pad 3), written for a model
# trained here; an imported model's own ids travel in its checkpoint (CheckpointMetadata.hf_token_ids).
LOOM_TOKEN_IDS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
HF_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


GRANITE_MULTIPLIERS = {
    "embedding_multiplier": "embedding_multiplier",
    "residual_multiplier": "residual_multiplier",
    "logits_divisor": "logits_scaling",
}
"""loom's fields for Granite's scalar multipliers -> their config.json names (its attention_multiplier is
model.attention_scale, the whole score factor)."""


def _granite_form(model: dict) -> bool:
    """Whether a Llama-shaped loom model exports as a Granite: only transformers' Granite class scales the
    embeddings, residual branches, attention scores and logits."""
    return model["attention_scale"] is not None or any(model[field] != 1.0 for field in GRANITE_MULTIPLIERS)


def _phi3_form(model: dict, imported_from: str | None) -> bool:
    """Whether a Llama-shaped loom model exports as a Phi-3: one imported from a Phi-3 (`imported_from`: the
    model_type it was imported from) goes back as one, and transformers' Llama turns each head whole, its Phi-3 the
    part model.rotary_percent says."""
    return not _granite_form(model) and (model["rotary_percent"] < 1 or imported_from == "phi3")


def _hf_architecture(model: dict, phi3: bool) -> dict:
    """The config.json fields naming the Hugging Face class of a Llama-shaped loom model: Phi-3 rotating part of
    each head, Qwen3 with query/key norms, Qwen2 with biases on q, k and v alone, Llama otherwise (Llama's and
    Qwen3's attention_bias would bias o_proj too, so neither takes QKV's alone)."""
    if _granite_form(model):
        multipliers = {granite: model[field] for field, granite in GRANITE_MULTIPLIERS.items()}
        multipliers["attention_multiplier"] = ModelConfig(**model).softmax_scale
        return {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "attention_bias": False,
                "mlp_bias": False, **multipliers}  # fmt: skip
    if phi3:  # Phi3Config's token ids default to Phi-3's own (eos and pad 32000): none unless known
        return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": None,
                "partial_rotary_factor": model["rotary_percent"], **dict.fromkeys(HF_TOKEN_ID_FIELDS)}  # fmt: skip
    if model["qk_norm"]:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                "attention_bias": False}  # fmt: skip
    if model["qkv_bias"]:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False}


def hf_config(model: dict, token_ids: dict | None = None, dtype: str = "float32", phi3: bool = False) -> dict:
    """The config.json transformers reads for a Llama-shaped loom model, as a Llama, a Qwen2 or a Qwen3
    (_hf_architecture; `model`: ModelConfig's fields; `token_ids`: the special-token ids, loom's tokenizers' by
    default; `dtype`: the weights' torch_dtype; `phi3`: as a Phi-3, _phi3_form)."""
    rope = _hf_rope(model)
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None
    return {
        **_hf_architecture(model, phi3),
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["ffn_hidden_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model["head_dim"],
        "max_position_embeddings": model["max_position_embeddings"],
        "rms_norm_eps": model["norm_eps"],
        "rope_parameters": rope,
        "rope_theta": model["rope_theta"],
        "rope_scaling": legacy_scaling,
        # read before the one in rope_parameters (Phi3Config would otherwise put its 4096 there)
        **({"original_max_position_embeddings": model["rope_original_max_positions"]} if legacy_scaling else {}),
        "hidden_act": "silu",
        "tie_word_embeddings": model["tie_embeddings"],
        "initializer_range": model["init_std"],
        "torch_dtype": dtype,
        **(LOOM_TOKEN_IDS if token_ids is None else token_ids),
    }


# Hugging Face's names for loom's: outside the blocks, and inside block i (under model.layers.<i>.). A fused
# loom tensor (QKV, SwiGLU gate+up) maps to several Hugging Face tensors stacked along dim 0 in this order.
_OUTSIDE_BLOCKS = {
    naming.EMBEDDING: "model.embed_tokens.weight",
    naming.FINAL_NORM_WEIGHT: "model.norm.weight",
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


def _fused_sizes(model: dict) -> dict[str, list[int]]:
    """Rows of each Hugging Face tensor inside a fused loom tensor, by loom's name inside the block."""
    q_rows, kv_rows = model["num_heads"] * model["head_dim"], model["num_kv_heads"] * model["head_dim"]
    return {
        naming.QKV_WEIGHT: [q_rows, kv_rows, kv_rows],
        naming.QKV_BIAS: [q_rows, kv_rows, kv_rows],
        naming.FC1_WEIGHT: [model["ffn_hidden_size"], model["ffn_hidden_size"]],
    }


def _loom_names(model: dict) -> list[str]:
    """Every logical tensor of a Llama-shaped loom model (a Qwen2's: its QKV biases too)."""
    outside = [naming.EMBEDDING, naming.FINAL_NORM_WEIGHT] + ([] if model["tie_embeddings"] else [naming.OUTPUT])
    optional = {
        naming.QKV_BIAS: model["qkv_bias"],
        naming.Q_NORM_WEIGHT: model["qk_norm"],
        naming.K_NORM_WEIGHT: model["qk_norm"],
    }
    in_block = [local for local in _IN_BLOCK if optional.get(local, True)]
    return outside + [naming.block_param_name(i, local) for i in range(model["num_layers"]) for local in in_block]


def _hf_names(name: str, phi3: bool = False) -> tuple[str, ...]:
    """Hugging Face's tensor(s) holding loom's tensor `name` (`phi3`: in a Phi-3's fused names)."""
    in_block = naming.split_block_param_name(name)
    if in_block is None:
        return (_OUTSIDE_BLOCKS[name],)
    layer, local = in_block
    return tuple(f"model.layers.{layer}.{hf}" for hf in (_PHI3_IN_BLOCK if phi3 else _IN_BLOCK)[local])


def to_hf(logical: Mapping[str, torch.Tensor], model: dict, phi3: bool = False) -> LazyWeights:
    """loom logical tensors -> Hugging Face Llama (or Phi-3: _phi3_form) state dict, each tensor made when asked
    for."""
    logical = LazyWeights.of(logical)
    sizes = _fused_sizes(model)
    shapes, part_of = {}, {}
    for name in _loom_names(model):
        hf_names, shape = _hf_names(name, phi3), logical.shapes[name]
        rows = [shape[0]] if len(hf_names) == 1 else sizes[naming.split_block_param_name(name)[1]]
        for index, (hf_name, count) in enumerate(zip(hf_names, rows, strict=True)):
            shapes[hf_name] = (count, *shape[1:])
            part_of[hf_name] = (name, index, rows)
    last: dict[str, torch.Tensor] = {}  # the loom tensor whose parts are being asked for, made once for them all

    def make(hf_name: str) -> torch.Tensor:
        name, index, rows = part_of[hf_name]
        if name not in last:
            last.clear()
            last[name] = logical[name]
        return last[name].split(rows)[index].contiguous()

    return LazyWeights(shapes, make)


def from_hf(tensors: Mapping[str, torch.Tensor], model: dict, phi3: bool = False) -> LazyWeights:
    """Hugging Face Llama state dict (`phi3`: a Phi-3's) -> loom logical tensors, each made when asked for."""
    tensors = LazyWeights.of(tensors)
    shapes, parts_of, used = {}, {}, set()
    for name in _loom_names(model):
        hf_names = parts_of[name] = _hf_names(name, phi3)
        used.update(hf_names)
        parts = [tensors.shapes[hf] for hf in hf_names]
        if len(parts) > 1 and (min(map(len, parts)) == 0 or len({part[1:] for part in parts}) > 1):
            raise CheckpointError(f"{', '.join(hf_names)} have shapes {parts}, which do not stack into loom's {name}")
        shapes[name] = parts[0] if len(parts) == 1 else (sum(part[0] for part in parts), *parts[0][1:])
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
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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
        _check_llama(model, gpt2_too=True)
    weights = ModelWeights(directory, metadata, base)
    origin = weights.model_metadata  # a LoRA checkpoint's Hugging Face origin is its base's
    trained_with = weights.tokenizer
    if trained_with is None and origin.hf_source is None:
        trained_with = unrecorded_tokenizer(metadata.config)  # an older checkpoint: its config names it, unchecked
    if tokenizer is not None:
        check_moved_tokenizer(trained_with, tokenizer, model["vocab_size"])
    dtype = dtype or origin.hf_dtype or "float32"
    # Each weight read, cast and written on its own: the whole model held in memory took 1-2.5x the checkpoint
    cast = LazyWeights(weights.shapes, lambda name: weights[name].to(EXPORT_DTYPES[dtype]))
    phi3 = _phi3_form(model, origin.hf_model_type)
    tensors = to_gpt2(cast, model) if gpt2 else to_hf(cast, model, phi3)
    declared = {hf_name: (EXPORT_DTYPES[dtype], shape) for hf_name, shape in tensors.shapes.items()}
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


def _rope_parameters(hf: dict) -> dict:
    """The rotary settings wherever the writer put them, read as transformers reads them: transformers >= 5 nests
    rope_theta and the scaling in `rope_parameters`, older versions write a top-level `rope_theta` and a
    `rope_scaling` dict; where both are given, a non-empty `rope_scaling` replaces `rope_parameters` whole
    (PreTrainedConfig.convert_rope_params_to_dict), and rope_theta then comes from the top level."""
    chosen = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(chosen, dict):
        raise CheckpointError("config.json's rope_scaling / rope_parameters is not an object")
    rope = dict(chosen)
    if rope and all(isinstance(value, dict) for value in rope.values()):
        raise CheckpointError(f"config.json sets rope_parameters per layer type ({', '.join(rope)}); loom has one RoPE")
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def _rope_fields(hf: dict) -> dict:
    rope = _rope_parameters(hf)
    fields = {"rope_theta": float(rope["rope_theta"])}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and hf.get("model_type") != "phi3":  # transformers' other classes turn each head whole
        raise CheckpointError(
            f"config.json sets partial_rotary_factor {partial} for model_type {hf.get('model_type')!r}, whose "
            "transformers class rotates the whole head; loom imports it with Phi-3's"
        )
    fields["rotary_percent"] = float(partial)
    # transformers prefers the top-level field (Phi-3 writes it) to the one inside the rope settings
    original = int(
        hf.get("original_max_position_embeddings")
        or (4096 if hf.get("model_type") == "phi3" else None)  # Phi3Config's default, which transformers then uses
        or rope.get("original_max_position_embeddings")
        or hf["max_position_embeddings"]
    )
    if rope["rope_type"] == "llama3":
        fields.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_positions=original,
        )
    elif rope["rope_type"] == "longrope":
        # The cos/sin factor resolved as transformers resolves it (from `factor`, else from how far
        # max_position_embeddings extends the original context), so that a shorter import keeps it.
        extension = rope.get("factor") or hf["max_position_embeddings"] / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if extension <= 1 else math.sqrt(1 + math.log(extension) / math.log(original))
        fields.update(
            rope_scaling="longrope",
            rope_short_factors=[float(factor) for factor in rope["short_factor"]],
            rope_long_factors=[float(factor) for factor in rope["long_factor"]],
            rope_attention_factor=float(attention),
            rope_original_max_positions=original,
        )
    elif rope["rope_type"] != "default":
        raise CheckpointError(
            f"config.json's rope_type {rope['rope_type']!r} is not supported; loom imports default, llama3 and "
            "longrope RoPE"
        )
    return fields


def _refuse_unrepresentable(hf: dict) -> None:
    """Settings that change the computation but have no loom form: importing without them would load a
    different model than the one on disk."""
    if hf.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite"):
        raise CheckpointError(
            f"model_type {hf.get('model_type')!r} is not llama, mistral, qwen2, qwen3, phi3, granite or gpt2; loom "
            "imports Llama-, Mistral-, Qwen-, Phi-3-, Granite- and GPT-2-format models"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"config.json sets {flag}: true; loom's Llama form has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json's hidden_act is {hf['hidden_act']!r}; loom's Llama form uses silu")


def _positions_represented(hf: dict) -> int:
    """The sequence length up to which loom computes the model on disk: max_position_embeddings, or a Mistral's or
    a Phi-3's sliding window (a Qwen2's under use_sliding_window) where that is shorter (loom's attention is full
    causal, the same as a window's up to its length and not past it)."""
    positions = hf["max_position_embeddings"]
    qwen = hf.get("model_type") in ("qwen2", "qwen3")
    windowed = hf.get("model_type") in ("mistral", "phi3") or (qwen and hf.get("use_sliding_window"))
    window = hf.get("sliding_window") if windowed else None
    if window is not None and (type(window) is not int or window < 1):
        raise CheckpointError(f"config.json's sliding_window {window!r} is neither null nor a number of tokens")
    return positions if window is None else min(positions, window)


def _model_from_hf_config(hf: dict) -> dict:
    _refuse_unrepresentable(hf)
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim"),  # None: hidden_size / num_attention_heads, as transformers takes it
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": _positions_represented(hf),
        "norm_eps": hf["rms_norm_eps"],
        **_rope_fields(hf),
        "tie_embeddings": hf.get("tie_word_embeddings", False),
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position_embedding": "rope",
        "bias": False,
        "qkv_bias": hf.get("model_type") == "qwen2",
        "qk_norm": hf.get("model_type") == "qwen3",
        **(_granite_fields(hf) if hf.get("model_type") == "granite" else {}),
    }


def _granite_fields(hf: dict) -> dict:
    """A Granite's multipliers as loom's fields (each 1.0 where its config leaves it out, as GraniteConfig does)."""
    fields = {field: float(hf.get(granite, 1.0)) for field, granite in GRANITE_MULTIPLIERS.items()}
    return {**fields, "attention_scale": float(hf.get("attention_multiplier", 1.0))}


def _read_hf_config(source: Path) -> dict:
    config_path = source / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{source} has no config.json; expected a Hugging Face model directory (Llama, GPT-2)")
    try:
        hf = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path} holds {type(hf).__name__}, not a model configuration object")
    return hf


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
    hf = _read_hf_config(source)
    gpt2 = hf.get("model_type") == "gpt2"
    try:
        model = model_from_gpt2_config(hf) if gpt2 else _model_from_hf_config(hf)
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
        raise CheckpointError(f"{source} has no tensor {error.args[0]!r}; is it a Llama model?") from None
    except CheckpointError as error:
        raise CheckpointError(f"{source}: {error}") from None
    origin = {
        "hf_source": str(source.resolve()),
        "hf_token_ids": {field: hf[field] for field in HF_TOKEN_ID_FIELDS if hf.get(field) is not None},
        "hf_dtype": _stored_dtype(tensors, embedding),
        "hf_model_type": hf.get("model_type"),
        "hf_tokenizer": {name: sha256_of(source / name) for name in HF_TOKENIZER_FILES if (source / name).is_file()}
        or None,
    }
    with claimed_checkpoint_output(output, overwrite):  # once all is known good: --overwrite moves the old one aside
        return write_weights_checkpoint(output, config, logical, "the Hugging Face model", hf_origin=origin)


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
        base_model = base_metadata.hf_source
    config = config_from_dict(metadata.config)
    model = config_to_dict(config)["model"]
    # a Phi-3's adapters sit on its fused modules (qkv_proj, gate_up_proj), as export_hf writes its base
    phi3 = _phi3_form(model, (base_metadata or metadata).hf_model_type)
    gpt2 = has_gpt2_form(model)
    if not gpt2:
        _check_llama(model, gpt2_too=True)
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
        hf_weights = _hf_names(weight, phi3)
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

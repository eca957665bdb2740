"""Which Hugging Face class a Llama-shaped loom model is, and back: the config.json export-hf writes (Llama, Qwen2,
Qwen3, Phi-3, Granite, OLMo 2, Nemotron or Gemma, with RoPE in both transformers' spellings) and the [model]
import-hf reads from one, refusing what loom cannot compute alike. tools/hf.py moves the tensors; tools/hf_gpt2.py
has GPT-2's form."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loom.data_tools.tokenizer import BOS_ID, EOS_ID
from loom.engine.checkpoint.format import CheckpointError
from loom.engine.config import ModelConfig
from loom.tools.hf_gemma import (
    GEMMA_MODEL_TYPES,
    gemma3_rope,
    gemma_architecture,
    gemma_fields,
    gemma_form,
    gemma_form_refusals,
    refuse_unrepresentable_gemma,
    windowed,
    with_class_defaults,
)
from loom.tools.hf_gpt2 import GPT2_SHAPE
from loom.tools.hf_moe import (
    MOE_MODEL_TYPES,
    moe_architecture,
    moe_fields,
    moe_form_refusals,
    refuse_unrepresentable_moe,
    with_moe_class_defaults,
)


def check_llama_form(model: dict, gpt2_too: bool = False) -> None:
    nemotron, gemma = nemotron_form(model), gemma_form(model)
    wrong = {
        k: model[k]
        for k, v in (("norm", "rmsnorm"), ("activation", "swiglu"), ("position_embedding", "rope"), ("bias", False))
        if model[k] != v and not (nemotron and k in ("norm", "activation")) and not (gemma and k == "activation")
    }
    wrong.update(gemma_form_refusals(model))
    wrong.update(_window_form_refusals(model) if model["num_experts"] is None else {})
    if nemotron and (
        model["qk_norm"] or model["qkv_bias"] or model["norm_placement"] != "input" or granite_form(model)
    ):
        # only transformers' Nemotron has LayerNorm and squared ReLU, and it has none of these
        wrong["LayerNorm and squared ReLU (Nemotron's) with qk_norm, qkv_bias, norm_placement or Granite's"] = True
    # MiniMax-M2 and GLM-4.5 (sigmoid scores): their own refusals (moe_form_refusals)
    sigmoid_experts = model["num_experts"] is not None and model.get("moe_router_score") == "sigmoid"
    if model["qk_norm"] and model["qkv_bias"] and not sigmoid_experts:  # Qwen3's attention_bias would bias o_proj too
        wrong["qkv_bias with qk_norm"] = True
    if model["rotary_percent"] < 1 and (model["qk_norm"] or model["qkv_bias"]) and not sigmoid_experts:
        wrong["rotary_percent with " + ("qk_norm" if model["qk_norm"] else "qkv_bias")] = model["rotary_percent"]
    phi3_rotary = model["rotary_percent"] < 1 and not nemotron  # part of each head turned by Phi-3's class
    if phi3_rotary and model["rope_scaling"] in ("linear", "llama3", "yarn"):  # Phi3Config: default and longrope
        wrong[f"rotary_percent with {model['rope_scaling']} rope scaling"] = model["rotary_percent"]
    narrow = model["head_dim"] * model["num_heads"] != model["hidden_size"]
    if phi3_rotary and model["rope_scaling"] == "longrope" and narrow:
        # Phi3Config sizes longrope's factor lists from hidden_size / num_heads, whatever head_dim says
        wrong["rotary_percent and longrope with a head_dim other than hidden_size / num_heads"] = model["head_dim"]
    wrong.update(moe_form_refusals(model) if model["num_experts"] is not None else _olmo2_form_refusals(model))
    if granite_form(model) and (model["qk_norm"] or model["qkv_bias"] or model["rotary_percent"] < 1):
        # only Granite's class scales embeddings, residual branches, scores and logits
        wrong["Granite's multipliers with qk_norm, qkv_bias or rotary_percent"] = True
    if wrong and gpt2_too:
        unlike_gpt2 = {k: model[k] for k, v in GPT2_SHAPE.items() if model[k] != v}
        raise CheckpointError(
            "only Llama-shaped models (rmsnorm, swiglu or Gemma's geglu, rope, no biases but QKV's; or layernorm and "
            "squared_relu, as Nemotron) and GPT-2-shaped ones (layernorm, gelu, learned positions, biases, no "
            "query/key norms, as many KV heads as heads, each hidden_size / heads wide) export to Hugging Face; this "
            f"one has {_described(min(wrong, unlike_gpt2, key=len) or wrong)}"
        )
    if wrong:
        raise CheckpointError(f"only Llama-shaped models export to the Llama format; this one has {_described(wrong)}")


def _described(settings: dict) -> str:
    """A refusal's settings as words: a phrase alone where it says all (its value True), else `name = value`."""
    return "; ".join(name if value is True else f"{name} = {value}" for name, value in settings.items())


def _window_form_refusals(model: dict) -> dict:
    """What keeps a model that is no Gemma (gemma_form) from exporting with soft-capping, sandwich norms or a sliding
    window: only transformers' Gemma 2 and 3 have the first two and a window in some layers alone; a window in every
    layer exports as a Mistral (a Phi-3, turning part of each head), which has none of Qwen's, OLMo 2's,
    Nemotron's or Granite's changes."""
    if gemma_form(model):
        return {}
    every_layer = model["full_attention_interval"] is None
    unlike = {
        "rope_local_theta (Gemma 3's)": windowed(model) and model["rope_local_theta"] is not None,
        "soft-capping": model["attention_softcap"] is not None or model["logits_softcap"] is not None,
        "norm_placement both": model["norm_placement"] == "both",
        "a full_attention_interval": windowed(model) and not every_layer,
        "a sliding window with qk_norm, qkv_bias, layernorm, Granite's multipliers or norm_placement output": (
            windowed(model)
            and (
                model["qk_norm"]
                or model["qkv_bias"]
                or model["norm_placement"] != "input"
                or model["norm"] != "rmsnorm"
                or granite_form(model)
            )
        ),
    }
    return {f"{k} without geglu (only transformers' Gemma 2 and 3 have it)": True for k, v in unlike.items() if v}


def _olmo2_form_refusals(model: dict) -> dict:
    """What keeps a model with norms on its blocks' outputs, or query/key norms across all heads, from exporting:
    only transformers' OLMo 2 class has either, and always both, with neither biases nor Phi-3's or Granite's
    changes."""
    outputs_normed = model["norm_placement"] == "output"
    across_heads = model["qk_norm"] and not model["qk_norm_per_head"]
    if not (outputs_normed or across_heads):
        return {}
    if not (outputs_normed and across_heads):
        has, lacks = "norm_placement output", "query/key norms across all heads (qk_norm, qk_norm_per_head false)"
        if across_heads:
            has, lacks = lacks, has
        return {f"{has} without {lacks}, which transformers' OLMo 2, the one class with either, has too": True}
    unlike = {  # QKV biases with query/key norms are refused for every class
        "rotary_percent < 1": model["rotary_percent"] < 1,
        "longrope scaling": model["rope_scaling"] == "longrope",
        "Granite's multipliers": granite_form(model),
    }
    return {f"norm_placement output with {k}": True for k, v in unlike.items() if v}


_ROPE_SCALING_FIELDS = {
    "linear": {"factor": "rope_scaling_factor"},
    "llama3": {
        "factor": "rope_scaling_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
    },
    "longrope": {
        "short_factor": "rope_short_factors",
        "long_factor": "rope_long_factors",
        "attention_factor": "rope_attention_factor",  # resolved by ModelConfig
    },
    "yarn": {
        "factor": "rope_scaling_factor",
        "beta_fast": "rope_yarn_beta_fast",
        "beta_slow": "rope_yarn_beta_slow",
        "attention_factor": "rope_attention_factor",
    },
}
"""Each rope scaling's keys in Hugging Face's rope_parameters -> the [model] fields export-hf writes them from."""


def _hf_rope(model: dict) -> dict:
    """rope_parameters as transformers >= 5 writes it; the same values also go out in the older top-level
    rope_theta / rope_scaling form, so transformers 4 reads the file too (4.50 to 4.55 take yarn's factor as
    max_position_embeddings / original_max_position_embeddings instead: the same model where those agree)."""
    rope = {"rope_type": "default", "rope_theta": model["rope_theta"]}
    if model["rotary_percent"] < 1:
        rope["partial_rotary_factor"] = model["rotary_percent"]
    if model["rope_scaling"] != "none":
        fields = _ROPE_SCALING_FIELDS[model["rope_scaling"]]
        rope.update(rope_type=model["rope_scaling"], **{key: model[field] for key, field in fields.items()})
        if model["rope_scaling"] != "linear":  # the others scale by how far positions reach past it
            rope["original_max_position_embeddings"] = model["rope_original_max_positions"]
    return rope


# The special tokens of loom's tokenizers (`loom data tokenizer`: unk 0, bos 1, eos 2, pad 3), written for a model
# trained here; an imported model's own ids travel in its checkpoint (CheckpointMetadata.hf_token_ids).
LOOM_TOKEN_IDS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
HF_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


GRANITE_MULTIPLIERS = {
    "embedding_multiplier": "embedding_multiplier",
    "residual_multiplier": "residual_multiplier",
    "logits_divisor": "logits_scaling",
}
"""loom's fields for Granite's scalar multipliers -> their config.json names (its attention_multiplier is
model.attention_scale, the whole score factor)."""


def nemotron_form(model: dict) -> bool:
    """Whether a Llama-shaped loom model exports as a Nemotron: transformers' one class with LayerNorm (its weights
    stored minus one) and a squared-ReLU MLP."""
    return model["norm"] == "layernorm" and model["activation"] == "squared_relu"


def granite_form(model: dict) -> bool:
    """Whether a Llama-shaped loom model exports as a Granite: only transformers' Granite class scales the
    embeddings, residual branches, attention scores and logits (a Gemma scales its embeddings and scores by rules of
    its own)."""
    if gemma_form(model):
        return False
    return model["attention_scale"] is not None or any(model[field] != 1.0 for field in GRANITE_MULTIPLIERS)


def phi3_form(model: dict, imported_from: str | None) -> bool:
    """Whether a Llama-shaped loom model exports as a Phi-3: one imported from a Phi-3 (`imported_from`: the
    model_type it was imported from) goes back as one unless its RoPE is one Phi3Config cannot take (llama3, yarn:
    then as the Llama it equals), and transformers' Llama turns each head whole, its Phi-3 the part
    model.rotary_percent says."""
    phi3_rope = model["rope_scaling"] in ("none", "longrope")
    return not granite_form(model) and (model["rotary_percent"] < 1 or (imported_from == "phi3" and phi3_rope))


def _hf_architecture(model: dict, phi3: bool) -> dict:
    """The config.json fields naming the Hugging Face class of a Llama-shaped loom model: Granite with any of its
    multipliers, Nemotron with LayerNorm and squared ReLU, Gemma with a gated GELU, OLMo 2 with norms on the blocks'
    outputs, Phi-3 (`phi3`: phi3_form), Qwen3 with query/key norms, Qwen2 with biases on q, k and v alone, Mistral
    with a sliding window in every layer, Llama otherwise (Llama's and Qwen3's attention_bias would bias o_proj too,
    so neither takes QKV's alone)."""
    if granite_form(model):
        multipliers = {granite: model[field] for field, granite in GRANITE_MULTIPLIERS.items()}
        multipliers["attention_multiplier"] = ModelConfig(**model).softmax_scale
        return {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "attention_bias": False,
                "mlp_bias": False, **multipliers}  # fmt: skip
    if nemotron_form(model):  # NemotronConfig turns half of each head unless told (so it is always told)
        return {"architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "attention_bias": False,
                "mlp_bias": False, "partial_rotary_factor": model["rotary_percent"], "norm_eps": model["norm_eps"],
                "hidden_act": "relu2"}  # fmt: skip
    if gemma_form(model):
        return gemma_architecture(model, _hf_rope(model))
    if model["num_experts"] is not None:
        return moe_architecture(model)
    if model["norm_placement"] == "output":  # Olmo2Config's token ids default to OLMo's own (pad 1, eos 50279)
        return {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
                **dict.fromkeys(HF_TOKEN_ID_FIELDS)}  # fmt: skip
    window = model["sliding_window"] if windowed(model) else None
    if phi3:  # Phi3Config's token ids default to Phi-3's own (eos and pad 32000): none unless known
        return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": window,
                "partial_rotary_factor": model["rotary_percent"], **dict.fromkeys(HF_TOKEN_ID_FIELDS)}  # fmt: skip
    if model["qk_norm"]:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                "attention_bias": False}  # fmt: skip
    if model["qkv_bias"]:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}
    if window is not None:  # a Llama attending within a window in every layer
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False}


def hf_config(model: dict, token_ids: dict | None = None, dtype: str = "float32", phi3: bool = False) -> dict:
    """The config.json transformers reads for a Llama-shaped loom model, as a Llama, a Qwen2, a Qwen3, a Phi-3, a
    Granite, an OLMo 2, a Nemotron or a Gemma (_hf_architecture; `model`: ModelConfig's fields; `token_ids`: the
    special-token ids, loom's tokenizers' by default; `dtype`: the weights' torch_dtype; `phi3`: as a Phi-3,
    phi3_form)."""
    rope = _hf_rope(model)
    if nemotron_form(model):
        rope["partial_rotary_factor"] = model["rotary_percent"]
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None
    original = "original_max_position_embeddings" in rope
    architecture = _hf_architecture(model, phi3)
    per_layer_type = {k: architecture.pop(k) for k in ("rope_parameters",) if k in architecture}  # Gemma 3's
    return {
        **architecture,
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
        **per_layer_type,
        "rope_theta": model["rope_theta"],
        "rope_scaling": legacy_scaling,
        # read before the one in rope_parameters (Phi3Config would otherwise put its 4096 there)
        **({"original_max_position_embeddings": rope["original_max_position_embeddings"]} if original else {}),
        "hidden_act": architecture.get("hidden_act", "silu"),
        "tie_word_embeddings": model["tie_embeddings"],
        "initializer_range": model["init_std"],
        "torch_dtype": dtype,
        **(LOOM_TOKEN_IDS if token_ids is None else token_ids),
    }


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
    if hf.get("model_type") == "phi3" and rope["rope_type"] in ("su", "yarn"):  # Phi-3's first files' longrope names
        rope["rope_type"] = "longrope"
    return rope


def _rope_fields(hf: dict) -> dict:
    rope = _rope_parameters(hf)
    fields = {"rope_theta": float(rope["rope_theta"])}
    default = 0.5 if hf.get("model_type") == "nemotron" else 1.0  # NemotronConfig's, kept for its first files
    if hf.get("model_type") == "minimax_m2" and hf.get("rotary_dim") is not None:  # its released files' field
        default = hf["rotary_dim"] / (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", default))
    if partial != 1.0 and hf.get("model_type") not in ("phi3", "nemotron", "minimax_m2", "glm4_moe"):  # others whole
        raise CheckpointError(
            f"config.json sets partial_rotary_factor {partial} for model_type {hf.get('model_type')!r}, whose "
            "transformers class rotates the whole head; loom imports it with Phi-3's, Nemotron's, MiniMax-M2's and "
            "GLM-4.5's"
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
    elif rope["rope_type"] == "yarn":
        fields.update(_yarn_fields(rope, hf["max_position_embeddings"], original))
    elif rope["rope_type"] == "linear":
        fields.update(rope_scaling="linear", rope_scaling_factor=float(rope["factor"]))
    elif rope["rope_type"] != "default":
        raise CheckpointError(
            f"config.json's rope_type {rope['rope_type']!r} is not supported; loom imports default, linear, llama3, "
            "longrope and yarn RoPE"
        )
    return fields


def _yarn_fields(rope: dict, positions: int, original: int) -> dict:
    """YaRN's settings as transformers reads them: the factor from how far max_position_embeddings extends the
    original context where none is given (DeepSeek's files), the cos/sin factor from the factor (and DeepSeek's
    mscale and mscale_all_dim) where none is given, beta_fast 32 and beta_slow 1 where absent or 0."""
    if rope.get("truncate", True) is not True:
        raise CheckpointError(
            "config.json's yarn RoPE sets truncate: false (gpt-oss's unrounded ramp bounds); loom rounds them"
        )
    factor = rope.get("factor") or positions / original

    def magnitude(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = magnitude(mscale) / magnitude(all_dim) if mscale and all_dim else magnitude(1.0)
    return {
        "rope_scaling": "yarn",
        "rope_scaling_factor": float(factor),
        "rope_yarn_beta_fast": float(rope.get("beta_fast") or 32),
        "rope_yarn_beta_slow": float(rope.get("beta_slow") or 1),
        "rope_attention_factor": float(attention),
        "rope_original_max_positions": original,
    }


LLAMA_SHAPED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "granite",
    "olmo2",
    "nemotron",
    *GEMMA_MODEL_TYPES,
    *MOE_MODEL_TYPES,
)
"""The config.json model_types import-hf reads as a Llama-shaped loom model (gpt2: tools/hf_gpt2.py)."""


def _refuse_unrepresentable(hf: dict) -> None:
    """Settings that change the computation but have no loom form: importing without them would load a
    different model than the one on disk."""
    if hf.get("model_type") not in LLAMA_SHAPED_MODEL_TYPES:
        raise CheckpointError(
            f"model_type {hf.get('model_type')!r} is not {', '.join(LLAMA_SHAPED_MODEL_TYPES)} or gpt2; loom imports "
            "Llama-, Mistral-, Qwen-, Phi-3-, Granite-, OLMo 2-, Nemotron-, Gemma-, Mixtral-, Qwen-MoE-, OLMoE-, "
            "MiniMax-M2-, GLM-4.5- and GPT-2-format models"
        )
    if hf.get("quantization_config"):  # MiniMax-M2's and DeepSeek-V3's released files: FP8 blocks and their scales
        method = (
            hf["quantization_config"].get("quant_method", "quantized")
            if isinstance(hf["quantization_config"], dict)
            else "quantized"
        )
        raise CheckpointError(
            f"config.json says the weights are quantized ({method}: quantization_config); loom imports unquantized "
            "weights: dequantize them to bf16 first (and drop quantization_config)"
        )
    for flag in ("attention_bias", "mlp_bias"):  # GLM-4.5's attention_bias biases q, k and v alone (qkv_bias)
        if hf.get(flag) and not (flag == "attention_bias" and hf.get("model_type") == "glm4_moe"):
            raise CheckpointError(f"config.json sets {flag}: true; loom's Llama form has no biases")
    if hf.get("model_type") in GEMMA_MODEL_TYPES:
        refuse_unrepresentable_gemma(hf)
        return
    if hf.get("model_type") in MOE_MODEL_TYPES:
        refuse_unrepresentable_moe(hf)
    nemotron = hf.get("model_type") == "nemotron"
    activation = "relu2" if nemotron else "silu"
    if hf.get("hidden_act", activation) != activation:
        raise CheckpointError(
            f"config.json's hidden_act is {hf['hidden_act']!r}; loom's {'Nemotron' if nemotron else 'Llama'} form "
            f"uses {activation}"
        )


def _every_layer_window(hf: dict) -> int | None:
    """The sliding window a Mistral or a Phi-3 attends within in every layer (a Qwen's under use_sliding_window,
    which its first max_window_layers layers lack), or None: none, or none shorter than its positions."""
    qwen = hf.get("model_type") in ("qwen2", "qwen3")
    windowed = hf.get("model_type") in ("mistral", "phi3", "mixtral") or (qwen and hf.get("use_sliding_window"))
    # MistralConfig's and Qwen's where a file has none (Phi3Config's and MixtralConfig's: none)
    default = None if hf.get("model_type") in ("phi3", "mixtral") else 4096
    window = hf.get("sliding_window", default) if windowed else None
    if window is not None and (type(window) is not int or window < 1):
        raise CheckpointError(f"config.json's sliding_window {window!r} is neither null nor a number of tokens")
    return window if window is not None and window < hf["max_position_embeddings"] else None


def _positions_represented(hf: dict) -> int:
    """The sequence length up to which loom computes the model on disk: max_position_embeddings, or a Qwen's sliding
    window under use_sliding_window where that is shorter (its first max_window_layers layers attend fully, which
    model.full_attention_interval cannot say: loom's full causal attention computes the same up to the window's
    length, not past it)."""
    window = _every_layer_window(hf)
    qwen = hf.get("model_type") in ("qwen2", "qwen3")
    return hf["max_position_embeddings"] if window is None or not qwen else window


def _window_of_every_layer(hf: dict) -> dict:
    """A Mistral's, a Phi-3's or a Mixtral's sliding window as model.sliding_window (every layer's)."""
    window = _every_layer_window(hf)
    every_layer = ("mistral", "phi3", "mixtral")
    return {} if window is None or hf.get("model_type") not in every_layer else {"sliding_window": window}


def model_from_hf_config(hf: dict) -> dict:
    hf = with_moe_class_defaults(with_class_defaults(hf))
    _refuse_unrepresentable(hf)
    kind = hf.get("model_type")
    gemma = kind in GEMMA_MODEL_TYPES
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        # None: hidden_size / num_attention_heads, as transformers takes it (GemmaConfig's default is 256)
        "head_dim": hf.get("head_dim", 256 if gemma else None),
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": _positions_represented(hf),
        "norm_eps": _norm_eps(hf),
        **(_gemma3_rope_fields(hf) if kind == "gemma3_text" else _rope_fields(hf)),
        "tie_embeddings": hf.get("tie_word_embeddings", False),
        "norm": "layernorm" if kind == "nemotron" else "rmsnorm",
        "activation": "squared_relu" if kind == "nemotron" else "swiglu",
        "position_embedding": "rope",
        "bias": False,
        "qkv_bias": kind == "qwen2",  # qwen2_moe's: moe_fields
        "qk_norm": kind in ("qwen3", "olmo2", "qwen3_moe", "olmoe", "minimax_m2")
        or (kind == "glm4_moe" and hf["use_qk_norm"]),
        "qk_norm_per_head": kind not in ("olmo2", "olmoe", "minimax_m2"),  # they normalise the whole q and k
        "norm_placement": "output" if kind == "olmo2" else "input",
        **(_granite_fields(hf) if kind == "granite" else {}),
        **_window_of_every_layer(hf),
        **(gemma_fields(hf) if gemma else {}),
        **(moe_fields(hf) if kind in MOE_MODEL_TYPES else {}),
    }


def _gemma3_rope_fields(hf: dict) -> dict:
    """A Gemma 3's RoPE: its full-attention layers' read as any model's rope_parameters, its sliding-window layers'
    base as model.rope_local_theta (tools/hf_gemma.gemma3_rope)."""
    full, local = gemma3_rope(hf)
    return {**_rope_fields({**hf, "rope_parameters": full, "rope_scaling": None}), "rope_local_theta": local}


def _norm_eps(hf: dict) -> float:
    """The norms' epsilon where each class reads it (NemotronConfig's norm_eps, 1e-5 if absent; GemmaConfig's
    rms_norm_eps, 1e-6 if absent; the others' rms_norm_eps, required)."""
    if hf.get("model_type") == "nemotron":
        return hf.get("norm_eps", 1e-5)
    return hf.get("rms_norm_eps", 1e-6) if hf.get("model_type") in GEMMA_MODEL_TYPES else hf["rms_norm_eps"]


def _granite_fields(hf: dict) -> dict:
    """A Granite's multipliers as loom's fields (each 1.0 where its config leaves it out, as GraniteConfig does)."""
    fields = {field: float(hf.get(granite, 1.0)) for field, granite in GRANITE_MULTIPLIERS.items()}
    return {**fields, "attention_scale": float(hf.get("attention_multiplier", 1.0))}


def read_hf_config(source: Path) -> dict:
    config_path = source / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{source} has no config.json; expected a Hugging Face model directory (Llama, Qwen, GPT-2, ...)"
        )
    try:
        hf = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path} holds {type(hf).__name__}, not a model configuration object")
    return hf

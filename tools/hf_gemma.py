"""Gemma's forms in Hugging Face's files (tools/hf_forms.py asks here): Gemma (GemmaForCausalLM), Gemma 2
(Gemma2ForCausalLM) and Gemma 3's text model (Gemma3ForCausalLM, model_type gemma3_text) are Llamas with a gated
tanh GELU (model.activation = geglu), RMSNorm weights stored minus one (tools/hf.py adds and takes off the one),
embeddings scaled by sqrt(hidden_size) and, from Gemma 2 on, sandwich norms (model.norm_placement = both), a score
factor of query_pre_attn_scalar^-1/2 (model.attention_scale) and sliding-window layers (model.sliding_window,
model.full_attention_interval) and Gemma 2 tanh soft-capping of the scores and logits (model.attention_softcap,
model.logits_softcap); Gemma 3 adds query/key norms per head and its own rotary base in the windowed layers
(model.rope_local_theta)."""

from __future__ import annotations

import math

from loom.engine.checkpoint.format import CheckpointError
from loom.engine.config import ModelConfig

GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
"""config.json's model_type of each Gemma generation import-hf reads."""

_TOKEN_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
_GEMMA2_SHAPE = {
    "vocab_size": 256_000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
}
CLASS_DEFAULTS = {
    "gemma": {
        "vocab_size": 256_000,
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 8192,
    },
    "gemma2": {**_GEMMA2_SHAPE, "max_position_embeddings": 8192, "sliding_window": 4096},
    "gemma3_text": {
        **_GEMMA2_SHAPE,
        "vocab_size": 262_208,
        "max_position_embeddings": 131_072,
        "sliding_window": 4096,
    },
}
for _defaults in CLASS_DEFAULTS.values():
    _defaults.update(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, **_TOKEN_IDS)
"""GemmaConfig's, Gemma2Config's and Gemma3TextConfig's defaults (transformers 5.24): the values transformers takes
for what a config.json leaves out (transformers 4 wrote the image-text Gemma 3's text_config without them)."""


def with_class_defaults(hf: dict) -> dict:
    """A Gemma config.json with its class's defaults where it says nothing (other configs as they are)."""
    kind = hf.get("model_type")
    return {**CLASS_DEFAULTS.get(kind, {}), **hf} if isinstance(kind, str) else hf


SLIDING, FULL = "sliding_attention", "full_attention"
"""Hugging Face's layer_types."""

_DEFAULT_INTERVAL = {"gemma2": 2, "gemma3_text": 6}
"""Every how-many-th layer attends fully where a file has no layer_types: Gemma2Config's alternation, Gemma 3's
sliding_window_pattern default."""


def gemma_form(model: dict) -> bool:
    """Whether a Llama-shaped loom model exports as a Gemma: transformers' Gemma classes alone have a gated GELU MLP
    (they scale the embeddings by sqrt(hidden_size) and store RMSNorm weights minus one)."""
    return model["activation"] == "geglu"


def gemma_generation(model: dict) -> str:
    """The model_type a Gemma-form model exports as: gemma3_text with sandwich norms and query/key norms, gemma2
    with sandwich norms alone, gemma otherwise."""
    if model["norm_placement"] != "both":
        return "gemma"
    return "gemma3_text" if model["qk_norm"] else "gemma2"


def gemma_embedding_multiplier(hidden_size: int) -> float:
    """What Gemma multiplies its token embeddings by: sqrt(hidden_size) (its ScaledWordEmbedding's scale)."""
    return hidden_size**0.5


def windowed(model: dict) -> bool:
    """Whether some layer of the model (ModelConfig's fields) attends within a sliding window."""
    return ModelConfig(**model).windowed


def gemma_form_refusals(model: dict) -> dict:
    """What keeps a Gemma-form model (gemma_form) from exporting as the Gemma its settings make it: {why: True}."""
    if not gemma_form(model):
        return {}
    generation = gemma_generation(model)
    sandwich = generation != "gemma"
    unlike = {
        "norm": model["norm"] != "rmsnorm",
        "qkv_bias": model["qkv_bias"],
        "rotary_percent < 1": model["rotary_percent"] < 1,
        "norm_placement output": model["norm_placement"] == "output",
        "query/key norms (Gemma 3's need sandwich norms)": model["qk_norm"] and not sandwich,
        "query/key norms across all heads": model["qk_norm"] and not model["qk_norm_per_head"],
        "Granite's multipliers": any(model[field] != 1.0 for field in ("residual_multiplier", "logits_divisor")),
        "an attention_scale (Gemma 2 and 3's query_pre_attn_scalar)": model["attention_scale"] is not None
        and not sandwich,
        "a sliding window (Gemma 2 and 3's need sandwich norms)": windowed(model) and not sandwich,
        "rope_local_theta (Gemma 3's)": model["rope_local_theta"] is not None and generation != "gemma3_text",
        # transformers 4 turns a Gemma 3's windowed layers unscaled, at rope_local_base_freq, whatever 5 is told
        "rope scaling in sliding-window layers (set rope_local_theta)": generation == "gemma3_text"
        and windowed(model)
        and model["rope_scaling"] != "none"
        and model["rope_local_theta"] is None,
        "soft-capping (Gemma 2's and 3's)": not sandwich
        and (model["attention_softcap"] is not None or model["logits_softcap"] is not None),
        f"an embedding_multiplier other than sqrt(hidden_size) = {math.sqrt(model['hidden_size'])}": (
            model["embedding_multiplier"] != gemma_embedding_multiplier(model["hidden_size"])
        ),
    }
    return {f"geglu (Gemma's) with {k}": True for k, v in unlike.items() if v}


def gemma_architecture(model: dict, rope: dict) -> dict:
    """The config.json fields of a Gemma-form model's class (hf_config writes the shape around them; `rope`: the
    model's rope_parameters, hf_forms._hf_rope's)."""
    generation = gemma_generation(model)
    names = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
    # GemmaConfig's token ids default to Gemma's own (pad 0, eos 1, bos 2): none unless known; transformers 4 reads
    # hidden_activation, 5 hidden_act (Gemma), hidden_activation (Gemma 2, 3)
    fields = {
        "architectures": [names[generation]],
        "model_type": generation,
        "attention_bias": False,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id")),
    }
    if generation == "gemma":
        return fields
    config = ModelConfig(**model)
    scalar = config.softmax_scale**-2
    types = [FULL if config.attention_window(i) is None else SLIDING for i in range(model["num_layers"])]
    fields.update(
        query_pre_attn_scalar=round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-12) else scalar,
        # read by the classes' masks even where no layer slides (None fails them): the positions then
        sliding_window=model["sliding_window"] if config.windowed else model["max_position_embeddings"],
        layer_types=types,
        final_logit_softcapping=model["logits_softcap"],
        attn_logit_softcapping=model["attention_softcap"],
        use_bidirectional_attention=False,
    )
    if generation == "gemma3_text":  # RoPE per kind of layer (transformers 4: rope_local_base_freq)
        local = model["rope_local_theta"]
        sliding = rope if local is None else {"rope_type": "default", "rope_theta": local}
        fields.update(rope_parameters={FULL: rope, SLIDING: sliding}, rope_local_base_freq=sliding["rope_theta"])
    return fields


def refuse_unrepresentable_gemma(hf: dict) -> None:
    """A Gemma config.json's settings loom cannot compute alike: bidirectional attention, an activation other than
    the tanh GELU."""
    # transformers 4 computes hidden_activation (Gemma: None means the tanh GELU), 5 hidden_act for Gemma (its
    # first files' "gelu" taken as the tanh GELU: GemmaConfig rewrites it); Gemma 2 and 3 compute
    # hidden_activation as named ("gelu" is the exact GELU there)
    gemma = hf.get("model_type") == "gemma"
    tanh = (None, "gelu_pytorch_tanh", "gelu") if gemma else ("gelu_pytorch_tanh",)
    for key in ("hidden_activation", "hidden_act") if gemma else ("hidden_activation",):
        if hf.get(key, "gelu_pytorch_tanh") not in tanh:  # absent: every class's default, the tanh GELU
            raise CheckpointError(
                f"config.json's {key} is {hf.get(key)!r}; loom's Gemma form gates the tanh GELU (gelu_pytorch_tanh)"
            )
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError("config.json sets use_bidirectional_attention (an encoder); loom's attention is causal")


def gemma_fields(hf: dict) -> dict:
    """The [model] fields that make a loom model the Gemma a config.json describes (the shape aside)."""
    kind = hf["model_type"]
    fields = {
        "activation": "geglu",
        "embedding_multiplier": gemma_embedding_multiplier(hf["hidden_size"]),
        "tie_embeddings": hf.get("tie_word_embeddings", True),  # Gemma's configs tie unless told
    }
    if kind == "gemma":
        return fields
    head_dim = hf.get("head_dim", 256)
    scalar = hf.get("query_pre_attn_scalar", 256)
    gemma2 = kind == "gemma2"  # Gemma2Config caps unless told, Gemma3TextConfig not

    def cap(key: str, default: float) -> float | None:
        value = hf.get(key, default if gemma2 else None)
        return None if value is None else float(value)

    fields.update(
        norm_placement="both",
        qk_norm=kind == "gemma3_text",
        attention_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        attention_softcap=cap("attn_logit_softcapping", 50.0),
        logits_softcap=cap("final_logit_softcapping", 30.0),
        **_window_fields(hf),
    )
    return fields


def _window_fields(hf: dict) -> dict:
    """sliding_window and full_attention_interval from layer_types (or, where a file has none, the every-Nth
    pattern its class assumes); a pattern loom's interval cannot say is refused."""
    layers = hf["num_hidden_layers"]
    interval = _DEFAULT_INTERVAL[hf["model_type"]]
    if hf["model_type"] == "gemma3_text":  # Gemma3TextConfig's older spelling; Gemma2Config always alternates
        interval = hf.get("sliding_window_pattern", interval)
        if type(interval) is not int or interval < 1:
            raise CheckpointError(f"config.json's sliding_window_pattern {interval!r} is not a number of layers")
    types = hf.get("layer_types") or [SLIDING if (i + 1) % interval else FULL for i in range(layers)]
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise CheckpointError(
            f"config.json's layer_types {types} is not one of {SLIDING} or {FULL} for each of its {layers} layers"
        )
    if SLIDING not in types:
        return {"sliding_window": None, "full_attention_interval": None, "rope_local_theta": None}
    window = hf.get("sliding_window", 4096)  # Gemma2Config's and Gemma3TextConfig's default
    if type(window) is not int or window < 1:
        raise CheckpointError(f"config.json's sliding_window {window!r} is not a number of tokens")
    if FULL not in types:
        return {"sliding_window": window, "full_attention_interval": None}
    interval = types.index(FULL) + 1
    if types != [SLIDING if (i + 1) % interval else FULL for i in range(layers)]:
        raise CheckpointError(
            f"config.json's layer_types attend fully in layers {[i for i, t in enumerate(types) if t == FULL]}; "
            "loom's model.full_attention_interval makes every N-th layer full (N, 2N, ... counting from 1)"
        )
    return {"sliding_window": window, "full_attention_interval": interval}


TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model."}
"""Where a Gemma 3 image-text model's files (Gemma3ForConditionalGeneration) keep its text model's tensors
(transformers 4's names, which 5 still writes; 5's own): the prefix of a Gemma3ForCausalLM's names in their place."""
TEXT_MODEL_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
"""Where they keep its output layer, when untied."""


def gemma3_text_config(hf: dict) -> dict:
    """The config.json of a Gemma 3 image-text model's text model (its text_config, a Gemma3ForCausalLM's, with
    Gemma3TextConfig's defaults), the tying of the output layer and the special tokens the whole model's where it
    says (the Hub's files keep eos_token_id [1, 106] there)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("config.json (model_type gemma3, an image-text Gemma 3) has no text_config object")
    if text.get("final_logit_softcapping") is not None:  # Gemma3ForConditionalGeneration never applies it
        raise CheckpointError(
            f"config.json's text_config sets final_logit_softcapping {text['final_logit_softcapping']}, which the "
            "image-text Gemma 3 does not apply and its text model does: which model it is, is unclear"
        )
    whole = {key: hf[key] for key in ("tie_word_embeddings", *_TOKEN_IDS) if key in hf}
    return with_class_defaults({**text, **whole, "model_type": "gemma3_text"})


def text_model_names(names: list[str]) -> tuple[dict[str, str], list[str]]:
    """A Gemma 3 image-text model's tensor names -> ({Gemma3ForCausalLM's name: the file's} for its text model,
    the names left out: the vision tower's and the projector's)."""
    kept, left = {}, []
    for name in names:
        prefix = next((p for p in TEXT_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            kept[TEXT_MODEL_PREFIXES[prefix] + name.removeprefix(prefix)] = name
        elif name in TEXT_MODEL_HEADS:
            kept["lm_head.weight"] = name
        else:
            left.append(name)
    return kept, left


def gemma3_rope(hf: dict) -> tuple[dict, float]:
    """Gemma 3's rotary settings: its full-attention layers' (scaled in its larger models: the 4B's linear x8) as one
    rope_parameters dict, and its sliding-window layers' base, from transformers 5's per-layer-type rope_parameters
    or transformers 4's rope_theta, rope_scaling and rope_local_base_freq (as Gemma3TextConfig reads them). Scaled
    sliding-window layers are refused (loom scales the full-attention ones alone)."""
    per_type = hf.get("rope_parameters")
    legacy = hf.get("rope_scaling")
    if not (isinstance(per_type, dict) and per_type and all(isinstance(v, dict) for v in per_type.values())):
        per_type = {}
    full = {**per_type.get(FULL, {}), **(legacy if isinstance(legacy, dict) else {})}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    sliding = dict(per_type.get(SLIDING, {}))
    kind = sliding.get("rope_type", sliding.get("type", "default"))
    if kind != "default":
        raise CheckpointError(
            f"config.json's {SLIDING} layers have {kind} RoPE; loom scales Gemma 3's {FULL} layers alone"
        )
    return full, float(sliding.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))

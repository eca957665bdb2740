"""Mixture-of-experts forms in Hugging Face's files (tools/hf_forms.py and tools/hf.py ask here): Mixtral
(MixtralForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM) and OLMoE (OlmoeForCausalLM) are Llamas whose every MLP is
model.num_experts SwiGLU experts behind a linear router (model.moe_top_k, model.moe_norm_top_k); Qwen3-MoE adds
Qwen3's per-head query/key norms, OLMoE norms over the whole query and key projections.

Their files name each expert's tensors apart (Mixtral: block_sparse_moe.experts.<e>.w1/w3/w2, the others:
mlp.experts.<e>.gate_proj/up_proj/down_proj, as transformers 5 still saves them though it computes stacked ones);
loom stacks them, the experts along a first dimension (mlp.experts.fc1.weight [experts, 2 x ffn, hidden], each
expert's gate rows then its up rows; mlp.experts.fc2.weight [experts, hidden, ffn])."""

from __future__ import annotations

from loom.engine.checkpoint.format import CheckpointError
from loom.engine.model import naming

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe")
"""config.json's model_type of each mixture-of-experts class import-hf reads."""

EXPERT = "{expert}"
"""Where an expert's index goes in its tensors' names (expert_names expands it)."""

MIXTRAL_IN_BLOCK = {
    naming.ROUTER_WEIGHT: ("block_sparse_moe.gate.weight",),
    naming.EXPERTS_FC1_WEIGHT: (
        f"block_sparse_moe.experts.{EXPERT}.w1.weight",
        f"block_sparse_moe.experts.{EXPERT}.w3.weight",
    ),
    naming.EXPERTS_FC2_WEIGHT: (f"block_sparse_moe.experts.{EXPERT}.w2.weight",),
}
QWEN_MOE_IN_BLOCK = {
    naming.ROUTER_WEIGHT: ("mlp.gate.weight",),
    naming.EXPERTS_FC1_WEIGHT: (f"mlp.experts.{EXPERT}.gate_proj.weight", f"mlp.experts.{EXPERT}.up_proj.weight"),
    naming.EXPERTS_FC2_WEIGHT: (f"mlp.experts.{EXPERT}.down_proj.weight",),
}
"""Qwen3-MoE's and OLMoE's names."""

_CLASS_DEFAULTS = {
    "mixtral": {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
    "qwen3_moe": {"num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    "olmoe": {"num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.01},
}
"""MixtralConfig's, Qwen3MoeConfig's and OlmoeConfig's defaults (transformers 5.24) for what a file leaves out."""


def expert_names(templates: tuple[str, ...], experts: int) -> tuple[str, ...]:
    """Every expert's names, expert by expert (expert 0's templates, then expert 1's, ...): stacked in this order,
    their rows make loom's tensor."""
    return tuple(template.replace(EXPERT, str(e)) for e in range(experts) for template in templates)


def moe_fields(hf: dict) -> dict:
    """A mixture-of-experts config.json's experts as loom's [model] fields."""
    kind = hf["model_type"]
    defaults = _CLASS_DEFAULTS[kind]
    experts = hf.get("num_local_experts") if kind == "mixtral" else hf.get("num_experts", hf.get("num_local_experts"))
    if type(experts) is not int or experts < 1:
        raise CheckpointError(f"config.json's number of experts is {experts!r}, not a positive number")
    return {
        "num_experts": experts,
        "moe_top_k": hf.get("num_experts_per_tok", defaults["num_experts_per_tok"]),
        "moe_norm_top_k": True if kind == "mixtral" else bool(hf.get("norm_topk_prob", defaults["norm_topk_prob"])),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])),
        "ffn_hidden_size": hf["moe_intermediate_size"] if kind == "qwen3_moe" else hf["intermediate_size"],
    }


def refuse_unrepresentable_moe(hf: dict) -> None:
    """A mixture-of-experts config.json's settings loom cannot compute alike: Qwen3-MoE's dense layers among the
    sparse ones, OLMoE's clipped QKV."""
    kind = hf["model_type"]
    if kind == "qwen3_moe" and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
        raise CheckpointError(
            f"config.json gives some layers a dense MLP (decoder_sparse_step {hf.get('decoder_sparse_step')}, "
            f"mlp_only_layers {hf.get('mlp_only_layers')}); every loom block of a mixture-of-experts model has experts"
        )
    if kind == "qwen3_moe" and hf.get("use_sliding_window"):
        raise CheckpointError("config.json sets use_sliding_window (over some of its layers); loom imports none")
    if kind == "olmoe" and hf.get("clip_qkv") is not None:
        raise CheckpointError(f"config.json clips q, k and v at {hf['clip_qkv']} (clip_qkv); loom does not clip them")
    if kind in ("qwen3_moe", "olmoe") and hf.get("attention_bias"):
        raise CheckpointError("config.json sets attention_bias: true; loom's mixture-of-experts form has no biases")


def moe_form_refusals(model: dict) -> dict:
    """What keeps a mixture-of-experts model (ModelConfig's fields) from exporting as Mixtral, Qwen3-MoE or OLMoE:
    {why: True}."""
    if model["num_experts"] is None:
        return {}
    unlike = {
        "an activation other than swiglu": model["activation"] != "swiglu",
        "qkv_bias": model["qkv_bias"],
        "norm_placement other than input": model["norm_placement"] != "input",
        "rotary_percent < 1": model["rotary_percent"] < 1,
        "moe_norm_top_k = false without query/key norms (Mixtral renormalises)": not model["moe_norm_top_k"]
        and not model["qk_norm"],
        "a sliding window with query/key norms (only Mixtral's windows export)": model["sliding_window"] is not None
        and model["qk_norm"],
        "a full_attention_interval": model["full_attention_interval"] is not None,
        "soft-capping": model["attention_softcap"] is not None or model["logits_softcap"] is not None,
        "multipliers or an attention_scale": model["attention_scale"] is not None
        or any(model[field] != 1.0 for field in ("embedding_multiplier", "residual_multiplier", "logits_divisor")),
    }
    return {f"experts with {why}": True for why, present in unlike.items() if present}


def moe_generation(model: dict) -> str:
    """The model_type a mixture-of-experts model exports as: qwen3_moe with per-head query/key norms, olmoe with
    norms over the whole projections, mixtral without."""
    if not model["qk_norm"]:
        return "mixtral"
    return "qwen3_moe" if model["qk_norm_per_head"] else "olmoe"


def moe_architecture(model: dict) -> dict:
    """The config.json fields of a mixture-of-experts model's class (hf_config writes the shape around them)."""
    generation = moe_generation(model)
    names = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
    fields = {
        "architectures": [names[generation]],
        "model_type": generation,
        "num_experts_per_tok": model["moe_top_k"],
        "router_aux_loss_coef": model["moe_aux_loss_coeff"],
        "output_router_logits": False,
    }
    if generation == "mixtral":
        return {**fields, "num_local_experts": model["num_experts"], "sliding_window": model["sliding_window"]}
    fields.update(num_experts=model["num_experts"], norm_topk_prob=model["moe_norm_top_k"], attention_bias=False)
    if generation == "olmoe":
        return {**fields, "clip_qkv": None}
    # every layer sparse, each expert model.ffn_hidden_size wide (intermediate_size: the dense layers', none here)
    return {**fields, "moe_intermediate_size": model["ffn_hidden_size"], "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False}  # fmt: skip

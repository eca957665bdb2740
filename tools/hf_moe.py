"""Mixture-of-experts forms in Hugging Face's files (tools/hf_forms.py and tools/hf.py ask here): Mixtral
(MixtralForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM), OLMoE (OlmoeForCausalLM), Qwen2-MoE (Qwen2MoeForCausalLM,
Qwen1.5-MoE's too) and MiniMax-M2 (MiniMaxM2ForCausalLM) are Llamas whose every MLP is model.num_experts SwiGLU experts
behind a linear router (model.moe_top_k, model.moe_norm_top_k); Qwen3-MoE adds Qwen3's per-head query/key norms, OLMoE
norms over the whole query and key projections, Qwen2-MoE Qwen2's q/k/v biases and a gated shared expert
(model.moe_shared_ffn_hidden_size, model.moe_shared_expert_gate), MiniMax-M2 OLMoE's norms, a rotary embedding over
part of each head (model.rotary_percent) and DeepSeek-V3's routing: sigmoid scores and a routing bias per expert
(model.moe_router_score, model.moe_expert_bias; e_score_correction_bias, a buffer loom keeps as buffer/<name>).
GLM-4.5 (Glm4MoeForCausalLM) routes so too, in fp32 (model.moe_router_fp32), within groups of experts
(model.moe_router_groups), its weights scaled (model.moe_router_scale), its first blocks dense
(model.moe_dense_layers; the experts model.moe_ffn_hidden_size wide) and an ungated shared expert in the others,
with Qwen2's q/k/v biases, optional per-head query/key norms and half of each head rotated. The Qwen MoEs' first
blocks may be dense too (mlp_only_layers [0, ..., N - 1]).

Their files name each expert's tensors apart (Mixtral: block_sparse_moe.experts.<e>.w1/w3/w2, the others:
mlp.experts.<e>.gate_proj/up_proj/down_proj, as transformers 5 still saves them though it computes stacked ones);
loom stacks them, the experts along a first dimension (mlp.experts.fc1.weight [experts, 2 x ffn, hidden], each
expert's gate rows then its up rows; mlp.experts.fc2.weight [experts, hidden, ffn])."""

from __future__ import annotations

import sys

from loom.engine.checkpoint.format import CheckpointError
from loom.engine.model import naming

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "minimax_m2", "glm4_moe")
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
MINIMAX_M2_IN_BLOCK = {**MIXTRAL_IN_BLOCK, naming.EXPERT_BIAS: ("block_sparse_moe.e_score_correction_bias",)}
"""MiniMax-M2's names: Mixtral's, with each block's experts' routing biases."""
QWEN_MOE_IN_BLOCK = {
    naming.ROUTER_WEIGHT: ("mlp.gate.weight",),
    naming.EXPERTS_FC1_WEIGHT: (f"mlp.experts.{EXPERT}.gate_proj.weight", f"mlp.experts.{EXPERT}.up_proj.weight"),
    naming.EXPERTS_FC2_WEIGHT: (f"mlp.experts.{EXPERT}.down_proj.weight",),
}
"""Qwen3-MoE's and OLMoE's names."""
QWEN2_MOE_IN_BLOCK = {
    **QWEN_MOE_IN_BLOCK,
    naming.SHARED_EXPERT_FC1_WEIGHT: ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    naming.SHARED_EXPERT_FC2_WEIGHT: ("mlp.shared_expert.down_proj.weight",),
    naming.SHARED_EXPERT_GATE_WEIGHT: ("mlp.shared_expert_gate.weight",),
}
GLM4_MOE_IN_BLOCK = {
    **QWEN_MOE_IN_BLOCK,
    naming.SHARED_EXPERT_FC1_WEIGHT: ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    naming.SHARED_EXPERT_FC2_WEIGHT: ("mlp.shared_experts.down_proj.weight",),
    naming.EXPERT_BIAS: ("mlp.gate.e_score_correction_bias",),
}
"""GLM-4.5's names in its expert blocks: Qwen-MoE's, an ungated shared expert and the experts' routing biases."""
FUSED_EXPERTS_IN_BLOCK = {
    naming.ROUTER_WEIGHT: ("mlp.gate.weight",),
    naming.EXPERTS_FC1_WEIGHT: ("mlp.experts.gate_up_proj",),
    naming.EXPERTS_FC2_WEIGHT: ("mlp.experts.down_proj",),
}
"""The classes' names in transformers 5's own layout (save_pretrained(save_original_format=False), or a PEFT
model's save): every expert's tensors already stacked as loom stacks them (gate_up_proj's rows each expert's gate,
then its up projection)."""

_CLASS_DEFAULTS = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "rope_theta": 1e6},
    "qwen3_moe": {
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
        "moe_intermediate_size": 768,
    },
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "router_aux_loss_coef": 0.01},
    "glm4_moe": {
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "use_qk_norm": False,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
    },
    "minimax_m2": {
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "router_aux_loss_coef": 0.001,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5e6,
    },
    "qwen2_moe": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
}
"""MixtralConfig's, Qwen3MoeConfig's, OlmoeConfig's, Qwen2MoeConfig's and MiniMaxM2Config's defaults (transformers
5.24) for what a file leaves out."""

_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def fused_expert_names(model: dict) -> dict[str, tuple[str, ...]]:
    """FUSED_EXPERTS_IN_BLOCK for this model: MiniMax-M2's routing biases are mlp.e_score_correction_bias there
    (GLM-4.5's stay mlp.gate.e_score_correction_bias)."""
    if moe_generation(model) == "minimax_m2":
        return {**FUSED_EXPERTS_IN_BLOCK, naming.EXPERT_BIAS: ("mlp.e_score_correction_bias",)}
    return FUSED_EXPERTS_IN_BLOCK


def kept_in_fp32(model: dict) -> tuple[str, ...]:
    """loom's tensors inside a block that an export writes in fp32 whatever its dtype: GLM-4.5's router and routing
    biases (Glm4MoeForCausalLM keeps them so, as its files do), MiniMax-M2's biases (bf16 would move them by a
    few thousandths, enough to change a token's experts)."""
    if model["num_experts"] is None or model.get("moe_router_score") != "sigmoid":
        return ()
    return (naming.ROUTER_WEIGHT, naming.EXPERT_BIAS) if moe_generation(model) == "glm4_moe" else (naming.EXPERT_BIAS,)


def with_moe_class_defaults(hf: dict) -> dict:
    """A mixture-of-experts config.json with its class's defaults where it says nothing (other configs as they
    are)."""
    kind = hf.get("model_type")
    return {**_CLASS_DEFAULTS[kind], **hf} if kind in _CLASS_DEFAULTS else hf


def _experts_in_file(hf: dict) -> object:
    """The number of experts, under either of its names (each class maps one onto the other)."""
    first, second = (
        ("num_experts", "num_local_experts") if hf["model_type"] == "olmoe" else ("num_local_experts", "num_experts")
    )
    if hf["model_type"] == "glm4_moe":
        first = "n_routed_experts"
    return hf.get(first) if hf.get(first) is not None else hf.get(second)


def expert_names(templates: tuple[str, ...], experts: int) -> tuple[str, ...]:
    """Every expert's names, expert by expert (expert 0's templates, then expert 1's, ...): stacked in this order,
    their rows make loom's tensor. Names without an expert's index (FUSED_EXPERTS_IN_BLOCK) are every expert's."""
    if not any(EXPERT in template for template in templates):
        return templates
    return tuple(template.replace(EXPERT, str(e)) for e in range(experts) for template in templates)


def moe_fields(hf: dict) -> dict:
    """A mixture-of-experts config.json's experts as loom's [model] fields (`hf` with its class's defaults:
    with_moe_class_defaults). transformers' load-balancing loss is about top_k when the load is even and weighs
    all layers with experts together, loom's 1 a block summed over the blocks: its router_aux_loss_coef is taken x
    top_k / those layers, the same pull on the router (export converts it back)."""
    kind, experts, top_k = hf["model_type"], _experts_in_file(hf), hf["num_experts_per_tok"]
    shared = hf.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    numbers = (("number of experts", experts), ("num_experts_per_tok", top_k))
    for name, value in numbers + ((("shared_expert_intermediate_size", shared),) if kind == "qwen2_moe" else ()):
        if type(value) is not int or value < 1:
            raise CheckpointError(f"config.json's {name} is {value!r}, not a positive number")
    qwen = kind in ("qwen3_moe", "qwen2_moe")
    dense = len(hf.get("mlp_only_layers") or ()) if qwen else 0  # the first blocks (refuse_unrepresentable_moe)
    fields = {
        "num_experts": experts,
        "moe_top_k": top_k,
        "moe_norm_top_k": True if kind in ("mixtral", "minimax_m2") else bool(hf["norm_topk_prob"]),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0)) * top_k / (hf["num_hidden_layers"] - dense),
        "ffn_hidden_size": hf["moe_intermediate_size"] if qwen and not dense else hf["intermediate_size"],
    }
    if dense:  # Qwen's dense MLPs intermediate_size wide, its experts moe_intermediate_size
        fields.update(moe_dense_layers=dense, moe_ffn_hidden_size=hf["moe_intermediate_size"])
    if kind == "minimax_m2":  # sigmoid scores with a routing bias per expert, as DeepSeek-V3's (always, in its class)
        fields.update(moe_router_score="sigmoid", moe_expert_bias=True)
    if kind == "glm4_moe":  # DeepSeek-V3's routing and its blocks: the first dense, an ungated shared expert in each
        fields.update(_glm4_moe_fields(hf))
    if kind == "qwen2_moe":  # Qwen2's attention, biased q, k and v (transformers 5 lets a file say otherwise)
        fields.update(moe_shared_ffn_hidden_size=shared, moe_shared_expert_gate=True, qkv_bias=hf.get("qkv_bias", True))
    return fields


def _glm4_moe_fields(hf: dict) -> dict:
    """GLM-4.5's: sigmoid scores with routing biases, scaled weights, its first blocks dense (intermediate_size
    wide) and experts moe_intermediate_size wide beside a shared expert n_shared_experts of them wide; it trains
    without a load-balancing loss (its class computes none)."""
    width, shared, dense = hf["moe_intermediate_size"], hf["n_shared_experts"], hf["first_k_dense_replace"]
    for name, value in (("moe_intermediate_size", width), ("n_shared_experts", shared)):
        if type(value) is not int or value < 1:
            raise CheckpointError(f"config.json's {name} is {value!r}, not a positive number")
    if type(dense) is not int or not 0 <= dense < hf["num_hidden_layers"]:
        raise CheckpointError(f"config.json's first_k_dense_replace is {dense!r}: not a number of its first layers")
    groups, chosen = hf["n_group"], hf["topk_group"]
    if chosen == groups:  # every group kept: routing among all experts
        groups, chosen = 1, None
    return {
        "moe_router_groups": groups,
        "moe_router_group_top_k": chosen,
        "moe_router_fp32": True,  # its router's GEMM and scores in fp32
        "moe_router_score": "sigmoid",
        "moe_expert_bias": True,
        "moe_router_scale": float(hf["routed_scaling_factor"]),
        "moe_aux_loss_coeff": 0.0,
        "ffn_hidden_size": hf["intermediate_size"],
        "moe_ffn_hidden_size": width,
        "moe_dense_layers": dense,
        "moe_shared_ffn_hidden_size": width * shared,
        "qkv_bias": bool(hf.get("attention_bias", False)),
    }


def refuse_unrepresentable_moe(hf: dict) -> None:
    """A mixture-of-experts config.json's settings loom cannot compute alike: the Qwen MoEs' dense layers among the
    sparse ones and sliding windows, OLMoE's clipped QKV."""
    kind = hf["model_type"]
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    first = isinstance(dense, list) and dense == list(range(len(dense))) and len(dense) < hf["num_hidden_layers"]
    if kind in ("qwen3_moe", "qwen2_moe") and (step != 1 or not first):
        said = ", ".join([f"decoder_sparse_step {step}"] * (step != 1) + [f"mlp_only_layers {dense}"] * (not first))
        raise CheckpointError(
            f"config.json gives some layers a dense MLP ({said}); loom's dense blocks among experts are the first ones "
            "(model.moe_dense_layers: mlp_only_layers [0, 1, ..., N - 1], decoder_sparse_step 1)"
        )
    if kind == "glm4_moe":
        groups, chosen = hf["n_group"], hf["topk_group"]
        for name, value in (("n_group", groups), ("topk_group", chosen)):
            if type(value) is not int or value < 1:
                raise CheckpointError(f"config.json's {name} is {value!r}, not a positive number")
        if chosen < groups and hf["num_experts_per_tok"] // chosen != 2:
            raise CheckpointError(
                f"config.json routes each token within {chosen} of {groups} expert groups, each scored by its top 2 "
                f"experts (Glm4MoeForCausalLM's); loom's groups, as Megatron's, by their top num_experts_per_tok / "
                f"topk_group = {hf['num_experts_per_tok'] // chosen}"
            )
    if kind in ("qwen3_moe", "qwen2_moe") and hf.get("use_sliding_window"):
        raise CheckpointError("config.json sets use_sliding_window; loom's Qwen-MoE imports take no sliding window")
    if kind == "olmoe" and hf.get("clip_qkv") is not None:
        raise CheckpointError(f"config.json clips q, k and v at {hf['clip_qkv']} (clip_qkv); loom does not clip them")
    if jitter := hf.get("router_jitter_noise"):  # training's alone: the model computes alike without it
        print(
            f"note: config.json's router_jitter_noise {jitter} (noise on the router's input while training) is left "
            "out: loom's router takes none; the model computes as its class does in evaluation",
            file=sys.stderr,
        )


def moe_form_refusals(model: dict) -> dict:
    """What keeps a mixture-of-experts model (ModelConfig's fields) from exporting as Mixtral, Qwen3-MoE, OLMoE,
    Qwen2-MoE, MiniMax-M2 or GLM-4.5: {why: True}."""
    if model["num_experts"] is None:
        return {}
    olmoe = model["qk_norm"] and not model["qk_norm_per_head"]
    shared = model["moe_shared_ffn_hidden_size"] is not None
    sigmoid = model.get("moe_router_score", "softmax") == "sigmoid"
    generation = moe_generation(model)
    minimax, glm = generation == "minimax_m2", generation == "glm4_moe"
    qwen = generation in ("qwen3_moe", "qwen2_moe")
    gate, groups = model["moe_shared_expert_gate"], model.get("moe_router_groups", 1)
    group_top_k = model.get("moe_router_group_top_k") or groups
    expert_width = model.get("moe_ffn_hidden_size") or model["ffn_hidden_size"]
    unlike = {
        "an activation other than swiglu": model["activation"] != "swiglu",
        # Qwen2-MoE's shared expert is gated, beside q, k and v biases and no query/key norms; GLM-4.5's is neither
        "a shared expert without its gate (Qwen2-MoE's)": shared and not gate and not glm,
        "a shared expert without q/k/v biases (Qwen2-MoE's attention has them)": shared
        and not model["qkv_bias"]
        and not glm,
        "a shared expert with query/key norms": shared and model["qk_norm"] and not glm,
        # OlmoeAttention sizes its query/key norms from hidden_size, whatever the heads' width
        "query/key norms across heads and heads other than hidden_size / num_heads wide": olmoe
        and not minimax
        and model["head_dim"] * model["num_heads"] != model["hidden_size"],
        "rope_local_theta (Gemma 3's)": model["rope_local_theta"] is not None and model["sliding_window"] is not None,
        "qkv_bias without a shared expert (only Qwen2-MoE and GLM-4.5 bias q, k and v)": model["qkv_bias"]
        and not shared,
        "norm_placement other than input": model["norm_placement"] != "input",
        "rotary_percent < 1 (only MiniMax-M2's and GLM-4.5's turn part of each head)": model["rotary_percent"] < 1
        and not sigmoid,
        "moe_norm_top_k = false without query/key norms or a shared expert (Mixtral renormalises)": not model[
            "moe_norm_top_k"
        ]
        and generation == "mixtral",
        "a sliding window (only Mixtral's export)": model["sliding_window"] is not None and generation != "mixtral",
        "a full_attention_interval": model["full_attention_interval"] is not None,
        "soft-capping": model["attention_softcap"] is not None or model["logits_softcap"] is not None,
        "multipliers or an attention_scale": model["attention_scale"] is not None
        or any(model[field] != 1.0 for field in ("embedding_multiplier", "residual_multiplier", "logits_divisor")),
        # the classes with sigmoid scores: MiniMax-M2 (query/key norms across heads, every block with experts, no
        # shared one) and GLM-4.5 (an ungated shared expert a whole number of experts wide); both bias the scores
        "sigmoid router scores without experts' biases (MiniMax-M2's and GLM-4.5's have them)": sigmoid
        and not model.get("moe_expert_bias", False),
        "sigmoid router scores without moe_norm_top_k (MiniMax-M2 renormalises)": minimax
        and not model["moe_norm_top_k"],
        "sigmoid router scores without a shared expert (GLM-4.5's has one)": glm and not shared,
        "a gated shared expert (GLM-4.5's has no gate)": glm and gate,
        "a shared expert other than a whole number of experts wide (GLM-4.5's n_shared_experts)": glm
        and shared
        and model["moe_shared_ffn_hidden_size"] % expert_width != 0,
        "a moe_router_scale": model.get("moe_router_scale", 1.0) != 1.0 and not glm,
        "dense blocks among them (moe_dense_layers; GLM-4.5's and Qwen-MoE's have them)": model.get(
            "moe_dense_layers", 0
        )
        > 0
        and not (glm or qwen),
        "a moe_ffn_hidden_size": model.get("moe_ffn_hidden_size") not in (None, model["ffn_hidden_size"])
        and not (glm or qwen),
        "experts' biases without sigmoid scores": model.get("moe_expert_bias", False) and not sigmoid,
        "group-limited routing (only GLM-4.5's)": groups > group_top_k and not glm,
        # Glm4MoeForCausalLM scores a group by its top 2 experts, loom by its top top_k / group_top_k
        "groups scored by other than their top 2 experts (GLM-4.5's)": groups > group_top_k
        and model["moe_top_k"] // group_top_k != 2,
    }
    return {f"experts with {why}": True for why, present in unlike.items() if present}


def moe_generation(model: dict) -> str:
    """The model_type a mixture-of-experts model exports as: with sigmoid scores minimax_m2 (query/key norms across
    heads) or glm4_moe; else qwen2_moe with a shared expert, qwen3_moe with per-head query/key norms, olmoe with norms
    over the whole projections, mixtral without."""
    if model.get("moe_router_score", "softmax") == "sigmoid":
        return "minimax_m2" if model["qk_norm"] and not model["qk_norm_per_head"] else "glm4_moe"
    if model["moe_shared_ffn_hidden_size"] is not None:
        return "qwen2_moe"
    if not model["qk_norm"]:
        return "mixtral"
    return "qwen3_moe" if model["qk_norm_per_head"] else "olmoe"


def _glm_groups(model: dict) -> dict:
    """GLM-4.5's n_group and topk_group: 1 and 1 unless groups limit the choice (transformers' top-2 group score
    fails on groups of one expert, which keeping every group does not need)."""
    groups, chosen = model.get("moe_router_groups", 1), model.get("moe_router_group_top_k")
    limited = chosen is not None and chosen < groups
    return {"n_group": groups, "topk_group": chosen} if limited else {"n_group": 1, "topk_group": 1}


def moe_architecture(model: dict) -> dict:
    """The config.json fields of a mixture-of-experts model's class (hf_config writes the shape around them)."""
    generation = moe_generation(model)
    names = {
        "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "minimax_m2": "MiniMaxM2ForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
    }
    expert_blocks = model["num_layers"] - model.get("moe_dense_layers", 0)
    coefficient = model["moe_aux_loss_coeff"] * expert_blocks / model["moe_top_k"]  # moe_fields' inverse
    fields = {
        "architectures": [names[generation]],
        "model_type": generation,
        "num_experts_per_tok": model["moe_top_k"],
        "router_aux_loss_coef": float(f"{coefficient:.12g}"),
        "output_router_logits": False,
    }
    if generation == "mixtral":
        return {**fields, "num_local_experts": model["num_experts"], "sliding_window": model["sliding_window"]}
    if generation == "minimax_m2":  # rotary_dim and the rest for the original code's readers (vLLM's too)
        rotary = round(model["rotary_percent"] * model["head_dim"])
        return {**fields, "num_local_experts": model["num_experts"], "partial_rotary_factor": model["rotary_percent"],
                "rotary_dim": rotary, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                "use_routing_bias": True, **dict.fromkeys(_TOKEN_ID_FIELDS)}  # fmt: skip
    if generation == "glm4_moe":  # intermediate_size: the dense blocks' (hf_config's); GLM's token ids unknown
        width = model.get("moe_ffn_hidden_size") or model["ffn_hidden_size"]
        return {**fields, "n_routed_experts": model["num_experts"], "moe_intermediate_size": width,
                "n_shared_experts": model["moe_shared_ffn_hidden_size"] // width,
                "routed_scaling_factor": model["moe_router_scale"], **_glm_groups(model),
                "first_k_dense_replace": model["moe_dense_layers"], "norm_topk_prob": model["moe_norm_top_k"],
                "use_qk_norm": model["qk_norm"], "attention_bias": model["qkv_bias"],
                "partial_rotary_factor": model["rotary_percent"], **dict.fromkeys(_TOKEN_ID_FIELDS)}  # fmt: skip
    fields.update(num_experts=model["num_experts"], norm_topk_prob=model["moe_norm_top_k"], attention_bias=False)
    if generation == "olmoe":  # OlmoeConfig's token ids default to OLMo's own (pad 1): none unless known
        return {**fields, "clip_qkv": None, **dict.fromkeys(_TOKEN_ID_FIELDS)}
    # the first model.moe_dense_layers dense (intermediate_size wide: hf_config's), the others sparse
    width = model.get("moe_ffn_hidden_size") or model["ffn_hidden_size"]
    fields.update(moe_intermediate_size=width, decoder_sparse_step=1,
                  mlp_only_layers=list(range(model.get("moe_dense_layers", 0))), use_sliding_window=False)  # fmt: skip
    if generation == "qwen2_moe":
        fields.update(shared_expert_intermediate_size=model["moe_shared_ffn_hidden_size"], qkv_bias=True)
    return fields

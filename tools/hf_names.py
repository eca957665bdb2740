"""Hugging Face's tensor names for loom's (the Llama family's, Phi-3's, OLMo 2's, Nemotron's, Gemma's and the
mixtures of experts'): the one place that knows them. to_hf splits loom's fused tensors (QKV -> q_proj, k_proj,
v_proj; SwiGLU fc1 -> gate_proj, up_proj; stacked experts -> each expert's) and from_hf joins them, each tensor made
when asked for; tools/hf.py writes and reads the files.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loom.engine.checkpoint.format import CheckpointError
from loom.engine.model import naming
from loom.tools.ckpt import LazyWeights, first_few
from loom.tools.hf_forms import nemotron_form
from loom.tools.hf_gemma import gemma_form
from loom.tools.hf_moe import (
    FUSED_EXPERTS_IN_BLOCK,
    GLM4_MOE_IN_BLOCK,
    MINIMAX_M2_IN_BLOCK,
    MIXTRAL_IN_BLOCK,
    QWEN2_MOE_IN_BLOCK,
    QWEN_MOE_IN_BLOCK,
    expert_names,
    fused_expert_names,
    moe_generation,
)

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


def names_in_block(model: dict, phi3: bool) -> dict[str, tuple[str, ...]]:
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


def stored_minus_one(name: str, model: dict) -> bool:
    """Whether Hugging Face's file holds loom's tensor `name` minus one: a Nemotron's LayerNorm1P scales by 1 + its
    block and final norms' weights, a Gemma's RMSNorm by 1 + every norm's (its query/key norms' too)."""
    if name == naming.FINAL_NORM_WEIGHT:
        return nemotron_form(model) or gemma_form(model)
    if nemotron_form(model):
        return name.endswith(_BLOCK_NORM_WEIGHTS)
    return gemma_form(model) and name.endswith(_GEMMA_NORM_WEIGHTS)


def fused_sizes(model: dict) -> dict[str, list[int]]:
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


def hf_names_of(name: str, block_names: dict[str, tuple[str, ...]], experts: int | None) -> tuple[str, ...]:
    """Hugging Face's tensor(s) holding loom's tensor `name` (`block_names`: names_in_block's table; `experts`:
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
    sizes, block_names = fused_sizes(model), names_in_block(model, phi3)
    shapes, part_of = {}, {}
    for name in _loom_names(model):
        hf_names, shape = hf_names_of(name, block_names, model["num_experts"]), logical.shapes[name]
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
    shapes, parts_of, used, block_names = {}, {}, set(), names_in_block(model, phi3)
    first_experts = model.get("moe_dense_layers", 0) if model["num_experts"] is not None else 0
    if f"model.layers.{first_experts}.{FUSED_EXPERTS_IN_BLOCK[naming.EXPERTS_FC1_WEIGHT][0]}" in tensors.shapes:
        block_names = {**block_names, **fused_expert_names(model)}  # transformers 5's own layout: stacked already
    for name in _loom_names(model):
        hf_names = parts_of[name] = hf_names_of(name, block_names, model["num_experts"])
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
        if stored_minus_one(name, model):
            return parts[0].float() + 1
        return parts[0] if len(parts) == 1 else torch.cat(parts).view(shapes[name])

    return LazyWeights(shapes, make)

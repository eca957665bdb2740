"""Hugging Face interchange for GPT-2-shaped models (LayerNorm, GELU, learned positions, biases, multi-head
attention: the gpt-125m preset's shape): a loom checkpoint <-> GPT2LMHeadModel's safetensors + config.json.

The one place that knows GPT-2's names (tools/hf.py holds Llama's and the commands). GPT-2's linear layers are
transformers' Conv1D, whose weight is [in, out]: loom's [out, in] weights go out transposed and come back so. Its
fused c_attn holds all queries, then keys, then values, as loom's QKV does; its GELU is the tanh approximation
(gelu_new), as loom's is; its three dropout rates (embedding, residual, attention) are loom's one model.dropout.
What loom cannot compute the same way (the exact GELU, attention scaled by the layer index, cross-attention) is
refused with one line on import.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loom.engine.checkpoint.format import CheckpointError
from loom.engine.model import naming
from loom.tools.ckpt import LazyWeights, first_few

GPT2_SHAPE = {
    "norm": "layernorm",
    "activation": "gelu",
    "position_embedding": "learned",
    "bias": True,
    "qk_norm": False,
    "norm_placement": "input",
    "sliding_window": None,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_scale": None,
    "logits_divisor": 1.0,
    "attention_softcap": None,
    "logits_softcap": None,
    "num_experts": None,
}
"""The ModelConfig fields of a model with a GPT-2 form (grouped-query attention aside): GPT2LMHeadModel attends to
every earlier position, scales nothing but its scores, by 1 / sqrt(head_dim), and caps neither them nor its
logits."""

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""transformers' names of GELU's tanh approximation (three implementations of one formula), which loom computes."""

_OUTSIDE_BLOCKS = {
    naming.EMBEDDING: "transformer.wte.weight",
    naming.POSITION_EMBEDDING: "transformer.wpe.weight",
    naming.FINAL_NORM_WEIGHT: "transformer.ln_f.weight",
    "final_norm.bias": "transformer.ln_f.bias",
    naming.OUTPUT: "lm_head.weight",
}
# loom's name inside a block (without .weight/.bias) -> GPT-2's, and whether its weight is a Conv1D's ([in, out])
_IN_BLOCK = {
    "input_norm": ("ln_1", False),
    "attention.qkv": ("attn.c_attn", True),
    "attention.proj": ("attn.c_proj", True),
    "mlp_norm": ("ln_2", False),
    "mlp.fc1": ("mlp.c_fc", True),
    "mlp.fc2": ("mlp.c_proj", True),
}
# Buffers older GPT-2 files hold beside the weights: the causal mask, recomputed by transformers
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def has_gpt2_form(model: dict) -> bool:
    """Whether the loom model (ModelConfig's fields) is GPT-2-shaped."""
    heads = model["num_heads"]
    return (
        all(model[k] == v for k, v in GPT2_SHAPE.items())
        and model["num_kv_heads"] == heads
        and model["head_dim"] * heads == model["hidden_size"]  # GPT-2 has no head width of its own
    )


def gpt2_config(model: dict, token_ids: dict, dtype: str) -> dict:
    """The config.json transformers reads for a GPT-2-shaped loom model (`token_ids`: the special-token ids)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model["vocab_size"],
        "n_positions": model["max_position_embeddings"],
        "n_embd": model["hidden_size"],
        "n_layer": model["num_layers"],
        "n_head": model["num_heads"],
        "n_inner": model["ffn_hidden_size"],
        "activation_function": "gelu_new",
        "layer_norm_epsilon": model["norm_eps"],
        "embd_pdrop": model["dropout"],
        "resid_pdrop": model["dropout"],
        "attn_pdrop": model["dropout"],
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": model["tie_embeddings"],
        "initializer_range": model["init_std"],
        "torch_dtype": dtype,
        **token_ids,
    }


def model_from_gpt2_config(hf: dict) -> dict:
    """loom's [model] for a GPT-2 config.json; CheckpointError for a setting loom computes otherwise."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in TANH_GELUS:
        raise CheckpointError(
            f"config.json's activation_function is {activation!r}; loom's GPT-2 form computes GELU's tanh "
            f"approximation ({', '.join(TANH_GELUS)})"
        )
    for flag, loom_value, what in (
        ("scale_attn_weights", True, "attention scores scaled by 1/sqrt(head size)"),
        ("scale_attn_by_inverse_layer_idx", False, "no scaling by the layer's index"),
        ("add_cross_attention", False, "no cross-attention"),
    ):
        if hf.get(flag, loom_value) != loom_value:
            raise CheckpointError(f"config.json sets {flag}: {hf[flag]}; loom's GPT-2 form has {what}")
    hidden = hf["n_embd"]
    return {
        "num_layers": hf["n_layer"],
        "hidden_size": hidden,
        "num_heads": hf["n_head"],
        "num_kv_heads": hf["n_head"],
        "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["n_positions"],
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
        **GPT2_SHAPE,
    }


def _loom_names(model: dict) -> list[str]:
    outside = [naming.EMBEDDING, naming.POSITION_EMBEDDING, naming.FINAL_NORM_WEIGHT, "final_norm.bias"]
    outside += [] if model["tie_embeddings"] else [naming.OUTPUT]
    leaves = [f"{owner}.{leaf}" for owner in _IN_BLOCK for leaf in ("weight", "bias")]
    return outside + [naming.block_param_name(i, local) for i in range(model["num_layers"]) for local in leaves]


def _gpt2_name(name: str) -> tuple[str, bool]:
    """GPT-2's tensor (under GPT2LMHeadModel's transformer.) holding loom's `name`, and whether it is transposed."""
    in_block = naming.split_block_param_name(name)
    if in_block is None:
        return _OUTSIDE_BLOCKS[name], False
    layer, local = in_block
    owner, _, leaf = local.rpartition(".")
    gpt2, conv1d = _IN_BLOCK[owner]
    return f"transformer.h.{layer}.{gpt2}.{leaf}", conv1d and leaf == "weight"


def gpt2_module(weight: str) -> str:
    """The GPT2LMHeadModel module (transformer.h.<i>.attn.c_attn, ...) holding loom's linear weight `weight`."""
    return _gpt2_name(weight)[0].removesuffix(".weight")


def to_gpt2(logical: Mapping[str, torch.Tensor], model: dict) -> LazyWeights:
    """loom logical tensors -> GPT2LMHeadModel's state dict, each tensor made when asked for."""
    logical = LazyWeights.of(logical)
    loom_of, shapes = {}, {}
    for name in _loom_names(model):
        gpt2, transposed = _gpt2_name(name)
        loom_of[gpt2] = (name, transposed)
        shape = logical.shapes[name]
        shapes[gpt2] = tuple(reversed(shape)) if transposed else shape

    def make(gpt2: str) -> torch.Tensor:
        name, transposed = loom_of[gpt2]
        return logical[name].t().contiguous() if transposed else logical[name]

    return LazyWeights(shapes, make)


def from_gpt2(tensors: Mapping[str, torch.Tensor], model: dict) -> LazyWeights:
    """A GPT-2 state dict (GPT2LMHeadModel's, or the bare GPT2Model's names the original gpt2 files use) -> loom
    logical tensors, each made when asked for."""
    tensors = LazyWeights.of(tensors)
    prefix = "" if "wte.weight" in tensors.shapes else "transformer."
    where, shapes = {}, {}
    for name in _loom_names(model):
        gpt2, transposed = _gpt2_name(name)
        key = gpt2 if gpt2 == "lm_head.weight" else prefix + gpt2.removeprefix("transformer.")
        if key not in tensors.shapes:
            raise CheckpointError(f"the model has no tensor {key!r}; is it a GPT-2 model?")
        where[name] = (key, transposed)
        shape = tensors.shapes[key]
        shapes[name] = tuple(reversed(shape)) if transposed else shape
    used = {key for key, _ in where.values()}
    ignorable = {"lm_head.weight"} if model["tie_embeddings"] else set()
    unused = sorted(k for k in tensors.shapes if k not in used | ignorable and not k.endswith(_MASK_BUFFERS))
    if unused:
        raise CheckpointError(
            f"the model has tensors its config.json does not describe ({first_few(unused)}); the config and the "
            "weights disagree (n_layer?), and importing would drop them"
        )

    def make(name: str) -> torch.Tensor:
        key, transposed = where[name]
        return tensors[key].t().contiguous() if transposed else tensors[key]

    return LazyWeights(shapes, make)


def embedding_key(tensors: Mapping[str, torch.Tensor]) -> str:
    """Where a GPT-2 file keeps the token embedding."""
    return "wte.weight" if "wte.weight" in tensors else "transformer.wte.weight"

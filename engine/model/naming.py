"""The grammar of loom's parameter names, the one place that builds and parses them.

A parameter's global name is its path in a single-chunk GPTModel, the same in every layout because
pipeline chunks hold blocks by global index:

    embedding.weight                  token embedding (first stage)
    position_embedding                learned positions (first stage, position_embedding = "learned")
    layers.<i>.<local>                block i's parameters, <local> e.g. attention.qkv.weight
    final_norm.weight / .bias         final norm (last stage)
    output_weight                     output layer, when not tied to the embedding (last stage)
    layers.<i>.<layer>.adapter.lora_a / lora_b   LoRA factors A and B of a linear layer's weight

The last stage's copy of a tied embedding is named `embedding.weight`, like the first stage's.
GPTModel records each parameter's name in its ParamInfo (initialisation seeds and checkpoint keys use
it); the optimizer (weight decay, layer-wise LR decay), `loom ckpt reshard` and the Hugging Face
mapping parse names through this module.
"""

from __future__ import annotations

LAYERS = "layers"
EMBEDDING = "embedding.weight"
POSITION_EMBEDDING = "position_embedding"
FINAL_NORM_WEIGHT = "final_norm.weight"
FINAL_NORM_BIAS = "final_norm.bias"
OUTPUT = "output_weight"

# Names inside a block (transformer.py's module attributes).
INPUT_NORM_WEIGHT = "input_norm.weight"
INPUT_NORM_BIAS = "input_norm.bias"
QKV_WEIGHT = "attention.qkv.weight"
QKV_BIAS = "attention.qkv.bias"
Q_NORM_WEIGHT = "attention.q_norm.weight"
K_NORM_WEIGHT = "attention.k_norm.weight"
ATTENTION_OUTPUT_WEIGHT = "attention.proj.weight"
MLP_NORM_WEIGHT = "mlp_norm.weight"
MLP_NORM_BIAS = "mlp_norm.bias"
FC1_WEIGHT = "mlp.fc1.weight"
# model.norm_placement = both (Gemma's sandwich): the norms on what attention and the MLP return
ATTENTION_OUTPUT_NORM_WEIGHT = "attention_output_norm.weight"
ATTENTION_OUTPUT_NORM_BIAS = "attention_output_norm.bias"
MLP_OUTPUT_NORM_WEIGHT = "mlp_output_norm.weight"
MLP_OUTPUT_NORM_BIAS = "mlp_output_norm.bias"
FC2_WEIGHT = "mlp.fc2.weight"
# model.num_experts (engine/model/moe.py): the router, and every expert's FC1 and FC2 stacked along a first dimension
ROUTER_WEIGHT = "mlp.router.weight"
EXPERTS_FC1_WEIGHT = "mlp.experts.fc1.weight"
EXPERTS_FC2_WEIGHT = "mlp.experts.fc2.weight"
# model.moe_expert_bias: each expert's routing bias, a buffer (checkpoints' buffer/<name>), not a parameter
EXPERT_BIAS = "mlp.router.expert_bias"
# model.moe_shared_ffn_hidden_size: the shared expert, and model.moe_shared_expert_gate its gate
SHARED_EXPERT_FC1_WEIGHT = "mlp.shared_expert.fc1.weight"
SHARED_EXPERT_FC2_WEIGHT = "mlp.shared_expert.fc2.weight"
SHARED_EXPERT_GATE_WEIGHT = "mlp.shared_expert_gate.weight"

_BEFORE_BLOCKS = (EMBEDDING, POSITION_EMBEDDING)

# A LoRA adapter is the submodule `adapter` of the linear layer whose weight it adapts.
ADAPTER = "adapter"
LORA_A, LORA_B = "lora_a", "lora_b"


def adapter_factor_names(weight_name: str) -> tuple[str, str]:
    """The names of the A and B factors of the adapter on the linear weight `weight_name` (…qkv.weight)."""
    layer = weight_name.removesuffix(".weight")
    return f"{layer}.{ADAPTER}.{LORA_A}", f"{layer}.{ADAPTER}.{LORA_B}"


def adapted_weight_name(name: str) -> str | None:
    """The linear weight an adapter factor belongs to (…qkv.adapter.lora_a -> …qkv.weight); None for another name."""
    layer, _, leaf = name.rpartition(".")
    if leaf not in (LORA_A, LORA_B) or not layer.endswith("." + ADAPTER):
        return None
    return layer.removesuffix("." + ADAPTER) + ".weight"


def block_param_name(layer: int, local: str) -> str:
    """The global name of block `layer`'s parameter `local` (e.g. attention.qkv.weight)."""
    return f"{LAYERS}.{layer}.{local}"


def split_block_param_name(name: str) -> tuple[int, str] | None:
    """(layer, local name) of a block's parameter; None for a parameter outside the blocks."""
    head, _, rest = name.partition(".")
    if head != LAYERS:
        return None
    index, _, local = rest.partition(".")
    if not index.isdigit() or not local:
        raise ValueError(f"parameter name {name!r} is not {LAYERS}.<index>.<name>")
    return int(index), local


def layer_index(name: str) -> int | None:
    """The global block index of a parameter; None outside the blocks."""
    parts = split_block_param_name(name)
    return None if parts is None else parts[0]


def before_blocks(name: str) -> bool:
    """Whether a parameter outside the blocks comes before them (embeddings: first pipeline stage)
    rather than after (final norm, output layer: last stage)."""
    return name in _BEFORE_BLOCKS


BEFORE_BLOCKS, AFTER_BLOCKS = "before blocks", "after blocks"


def gather_unit(name: str) -> int | str:
    """ZeRO-3's unit of weights gathered together (engine/optim/param_shards.py): the block's global index, or
    the weights before or after the blocks."""
    layer = layer_index(name)
    if layer is not None:
        return layer
    return BEFORE_BLOCKS if before_blocks(name) else AFTER_BLOCKS


def depth(name: str, num_layers: int) -> int:
    """Position from the input, for layer-wise LR decay: 0 for the embeddings, i + 1 for block i,
    num_layers + 1 for the final norm and the output layer."""
    layer = layer_index(name)
    if layer is not None:
        return layer + 1
    return 0 if before_blocks(name) else num_layers + 1


def no_decay(name: str) -> bool:
    """Biases and norm parameters are excluded from weight decay; matrices and embeddings are not."""
    owner, _, leaf = name.rpartition(".")
    return leaf == "bias" or owner.rpartition(".")[2].endswith("norm")


def global_name(module_name: str, tied_copy: bool) -> str:
    """The layout-independent name of a model chunk's parameter: its module path, except that the
    last stage's copy of a tied embedding is the embedding."""
    return EMBEDDING if tied_copy else module_name

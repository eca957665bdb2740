"""The one FLOP count of the project: parameters and model FLOPs per token of a config.

Model FLOPs are Megatron-LM's as its published figures were counted (`num_floating_point_operations` in
megatron/training/training.py before 2025, the count of Narayanan et al. 2021 with its grouped-query and gated-MLP
terms; PaLM's, torchtitan's and nanoGPT's count the attention the same way), so loom's MFU compares with those
figures: per trained token, 6 FLOPs (2 forward, 4 backward) for every weight of every GEMM, the output layer
(logits) included, plus 12*L*s*(heads*head_dim) for the two attention products (scores and scores x V) over the
whole s x s square. Causal attention is not halved (that convention), although a causal kernel skips about half of
that square; Megatron-LM since 2025 halves it, so its MFU of the same run reads lower by half the attention share
(6.7% at llama-70b and s 8192, 11.1% at llama-8b s 8192, 11.7% at gpt-125m s 2048; docs/gpu.md). LoRA fine-tuning
computes no gradient of a frozen weight: 4 FLOPs for each, 6 for each adapter weight. A mixture of experts counts
the weights a token passes through (its top-k experts' and the router's), not every expert's. Norms, biases, rotary,
softmax and other element-wise work are not counted, nor is recompute (that would be hardware FLOPs). The
vocabulary is the tokenizer's, not the padded one: padded logits are wasted work, not model work (Megatron counts
its padded vocabulary).
"""

from __future__ import annotations

from loom.engine.config import LoraConfig, ModelConfig

# Dense peaks in TFLOP/s, from NVIDIA's datasheets (they print sparse figures, twice these, for the tensor cores),
# matched against torch.cuda.get_device_name() in this order: the first name that appears in it wins, so the
# PCIe and NVL parts come before the plain "H100" (reported by the SXM part as "NVIDIA H100 80GB HBM3").
# An unknown GPU gets no datasheet MFU rather than a wrong one (train.peak_tflops sets it by hand).
_SXM_HOPPER = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 67.0}
PEAK_TFLOPS = {
    "H100 PCIE": {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "fp32": 51.0},  # H100 datasheet, PCIe column
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "fp32": 60.0},  # H100 datasheet, NVL column
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "fp32": 60.0},  # H200 datasheet, NVL column
    "H100": _SXM_HOPPER,  # H100 datasheet, SXM column
    "H200": _SXM_HOPPER,  # H200 datasheet, SXM column (same compute as H100 SXM, more memory)
    "GH200": _SXM_HOPPER,  # GH200 datasheet (Hopper GPU at SXM clocks)
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},  # A100 datasheet (40 and 80 GB, SXM and PCIe)
    "L40S": {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "fp32": 91.6},  # L40S datasheet
}


def layer_parameters(config: ModelConfig) -> int:
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    ffn_in = config.ffn_hidden_size * (2 if config.gated_mlp else 1)
    mlp = h * ffn_in + config.ffn_hidden_size * h
    if config.moe:  # every expert's MLP, the router, a shared expert and its gate
        mlp = config.num_experts * mlp + h * config.num_experts
        shared = config.moe_shared_ffn_hidden_size or 0
        mlp += shared * h * (3 if config.gated_mlp else 2) + (h if config.moe_shared_expert_gate else 0)
    weights = h * (q + 2 * kv) + q * h + mlp
    biases = (q + 2 * kv if config.biased_qkv else 0) + (h + ffn_in + h if config.bias else 0)
    qk_norms = (2 * hd if config.qk_norm_per_head else q + kv) if config.qk_norm else 0
    block_norms = 4 if config.norm_placement == "both" else 2
    norms = (block_norms * h + qk_norms) * (2 if config.norm == "layernorm" else 1)
    return weights + biases + norms


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Unpadded parameter counts: non_embedding (blocks + final norm), embedding, total."""
    h = config.hidden_size
    final_norm = h * (2 if config.norm == "layernorm" else 1)
    non_embedding = sum(layer_parameters(config.layer_config(i)) for i in range(config.num_layers)) + final_norm
    embedding = config.vocab_size * h * (1 if config.tie_embeddings else 2)
    if config.position_embedding == "learned":
        embedding += config.max_position_embeddings * h
    return {"non_embedding": non_embedding, "embedding": embedding, "total": non_embedding + embedding}


def block_gemms(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each GEMM of a transformer block that a token passes through, by the name of its layer
    (LoRA's targets): with model.num_experts, its top-k experts' as one k times as wide, the router, and a shared
    expert and its gate where the model has them."""
    h, query_width = config.hidden_size, config.num_heads * config.head_dim
    key_value_width = config.num_kv_heads * config.head_dim
    gated = 2 if config.gated_mlp else 1
    experts = config.moe_top_k if config.moe else 1
    gemms = {
        "qkv": (h, query_width + 2 * key_value_width),
        "proj": (query_width, h),
        "fc1": (h, gated * config.ffn_hidden_size * experts),
        "fc2": (config.ffn_hidden_size * experts, h),
    }
    if not config.moe:
        return gemms
    gemms["router"] = (h, config.num_experts)
    if config.moe_shared_ffn_hidden_size is not None:
        gemms["shared_fc1"] = (h, gated * config.moe_shared_ffn_hidden_size)
        gemms["shared_fc2"] = (config.moe_shared_ffn_hidden_size, h)
    if config.moe_shared_expert_gate:
        gemms["shared_gate"] = (h, 1)
    return gemms


def model_flops_per_token(config: ModelConfig, seq_length: int, lora: LoraConfig | None = None) -> float:
    """Training FLOPs per token (forward and backward) of a sequence of `seq_length` tokens. With LoRA adapters
    (`lora`, rank > 0) the frozen base's weights take 4 FLOPs each (no weight gradient: forward and input gradient)
    and each adapter weight 6; the attention products are those of full training."""
    blocks = [config.layer_config(layer) for layer in range(config.num_layers)]
    gemm_weights = sum(i * o for block in blocks for i, o in block_gemms(block).values())
    gemm_weights += config.hidden_size * config.vocab_size
    attention_products = 12.0 * config.num_layers * config.num_heads * config.head_dim * seq_length
    if lora is None or not lora.rank:
        return 6.0 * gemm_weights + attention_products
    adapters = sum(lora.rank * (i + o) for block in blocks for name, (i, o) in block_gemms(block).items()
                   if name in lora.targets)  # fmt: skip
    return 4.0 * gemm_weights + 6.0 * adapters + attention_products


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Datasheet dense peak of a known GPU (matched by name, most specific first), or None."""
    name = device_name.upper()
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None

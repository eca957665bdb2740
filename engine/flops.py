"""The one FLOP count of the project: parameters and model FLOPs per token of a config.

Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B): 6*N + 12*L*H*Q*T per trained
token, N the non-embedding parameters. Recompute is not counted (that would be hardware FLOPs).
"""

from __future__ import annotations

from loom.engine.config import ModelConfig

# Dense peak TFLOP/s per device by precision, from the vendors' datasheets (SXM parts).
PEAK_TFLOPS = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
}


def layer_parameters(config: ModelConfig) -> int:
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    ffn_in = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1)
    weights = h * (q + 2 * kv) + q * h + h * ffn_in + config.ffn_hidden_size * h
    biases = (q + 2 * kv) + h + ffn_in + h if config.bias else 0
    norms = 2 * h * (2 if config.norm == "layernorm" else 1)
    return weights + biases + norms


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Unpadded parameter counts: non_embedding (blocks + final norm), embedding, total."""
    h = config.hidden_size
    final_norm = h * (2 if config.norm == "layernorm" else 1)
    non_embedding = config.num_layers * layer_parameters(config) + final_norm
    embedding = config.vocab_size * h * (1 if config.tie_embeddings else 2)
    if config.position_embedding == "learned":
        embedding += config.max_position_embeddings * h
    return {"non_embedding": non_embedding, "embedding": embedding, "total": non_embedding + embedding}


def model_flops_per_token(config: ModelConfig, seq_length: int) -> float:
    n = parameter_counts(config)["non_embedding"]
    return 6.0 * n + 12.0 * config.num_layers * config.num_heads * config.head_dim * seq_length


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Datasheet peak of a known GPU (matched by name), or None."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name.upper():
            return peaks.get(precision)
    return None

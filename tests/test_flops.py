"""The one FLOP count: parameter counts against a built model, FLOPs per token by hand."""

import pytest

from loom.engine.config import ModelConfig
from loom.engine.flops import model_flops_per_token, parameter_counts, peak_tflops
from loom.engine.model.gpt import GPTModel


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {
            "norm": "layernorm",
            "activation": "gelu",
            "position_embedding": "learned",
            "bias": True,
            "tie_embeddings": True,
            "max_position_embeddings": 32,
        },
    ],
)
def test_parameter_count_matches_the_model(kwargs):
    config = ModelConfig(num_layers=3, hidden_size=64, num_heads=8, num_kv_heads=2, vocab_size=1000, **kwargs)
    model = GPTModel(config, None)
    built = sum(p.numel() for p in model.parameters())
    padding = (model.padded_vocab - config.vocab_size) * config.hidden_size * (1 if config.tie_embeddings else 2)
    assert parameter_counts(config)["total"] == built - padding


def test_flops_per_token_by_hand():
    config = ModelConfig(
        num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, ffn_hidden_size=16, activation="gelu", vocab_size=50
    )
    # Per layer: QKV 8*24 + proj 8*8 + fc1 8*16 + fc2 16*8 + two RMSNorm weights 16 = 528; plus final norm 8.
    n = 2 * 528 + 8
    assert parameter_counts(config)["non_embedding"] == n
    assert model_flops_per_token(config, seq_length=10) == 6 * n + 12 * 2 * 2 * 4 * 10


def test_peaks():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("cpu", "fp32") is None

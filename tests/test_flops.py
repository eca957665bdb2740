"""The one FLOP count: parameter counts against a built model; model FLOPs against Megatron-LM's
published formula and against torch's FlopCounterMode on the real model."""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from loom.engine.config import ModelConfig
from loom.engine.config_io import load_config
from loom.engine.flops import model_flops_per_token, parameter_counts, peak_tflops
from loom.engine.model.gpt import GPTModel


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"qkv_bias": True},
        {"qk_norm": True},
        {"qk_norm": True, "qk_norm_per_head": False, "norm_placement": "output"},  # OLMo 2's
        {"qk_norm": True, "norm_placement": "both", "activation": "geglu"},  # Gemma 3's
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


def test_a_qwen2_is_counted_as_transformers_counts_it():
    """Qwen2.5-0.5B's shape (model.qkv_bias: biases on q, k and v alone, tied embeddings), counted by
    transformers' Qwen2ForCausalLM on the meta device and by loom (which MFU and the planner use)."""
    transformers = pytest.importorskip("transformers")
    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    shape.update(num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)).parameters())
    ours = ModelConfig(
        num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, ffn_hidden_size=4864, vocab_size=151936
    )
    ours = dataclasses.replace(ours, qkv_bias=True, tie_embeddings=True)
    assert parameter_counts(ours)["total"] == theirs == 494_032_768
    assert parameter_counts(dataclasses.replace(ours, qkv_bias=False))["total"] == theirs - 24 * (896 + 2 * 2 * 64)


def test_parameter_count_by_hand():
    config = ModelConfig(
        num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, ffn_hidden_size=16, activation="gelu", vocab_size=50
    )
    # Per layer: QKV 8*24 + proj 8*8 + fc1 8*16 + fc2 16*8 + two RMSNorm weights 16 = 528; plus final norm 8.
    assert parameter_counts(config)["non_embedding"] == 2 * 528 + 8


def megatron_formula(layers, hidden, heads, query_groups, kv_channels, ffn, vocab, seq_length, swiglu):
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py, dense model, no MoE or
    MTP) for one token, written as published: 12*b*s*L*h^2 * (attention + MLP + logit terms) with b*s = 1."""
    query_projection_to_hidden_size_ratio = kv_channels * heads / hidden
    gated_linear_multiplier = 3 / 2 if swiglu else 1
    return (
        12
        * layers
        * hidden
        * hidden
        * (
            (1 + query_groups / heads + seq_length / hidden) * query_projection_to_hidden_size_ratio
            + (ffn / hidden) * gated_linear_multiplier
            + vocab / (2 * layers * hidden)
        )
    )


@pytest.mark.parametrize(
    "preset, expected",
    [
        # GPT-3 Small: 12 layers, h 768, 12 heads, GELU 3072, vocab 50257, s 2048
        ("gpt-125m", megatron_formula(12, 768, 12, 12, 64, 3072, 50257, 2048, swiglu=False)),
        # Llama-3-8B: 32 layers, h 4096, 32 heads in 8 groups, SwiGLU 14336, vocab 128256, s 8192
        ("llama-8b", megatron_formula(32, 4096, 32, 8, 128, 14336, 128256, 8192, swiglu=True)),
    ],
)
def test_model_flops_are_megatrons_formula(preset, expected):
    config = load_config(preset, {})
    assert model_flops_per_token(config.model, config.train.seq_length) == pytest.approx(expected, rel=1e-12)


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """FlopCounterMode has no formula for torch._grouped_mm (a mixture of experts' GEMMs): 2 per multiply-add, each
    row of `a` meeting its group's matrix once (a [n, in] x b [groups, in, out]; in backward also [in, n] x [n, out],
    grouped along n)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


if torch.ops.aten._grouped_mm.default not in flop_counter.flop_registry:
    flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def _counted_flops(config: ModelConfig, batch: int, seq_length: int) -> tuple[int, int]:
    """FLOPs FlopCounterMode counts in one forward and backward of the real model, and its padded vocabulary."""
    torch.manual_seed(0)
    model = GPTModel(config, None)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_length))
    # On CPU, SDPA's fused kernel has no FLOP formula in FlopCounterMode, so it would count no attention
    # at all; the math backend computes the same products as matmuls it does count (the full s x s square,
    # causal or not, as the model FLOPs do).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, tokens).sum().backward()
    return counter.get_total_flops(), model.padded_vocab


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_heads": 2, "ffn_hidden_size": 96, "vocab_size": 256},  # Llama-like: GQA, SwiGLU, RoPE, untied
        {  # GPT-2-like: GELU, biases, LayerNorm, learned positions, tied output; 1000 is padded to 1024
            "activation": "gelu",
            "norm": "layernorm",
            "bias": True,
            "position_embedding": "learned",
            "tie_embeddings": True,
            "max_position_embeddings": 32,
            "vocab_size": 1000,
        },
        # a mixture of experts: a token passes through its top 2 experts of 4, the router and a gated shared expert
        {
            **{"num_kv_heads": 2, "ffn_hidden_size": 96, "vocab_size": 256, "num_experts": 4, "moe_top_k": 2},
            **{"moe_shared_ffn_hidden_size": 64, "moe_shared_expert_gate": True},
        },
        # a dense first block (96 wide) before experts 32 wide
        {
            **{"num_kv_heads": 2, "ffn_hidden_size": 96, "vocab_size": 256, "num_experts": 4, "moe_top_k": 2},
            **{"moe_dense_layers": 1, "moe_ffn_hidden_size": 32},
        },
    ],
)
def test_model_flops_agree_with_flop_counter_on_the_model(kwargs):
    config = ModelConfig(num_layers=2, hidden_size=64, num_heads=8, **kwargs)
    batch, seq_length = 2, 32
    counted, padded_vocab = _counted_flops(config, batch, seq_length)
    tokens = batch * seq_length
    # The one known difference: the model computes logits for the padded vocabulary too (6 FLOPs per
    # padded output weight per token); model FLOPs count the tokenizer's vocabulary only. Bias adds,
    # norms and softmax are not matmuls, so FlopCounterMode does not count them either.
    padded_logits = 6 * config.hidden_size * (padded_vocab - config.vocab_size) * tokens
    assert counted - padded_logits == pytest.approx(model_flops_per_token(config, seq_length) * tokens, rel=1e-9)


def test_peaks():
    # the names NVIDIA's drivers report; PCIe and NVL parts are slower than the SXM one
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert peak_tflops("NVIDIA H100 NVL", "fp8") == 1670.5
    assert peak_tflops("NVIDIA H200", "bf16") == peak_tflops("NVIDIA GH200 480GB", "bf16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == peak_tflops("NVIDIA A100-PCIE-40GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 on Ampere
    assert peak_tflops("NVIDIA RTX 6000 Ada Generation", "bf16") is None  # unknown: no MFU, not a wrong one
    assert peak_tflops("cpu", "fp32") is None


@pytest.mark.parametrize("targets", [["qkv", "proj", "fc1", "fc2"], ["qkv", "fc2"]])
def test_lora_flops_agree_with_flop_counter_on_the_adapted_model(targets):
    """LoRA runs reported the MFU of full training (6 FLOPs per frozen weight, whose gradient is never computed):
    frozen weights take 4 (forward and input gradient), adapter weights 6."""
    from loom.engine.config import LoraConfig
    from loom.engine.model.lora import add_adapters

    config = ModelConfig(num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=96, vocab_size=256)
    lora = LoraConfig(rank=4, targets=targets, base="unused")
    batch, seq_length = 2, 32
    torch.manual_seed(0)
    model = GPTModel(config, None)
    add_adapters(model, lora, None)
    # Input gradients reach the first block as they would from a trainable layer before it; the embedding's own
    # gradient is a scatter, which FlopCounterMode does not count (the convention's one simplification: in a real
    # LoRA run the first block's input needs no gradient).
    model.embedding.weight.requires_grad_(True)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_length))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, tokens).sum().backward()
    padded_logits = 4 * config.hidden_size * (model.padded_vocab - config.vocab_size) * batch * seq_length
    expected = model_flops_per_token(config, seq_length, lora) * batch * seq_length
    assert counter.get_total_flops() - padded_logits == pytest.approx(expected, rel=1e-9)
    assert model_flops_per_token(config, seq_length, lora) < model_flops_per_token(config, seq_length)


# The published sizes: Meta's model cards' parameter counts (Llama-3-8B, Llama-3-70B, Llama-3.2-1B), and
# OLMo-2-0425-1B's 1.48B, Gemma 2B's 2.51B, Gemma 2 2B's 2.61B, Gemma 3 1B's 1.00B, Mixtral-8x7B's 46.7B and
# OLMoE-1B-7B's 6.9B (their config.json's shapes, counted to the parameter).
PUBLISHED_PARAMETERS = {
    "llama-8b": 8_030_261_248,
    "llama-70b": 70_553_706_496,
    "llama-1b": 1_235_814_400,
    "olmo2-1b": 1_484_916_736,
    "gemma-2b": 2_506_172_416,
    "gemma3-1b": 999_885_952,
    "gemma2-2b": 2_614_341_888,
    "mixtral-8x7b": 46_702_792_704,
    "olmoe-1b-7b": 6_919_161_856,
    "minimax-m2": 228_689_748_992,  # "230B": MiniMax-M2's config.json shapes without its multi-token-prediction modules
}


@pytest.mark.parametrize("preset", PUBLISHED_PARAMETERS)
def test_presets_are_the_published_models(preset):
    """Each preset, as export-hf would describe it, is the model of its name to the parameter: counted by the
    transformers class export-hf names (LlamaForCausalLM, Olmo2ForCausalLM, GemmaForCausalLM, Gemma3ForCausalLM)
    built on the meta device, by loom's count (which MFU and the planner use) and against the published figure."""
    transformers = pytest.importorskip("transformers")
    from loom.engine.config_io import config_to_dict
    from loom.tools.hf import hf_config

    model = load_config(preset).model
    hf = hf_config(config_to_dict(load_config(preset))["model"])
    architecture = getattr(transformers, hf.pop("architectures")[0])
    with torch.device("meta"):
        theirs = architecture(transformers.AutoConfig.for_model(**hf))
    counted = sum(p.numel() for p in theirs.parameters())
    assert counted == parameter_counts(model)["total"] == PUBLISHED_PARAMETERS[preset]

"""Mixture-of-experts models in Hugging Face's files, checked against transformers: a Mixtral, a Qwen3-MoE and an
OLMoE written by the installed transformers import with its logits, `loom eval` over two tensor-parallel ranks gives
its loss, loom's KV-cached greedy decoding continues a prompt as it does, and the export loads back with the same
logits and class."""

import pytest
import torch
from test_hf import (
    _assert_greedy_generate_equals_transformers,
    _round_trip_computes_as_transformers,
    llama_fields,
)

transformers = pytest.importorskip("transformers")

# Router weights far from uniform, so that the experts each token goes to (and their weights) are decided by clear
# margins: a wrong routing rule (no renormalisation, softmax after top-k, another expert order) moves the logits.
ROUTER_STD = 2.0


def _moe_model(kind: str):
    shape = llama_fields(num_key_value_heads=2, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    for name in ("pretraining_tp", "mlp_bias", "rope_scaling"):
        shape.pop(name, None)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
        model_class = transformers.MixtralForCausalLM
    elif kind == "qwen3_moe":  # renormalised top 3 of 6, experts narrower than the dense intermediate_size
        config = transformers.Qwen3MoeConfig(
            **{**shape, "head_dim": 16},
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
        model_class = transformers.Qwen3MoeForCausalLM
    else:  # OLMoE: the top 2 of 4 at their softmax probabilities, not renormalised
        config = transformers.OlmoeConfig(
            **{**shape, "eos_token_id": 1, "pad_token_id": 0}, num_experts=4, num_experts_per_tok=2
        )
        model_class = transformers.OlmoeForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("gate.weight"):
                tensor.normal_(0.0, ROUTER_STD)
            elif "norm" in name:  # norms at one would hide q/k norms read from the wrong place
                tensor.normal_(1.0, 0.2)
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe"])
def test_a_mixture_of_experts_imports_evaluates_decodes_and_exports_as_transformers_computes_it(kind, tmp_path, capfd):
    model = _moe_model(kind)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    experts, top_k = (6, 3) if kind == "qwen3_moe" else (4, 2)
    assert (imported["num_experts"], imported["moe_top_k"]) == (experts, top_k)
    assert imported["moe_norm_top_k"] is (kind != "olmoe")
    assert type(again) is type(model)
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 8)

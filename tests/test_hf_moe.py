"""Mixture-of-experts models in Hugging Face's files, checked against transformers: a Mixtral, a Qwen3-MoE and an
OLMoE written by the installed transformers import with its logits, `loom eval` over two tensor-parallel ranks gives
its loss, loom's KV-cached greedy decoding continues a prompt as it does, and the export loads back with the same
logits and class."""

import json

import pytest
import torch
from test_hf import (
    VOCAB,
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
    elif kind == "minimax_m2":  # sigmoid scores, routing biases, q/k norms across heads, half of each head turned
        config = transformers.MiniMaxM2Config(
            **{**shape, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            num_local_experts=4,
            num_experts_per_tok=2,
            partial_rotary_factor=0.5,
        )
        model_class = transformers.MiniMaxM2ForCausalLM
    elif kind == "glm4_moe":  # GLM-4.5: a dense first block, then experts beside a shared one; q/k/v biases, per-head
        # query/key norms, half of each head turned, sigmoid scores with biases, scaled
        config = transformers.Glm4MoeConfig(
            **{**shape, "head_dim": 16},
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            n_group=2,  # each token's two experts from the better of two groups
            topk_group=1,
            use_qk_norm=True,
            attention_bias=True,
            partial_rotary_factor=0.5,
        )
        model_class = transformers.Glm4MoeForCausalLM
    elif kind == "qwen2_moe":  # the top 2 of 4 at their softmax probabilities, a gated shared expert, q/k/v biases
        config = transformers.Qwen2MoeConfig(
            **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
        config.mlp_only_layers = [0]  # and a dense first block
        model_class = transformers.Qwen2MoeForCausalLM
    else:  # OLMoE: the top 2 of 4 at their softmax probabilities, not renormalised
        config = transformers.OlmoeConfig(
            **{**shape, "eos_token_id": 1, "pad_token_id": 0}, num_experts=4, num_experts_per_tok=2
        )
        model_class = transformers.OlmoeForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("gate.weight"):  # the routers, and Qwen2-MoE's shared expert's gate
                tensor.normal_(0.0, ROUTER_STD)
            elif name.endswith("_proj.bias"):  # zero, as transformers initialises them, would hide a misplaced one
                tensor.normal_(0.0, 0.5)
            elif "norm" in name:  # norms at one would hide q/k norms read from the wrong place
                tensor.normal_(1.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # MiniMax-M2's, large enough to change experts
                buffer.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "minimax_m2", "glm4_moe"])
def test_a_mixture_of_experts_imports_evaluates_decodes_and_exports_as_transformers_computes_it(kind, tmp_path, capfd):
    model = _moe_model(kind)
    model.save_pretrained(str(tmp_path / "hf"))
    imported, again = _round_trip_computes_as_transformers(model, tmp_path, capfd)
    experts, top_k = (6, 3) if kind == "qwen3_moe" else (4, 2)
    assert (imported["num_experts"], imported["moe_top_k"]) == (experts, top_k)
    assert imported["moe_norm_top_k"] is (kind in ("mixtral", "qwen3_moe", "minimax_m2", "glm4_moe"))
    sigmoid = kind in ("minimax_m2", "glm4_moe")
    assert (imported["moe_router_score"] == "sigmoid", imported["moe_expert_bias"]) == (sigmoid, sigmoid)
    assert imported["rotary_percent"] == (0.5 if sigmoid else 1.0)
    shared = {"qwen2_moe": (48, True, True), "glm4_moe": (32, False, True)}.get(kind, (None, False, False))
    assert (imported["moe_shared_ffn_hidden_size"], imported["moe_shared_expert_gate"], imported["qkv_bias"]) == shared
    if kind == "glm4_moe":  # its first block dense, 96 wide; experts 32 wide; weights x 2.5; no balancing loss
        assert (imported["moe_dense_layers"], imported["ffn_hidden_size"], imported["moe_ffn_hidden_size"]) == (
            1,
            96,
            32,
        )
        assert (imported["moe_router_scale"], imported["moe_aux_loss_coeff"]) == (2.5, 0.0)
        assert (imported["moe_router_groups"], imported["moe_router_group_top_k"], imported["moe_router_fp32"]) == (
            2,
            1,
            True,
        )
        assert (again.config.n_group, again.config.topk_group) == (2, 1)
        from loom.tools.hf_moe import moe_architecture

        every_group = {**imported, "moe_router_groups": 4, "moe_router_group_top_k": 4}  # keeps all: no groups there
        assert (moe_architecture(every_group)["n_group"], moe_architecture(every_group)["topk_group"]) == (1, 1)
    if kind == "qwen2_moe":  # its first block dense, intermediate_size wide (mlp_only_layers [0])
        assert (imported["moe_dense_layers"], imported["ffn_hidden_size"], imported["moe_ffn_hidden_size"]) == (
            1,
            96,
            32,
        )
        assert again.config.mlp_only_layers == [0]
    if kind != "glm4_moe":  # transformers' loss is about top_k at an even load over the layers with experts (the
        # routers it records), loom's 1 a block
        blocks = 1 if kind == "qwen2_moe" else 2
        assert imported["moe_aux_loss_coeff"] == pytest.approx(model.config.router_aux_loss_coef * top_k / blocks)
        assert again.config.router_aux_loss_coef == model.config.router_aux_loss_coef
    assert type(again) is type(model)
    _assert_greedy_generate_equals_transformers(model, tmp_path / "loom", 8)


def test_a_lora_run_on_an_imported_mixtral_exports_an_adapter_peft_loads_onto_it(markov_dataset, tmp_path, capfd):
    """The user story: import a Mixtral, train LoRA adapters on it (the default targets narrow to attention's: the
    experts take none; the router is frozen, so no load-balancing loss), export the merged model and the adapter
    alone; peft's Mixtral with the adapter computes the merged export's logits, and they moved away from the base's."""
    peft = pytest.importorskip("peft")
    from training_runs import loom_here, tiny_train_args

    from loom.tools.hf import export_hf, export_peft_adapter, import_hf

    model = _moe_model("mixtral")
    model.save_pretrained(str(tmp_path / "hf"))
    import_hf(tmp_path / "hf", tmp_path / "base")
    args = tiny_train_args(markov_dataset(60, vocab_size=VOCAB), tmp_path / "run", "--lora.rank", "4")
    args += ["--lora.base", str(tmp_path / "base"), "--train.steps", "3", "--train.seq_length", "64"]
    args += ["--model.num_experts", "4"]  # restating the base's experts narrows the default targets all the same
    args += [
        "--optim.lr",
        "0.05",
        "--optim.warmup_steps",
        "0",
        "--lora.init",
        "gaussian",
        "--checkpoint.save_at_end",
        "true",
    ]
    result = loom_here(capfd, "train", *args)
    assert result.returncode == 0, result.stderr
    assert "mixture of 4 experts, which take no adapters: lora.targets = qkv proj" in result.stdout
    assert "the router is frozen: no load-balancing loss" in result.stdout
    # and the ranks train so (the base's 0.01 x 2 / 2 came back on them, training the adapters through the router)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row for row in rows if "loss" in row] and not [row for row in rows if "moe_aux_loss" in row]
    assert "has no effect" not in result.stdout + result.stderr  # the rate of biases Mixtral has not
    export_hf(tmp_path / "run", tmp_path / "merged")
    # the merge is the base's model, trained on as the base was: its balancing loss's weight, not the LoRA run's 0
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["router_aux_loss_coef"] == pytest.approx(
        model.config.router_aux_loss_coef
    )
    export_peft_adapter(tmp_path / "run", tmp_path / "adapter", base_model=str(tmp_path / "hf"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base = model(tokens).logits  # before peft puts the adapter into the model
        with_adapter = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
        ours, theirs = merged(tokens).logits, with_adapter(tokens).logits
    assert (ours - base).abs().max() > 1e-3, "the adapters should have moved the model"
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_a_fine_tune_of_an_imported_qwen3_moe_under_a_dense_preset_takes_its_experts(markov_dataset, tmp_path, capfd):
    """`--config tiny --checkpoint.load IMPORT --checkpoint.finetune true`: the preset is dense, the checkpoint a
    mixture of experts; the run takes the checkpoint's experts and routing (said), and trains them."""
    from training_runs import loom_here, read_metrics, tiny_train_args

    from loom.tools.hf import import_hf

    model = _moe_model("qwen3_moe")
    model.save_pretrained(str(tmp_path / "hf"))
    import_hf(tmp_path / "hf", tmp_path / "base")
    args = tiny_train_args(markov_dataset(60, vocab_size=VOCAB), tmp_path / "run", "--train.steps", "2")
    args += ["--checkpoint.load", str(tmp_path / "base"), "--checkpoint.finetune", "true", "--train.seq_length", "64"]
    result = loom_here(capfd, "train", *args)
    assert result.returncode == 0, result.stderr
    assert "model.num_experts = 6" in result.stdout and "model.moe_top_k = 3" in result.stdout, result.stdout
    assert "| moe aux " in result.stdout  # the load-balancing loss in every step line
    rows = [row for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2] and all(row["moe_aux_loss"] > 0 for row in rows)
    # the experts came from the checkpoint, and FP8 (which they do not take) is refused all the same
    fp8 = tiny_train_args(
        markov_dataset(60, vocab_size=VOCAB), tmp_path / "fp8", "--train.fp8", "current", "--train.precision", "bf16"
    )
    fp8 += ["--checkpoint.load", str(tmp_path / "base"), "--checkpoint.finetune", "true"]
    refused = loom_here(capfd, "train", *fp8)
    assert refused.returncode == 2 and "train.fp8 = current with model.num_experts = 6" in refused.stderr


@pytest.mark.parametrize("kind", ["mixtral", "minimax_m2", "glm4_moe"])
def test_transformers_5_s_own_stacked_layout_imports_with_its_logits(kind, tmp_path):
    """save_pretrained(save_original_format=False) (and a PEFT model's save) writes every expert's tensors stacked,
    as loom stacks them (mlp.experts.gate_up_proj, down_proj; a Mixtral's router as mlp.gate, MiniMax-M2's biases as
    mlp.e_score_correction_bias; GLM-4.5's first expert block after its dense one): it imports whole."""
    from training_runs import loom_logits

    from loom.tools.hf import import_hf

    model = _moe_model(kind)
    model.save_pretrained(str(tmp_path / "hf"), save_original_format=False)
    import_hf(tmp_path / "hf", tmp_path / "loom")
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (loom_logits(tmp_path / "loom", tokens) - model(tokens).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "settings, refusal",
    [
        ({"qk_norm_per_head": False, "head_dim": 32}, "heads other than hidden_size / num_heads wide"),
        ({"sliding_window": 16, "rope_local_theta": 100.0}, "rope_local_theta (Gemma 3's)"),
        ({"moe_norm_top_k": False}, "moe_norm_top_k = false without query/key norms"),
        (
            {"sliding_window": 16, "moe_shared_ffn_hidden_size": 128, "moe_shared_expert_gate": True, "qkv_bias": True},
            "a sliding window (only Mixtral's export)",
        ),
        ({"moe_router_score": "sigmoid"}, "sigmoid router scores without experts' biases (MiniMax-M2's and GLM-4.5's"),
        (  # without query/key norms across heads: GLM-4.5's form, which has a shared expert
            {"moe_router_score": "sigmoid", "moe_expert_bias": True},
            "sigmoid router scores without a shared expert (GLM-4.5's has one)",
        ),
        (
            {"moe_router_score": "sigmoid", "moe_expert_bias": True, "moe_shared_ffn_hidden_size": 96},
            "a shared expert other than a whole number of experts wide",
        ),
        (
            {
                "moe_router_score": "sigmoid",
                "moe_expert_bias": True,
                "qk_norm_per_head": False,
                "moe_router_scale": 2.5,
            },
            "a moe_router_scale",
        ),
        ({"rotary_percent": 0.5}, "rotary_percent < 1 (only MiniMax-M2's and GLM-4.5's turn part of each head)"),
        ({"moe_dense_layers": 1}, "dense blocks among them (moe_dense_layers; GLM-4.5's and Qwen-MoE's have them)"),
        ({"moe_ffn_hidden_size": 128}, "a moe_ffn_hidden_size"),
        ({"moe_router_groups": 2, "moe_router_group_top_k": 1}, "group-limited routing (only GLM-4.5's)"),
        (
            {
                **{"moe_router_score": "sigmoid", "moe_expert_bias": True, "num_experts": 8, "moe_top_k": 3},
                **{"moe_router_groups": 2, "moe_router_group_top_k": 1},
            },
            "groups scored by other than their top 2 experts (GLM-4.5's)",
        ),
    ],
)
def test_experts_a_hugging_face_class_cannot_compute_alike_are_refused_on_export(settings, refusal):
    from loom.engine.checkpoint.format import CheckpointError
    from loom.engine.config import ModelConfig
    from loom.engine.config_io import config_to_dict, load_config
    from loom.tools.hf_forms import check_llama_form

    model = {"num_experts": 4, "qk_norm": "qk_norm_per_head" in settings, **settings}
    fields = config_to_dict(load_config("tiny", {"model": model}))["model"]
    ModelConfig(**fields)  # a model loom trains
    with pytest.raises(CheckpointError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        check_llama_form(fields, gpt2_too=True)


def test_an_olmoe_export_names_no_padding_token_of_olmo_s(tmp_path):
    """OlmoeConfig's pad id defaults to 1, loom's BOS: an export writes none unless the model came with one."""
    from loom.engine.config_io import config_to_dict, load_config
    from loom.tools.hf_forms import hf_config

    fields = config_to_dict(load_config("olmoe-1b-7b"))["model"]
    written = hf_config(fields)
    assert written["model_type"] == "olmoe" and written["pad_token_id"] is None
    assert transformers.OlmoeConfig(**written).pad_token_id is None


def test_glm_s_multi_token_prediction_layers_are_left_out_as_transformers_leaves_them(tmp_path, capfd):
    """GLM-4.5's files keep a multi-token-prediction layer after the model's own (num_nextn_predict_layers: 1,
    model.layers.<num_hidden_layers>...), which Glm4MoeForCausalLM does not compute: it is left out, said."""
    from safetensors.torch import load_file, save_file
    from training_runs import loom_logits

    from loom.tools.hf import import_hf

    model = _moe_model("glm4_moe")
    model.save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    import_hf(tmp_path / "hf", tmp_path / "loom")
    assert "keeps multi-token-prediction layers after its 2 (2 tensors): they are left out" in capfd.readouterr().err
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (loom_logits(tmp_path / "loom", tokens) - model(tokens).logits).abs().max().item() < 1e-5
    # a bf16 export keeps the router and its biases in fp32, as Glm4MoeForCausalLM keeps them (bf16 moved the biases
    # by up to 0.0014, enough to change experts)
    from safetensors import safe_open

    from loom.tools.hf import export_hf

    export_hf(tmp_path / "loom", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as exported:
        dtypes = {name: exported.get_slice(name).get_dtype() for name in exported.keys()}
    routing = {name for name in dtypes if name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))}
    assert len(routing) == 2 and {dtypes[name] for name in routing} == {"F32"}
    assert {dtypes[name] for name in dtypes if name not in routing} == {"BF16"}


@pytest.mark.parametrize(
    "kind, settings, refusal",
    [
        # Glm4MoeForCausalLM scores an expert group by its top 2 experts, loom (as Megatron) by its top
        # num_experts_per_tok / topk_group
        (
            "glm4_moe",
            {"n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1},
            "each scored by its top 2 experts .* topk_group = 3",
        ),
        ("glm4_moe", {"n_group": 0}, "config.json's n_group is 0, not a positive number"),
        # loom's dense blocks are the first ones
        ("qwen2_moe", {"mlp_only_layers": [1]}, r"a dense MLP \(mlp_only_layers \[1\]\)"),
        ("qwen2_moe", {"mlp_only_layers": [0, 1]}, r"mlp_only_layers \[0, 1\]"),  # no block left with experts
        ("qwen2_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step 2"),
    ],
)
def test_routing_and_dense_layers_loom_cannot_compute_alike_are_refused_on_import(kind, settings, refusal, tmp_path):
    """In one line, before any tensor is read or anything written."""
    import json as json_module

    from loom.engine.checkpoint.format import CheckpointError
    from loom.tools.hf import import_hf

    _moe_model(kind).save_pretrained(str(tmp_path / "hf"))
    config = json_module.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(settings)
    (tmp_path / "hf" / "config.json").write_text(json_module.dumps(config))
    with pytest.raises(CheckpointError, match=refusal):
        import_hf(tmp_path / "hf", tmp_path / "loom")
    assert not (tmp_path / "loom").exists()


def test_experts_of_different_shapes_are_refused_not_stacked(tmp_path):
    """Each expert's tensors stack into one only if all have one shape: rows moved from one expert's to another's
    keep the total (and were stacked with the rows given to the wrong experts); one of them grown by a row fails
    the stack's shape. Both are refused in one line naming the tensors."""
    from safetensors.torch import load_file, save_file

    from loom.engine.checkpoint.format import CheckpointError
    from loom.tools.hf import import_hf

    _moe_model("mixtral").save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    first, second = (f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight" for e in (0, 1))
    moved = {**tensors, first: torch.cat([tensors[first], tensors[second][:4]]), second: tensors[second][4:]}
    grown = {**tensors, first: torch.cat([tensors[first], tensors[first][:1]])}
    for name, edited in (("moved", moved), ("grown", grown)):
        save_file(edited, str(path), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match="which do not stack into loom's layers.1.mlp.experts.fc1.weight"):
            import_hf(tmp_path / "hf", tmp_path / name)
        assert not (tmp_path / name).exists()


def test_router_jitter_is_said_to_be_left_out(tmp_path, capfd):
    """Mixtral's router_jitter_noise perturbs the router's input in training only: imported without it, said."""
    import json as json_module

    from loom.tools.hf import import_hf

    _moe_model("mixtral").save_pretrained(str(tmp_path / "hf"))
    config = json_module.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json_module.dumps({**config, "router_jitter_noise": 0.1}))
    import_hf(tmp_path / "hf", tmp_path / "loom")
    assert "router_jitter_noise 0.1 (noise on the router's input while training) is left out" in capfd.readouterr().err


def test_quantized_files_are_refused_with_what_to_do(tmp_path):
    """MiniMax-M2's and DeepSeek-V3's released files hold FP8 blocks and their scales (quantization_config): refused
    in one line that says to dequantize, not as tensors the config does not describe."""
    import json as json_module

    from loom.engine.checkpoint.format import CheckpointError
    from loom.tools.hf import import_hf

    _moe_model("minimax_m2").save_pretrained(str(tmp_path / "hf"))
    config = json_module.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "hf" / "config.json").write_text(json_module.dumps(config))
    with pytest.raises(CheckpointError, match=r"weights are quantized \(fp8: quantization_config\); loom imports"):
        import_hf(tmp_path / "hf", tmp_path / "loom")

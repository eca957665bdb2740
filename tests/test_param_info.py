"""Parameter names (engine/model/naming.py) and the one record of per-parameter facts (ParamInfo)."""

import dataclasses

import pytest
import torch
from dist_utils import run_ranks

from loom.engine.config import ModelConfig, OptimConfig
from loom.engine.model import naming
from loom.engine.model.gpt import GPTModel
from loom.engine.optim.distributed import DistributedOptimizer
from loom.engine.optim.grad_buffer import GradBuffer
from loom.engine.parallel.param_info import MissingParamInfoError, ParamInfo, param_info, set_param_info
from loom.engine.parallel.sharding import ShardSpec, initialize_parameters, make_parameter
from loom.engine.parallel.state import ParallelState
from loom.tools.hf import from_hf, to_hf

SMALL = dict(num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=97, make_vocab_divisible_by=8)
VARIANTS = {
    "llama-untied": dict(tie_embeddings=False),
    "llama-tied": dict(tie_embeddings=True),
    "gpt2-like": dict(norm="layernorm", activation="gelu", position_embedding="learned", bias=True),
}


def chunks(variant: str) -> list[GPTModel]:
    """The whole model, and its first and last pipeline chunks (which hold the two tied copies)."""
    config = ModelConfig(**SMALL, **VARIANTS[variant])
    return [
        GPTModel(config, None),
        GPTModel(config, None, layer_ids=range(0, 1), post_process=False),
        GPTModel(config, None, layer_ids=range(1, 3), pre_process=False),
    ]


# -- naming -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layer, local", [(0, naming.QKV_WEIGHT), (11, "mlp.fc2.bias"), (3, naming.INPUT_NORM_WEIGHT)])
def test_block_names_round_trip(layer, local):
    name = naming.block_param_name(layer, local)
    assert name == f"layers.{layer}.{local}"
    assert naming.split_block_param_name(name) == (layer, local)
    assert naming.layer_index(name) == layer


@pytest.mark.parametrize("name", [naming.EMBEDDING, naming.POSITION_EMBEDDING, naming.FINAL_NORM_WEIGHT, naming.OUTPUT])
def test_names_outside_the_blocks_have_no_layer(name):
    assert naming.split_block_param_name(name) is None
    assert naming.layer_index(name) is None


@pytest.mark.parametrize("name", ["layers.x.attention.qkv.weight", "layers.3", "layers..mlp.fc1.weight"])
def test_a_malformed_block_name_is_refused(name):
    with pytest.raises(ValueError, match="layers.<index>.<name>"):
        naming.layer_index(name)


def test_depth_orders_embeddings_blocks_then_the_head():
    depths = [
        naming.depth(name, 4)
        for name in (naming.EMBEDDING, naming.POSITION_EMBEDDING, "layers.0.mlp.fc1.weight", "layers.3.mlp_norm.weight")
    ]
    assert depths == [0, 0, 1, 4]
    assert naming.depth(naming.FINAL_NORM_WEIGHT, 4) == naming.depth(naming.OUTPUT, 4) == 5


@pytest.mark.parametrize(
    "name, excluded",
    [
        ("layers.2.attention.qkv.weight", False),
        ("layers.2.attention.qkv.bias", True),
        ("layers.2.input_norm.weight", True),
        ("layers.2.mlp_norm.bias", True),
        ("final_norm.weight", True),
        (naming.EMBEDDING, False),
        (naming.POSITION_EMBEDDING, False),
        (naming.OUTPUT, False),
    ],
)
def test_no_decay_means_biases_and_norms(name, excluded):
    assert naming.no_decay(name) is excluded


def test_the_tied_copy_is_named_as_the_embedding():
    assert naming.global_name(naming.OUTPUT, tied_copy=True) == naming.EMBEDDING
    assert naming.global_name(naming.OUTPUT, tied_copy=False) == naming.OUTPUT


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_model_name_parses_back_and_no_decay_means_vectors(variant):
    for chunk in chunks(variant):
        for module_name, param in chunk.named_parameters():
            name = param_info(param).name
            in_block = naming.split_block_param_name(name)
            if in_block is not None:
                assert naming.block_param_name(*in_block) == name == module_name
            # The optimizer used to decay exactly the parameters of two or more dimensions.
            assert naming.no_decay(name) is (param.ndim < 2), name


@pytest.mark.parametrize("tied", [False, True])
def test_hugging_face_mapping_round_trips(tied):
    config = ModelConfig(**SMALL, tie_embeddings=tied)
    model = GPTModel(config, None)
    initialize_parameters(model, seed=2, tp_rank=0, tp_size=1)
    logical = {param_info(p).name: param_info(p).shard_spec.unshard([p.detach()]) for p in model.parameters()}
    model_dict = dataclasses.asdict(config)  # [model] as a checkpoint's config holds it
    hf = to_hf(logical, model_dict)
    assert ("lm_head.weight" in hf) is not tied
    assert hf["model.layers.2.self_attn.k_proj.weight"].shape == (16, 32)
    back = from_hf(hf, model_dict)
    assert back.keys() == logical.keys()
    assert all(torch.equal(back[name], logical[name]) for name in logical)


# -- ParamInfo --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_parameter_of_a_model_has_its_info(variant):
    for chunk in chunks(variant):
        for module_name, param in chunk.named_parameters():
            info = param_info(param)
            assert isinstance(info, ParamInfo) and isinstance(info.shard_spec, ShardSpec)
            assert info.shard_spec.local_shape(1) == tuple(param.shape)
            assert info.layer == naming.layer_index(info.name)
            assert info.no_decay == naming.no_decay(info.name)
            assert info.name == module_name or (info.tied_copy and info.name == naming.EMBEDDING)


def test_tied_embedding_copies():
    whole, first, last = chunks("llama-tied")
    assert not hasattr(whole, "output_weight") and param_info(whole.embedding.weight).tied_embedding
    assert not param_info(whole.embedding.weight).tied_copy
    copy = param_info(last.output_weight)
    assert copy.tied_embedding and copy.tied_copy and copy.name == naming.EMBEDDING
    assert copy.shard_spec == param_info(first.embedding.weight).shard_spec
    untied = chunks("llama-untied")[2]
    assert param_info(untied.output_weight) == ParamInfo(
        param_info(untied.output_weight).shard_spec, ("normal", 0.02), name=naming.OUTPUT
    )


def test_both_tied_copies_start_equal():
    _, first, last = chunks("llama-tied")
    for chunk in (first, last):
        initialize_parameters(chunk, seed=4, tp_rank=0, tp_size=1)
    assert torch.equal(first.embedding.weight, last.output_weight)


def test_a_parameter_without_info_is_a_clear_error():
    with pytest.raises(MissingParamInfoError, match=r"shape \(3, 2\) has no ParamInfo"):
        param_info(torch.nn.Parameter(torch.zeros(3, 2)))


def test_an_unnamed_parameter_is_not_initialised():
    module = torch.nn.Module()
    module.weight = make_parameter(ShardSpec((4,)), 1, ("ones",))
    with pytest.raises(MissingParamInfoError, match="weight has no global name"):
        initialize_parameters(module, seed=0, tp_rank=0, tp_size=1)
    set_param_info(module.weight, ParamInfo(ShardSpec((4,)), ("ones",), name="weight"))
    initialize_parameters(module, seed=0, tp_rank=0, tp_size=1)
    assert torch.equal(module.weight.detach(), torch.ones(4))


def _lr_scales(rank, world):
    config = ModelConfig(**SMALL, tie_embeddings=True)
    last = GPTModel(config, None, layer_ids=range(1, 3), pre_process=False)
    named = list(last.named_parameters())
    grads = GradBuffer([p for _, p in named], None, 1, 0, bucket_bytes=4096, enabled=False)
    optim = OptimConfig(lr=1.0, min_lr=0.0, layer_lr_decay=0.5, weight_decay=0.1)
    optimizer = DistributedOptimizer(named, grads, optim, ParallelState.create(tp=1, dp=1), config.num_layers)
    scale_of = {id(p): (g["lr_scale"], g["weight_decay"]) for g in optimizer.inner.param_groups for p in g["params"]}
    return {name: scale_of[id(p)] for name, p in named}


def test_the_tied_copy_gets_the_embeddings_lr_scale_and_vectors_no_decay():
    (scales,) = run_ranks(_lr_scales, 1)
    assert scales[naming.OUTPUT] == (0.5**4, 0.1)  # depth 0, like the first stage's embedding
    assert scales["layers.2.attention.qkv.weight"] == (0.5**1, 0.1)
    assert scales["layers.1.mlp_norm.weight"] == (0.5**2, 0.0)
    assert scales[naming.FINAL_NORM_WEIGHT] == (1.0, 0.0)


def test_weights_are_initialised_as_megatron_cores_transformer_config_says():
    """Megatron's initialisation, from megatron-core's own TransformerConfig: N(0, init_method_std) for the
    embedding, the output layer, QKV and the first MLP matrix; N(0, std / sqrt(2 L)) for the two matrices that write
    into the residual stream (attention's projection, the second MLP matrix); norms at one. What each parameter
    records, and the spread of what initialize_parameters draws."""
    transformer = pytest.importorskip("megatron.core.transformer", reason="needs loom[reference]")
    config = ModelConfig(
        num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=512, vocab_size=512, init_std=0.01
    )
    megatron = transformer.TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        init_method_std=config.init_std,
    )
    stds = {
        "init_method": megatron.init_method.keywords["std"],
        "output_layer_init_method": megatron.output_layer_init_method.keywords["std"],
    }
    model = GPTModel(config, None)
    initialize_parameters(model, seed=1, tp_rank=0, tp_size=1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            assert param_info(param).init_method == ("ones",) and torch.equal(param, torch.ones_like(param)), name
            continue
        which = "output_layer_init_method" if name.endswith(("proj.weight", "fc2.weight")) else "init_method"
        assert param_info(param).init_method == ("normal", pytest.approx(stds[which], rel=1e-12)), name
        assert param.std().item() == pytest.approx(stds[which], rel=0.05), name  # >= 16k draws each
        assert abs(param.mean().item()) < 0.05 * stds[which], name


def _megatron_no_decay(rank, world):
    """{variant: {name: (whether megatron-core's own grouping exempts the parameter from weight decay, whether loom
    does)}} for loom's model of each variant."""
    import megatron.core.optimizer as optimizer

    config = optimizer.OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1)
    decisions = {}
    for variant, shape in VARIANTS.items():
        model = GPTModel(ModelConfig(**SMALL, **shape), None)
        groups = optimizer._get_param_groups([model], config, optimizer.get_standard_config_overrides(config))
        theirs = {id(p): group["wd_mult"] == 0.0 for group in groups for p in group["params"]}
        decisions[variant] = {name: (theirs[id(p)], param_info(p).no_decay) for name, p in model.named_parameters()}
    return decisions


def test_no_weight_decay_on_the_parameters_megatron_core_exempts():
    """Which parameters get no weight decay (norms, biases: every vector) is megatron-core's own decision, taken by
    its optimizer's parameter grouping on loom's model (one rank, for its process group)."""
    pytest.importorskip("megatron.core.optimizer", reason="needs loom[reference]")
    (by_variant,) = run_ranks(_megatron_no_decay, 1)
    for variant, decisions in by_variant.items():
        assert {name: ours for name, (_, ours) in decisions.items()} == {n: t for n, (t, _) in decisions.items()}, (
            variant
        )
        assert any(theirs for theirs, _ in decisions.values()) and not all(t for t, _ in decisions.values()), variant

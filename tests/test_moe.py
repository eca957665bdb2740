"""A mixture of experts (model.num_experts, engine/model/moe.py) against references written here: the grouped expert
GEMMs against a GEMM per expert, the load-balancing loss by hand, and the gradient the pipeline executor
back-propagates against autograd of the training loss the config documents. (Against transformers' Mixtral,
Qwen3-MoE and OLMoE: test_hf_moe.py; layouts against one rank: test_layout_invariance.py; one compiled graph per
block: test_kernels.py.)"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks

from loom.engine.config import ConfigError, ModelConfig
from loom.engine.model.gpt import GPTModel
from loom.engine.model.moe import grouped_matmul, load_balancing_loss
from loom.engine.parallel.sharding import initialize_parameters


@pytest.mark.parametrize("width", [16, 6], ids=["grouped-kernel", "a-gemm-per-expert"])
def test_grouped_expert_gemms_equal_a_gemm_per_expert_with_an_expert_that_gets_no_token(width):
    """Rows 16-byte aligned take torch._grouped_mm, the others a GEMM per expert: both give each expert's rows
    times its weight, forward and backward, and nothing (a zero gradient) to an expert no token chose."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, width, generator=generator, requires_grad=True)
    weight = torch.randn(3, width, 8, generator=generator, requires_grad=True)
    ends = torch.tensor([3, 3, 10], dtype=torch.int32)
    out = grouped_matmul(x, weight, ends)
    grad = torch.randn(out.shape, generator=generator)
    out.backward(grad)
    x2, weight2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    expected = torch.cat([x2[:3] @ weight2[0], x2[3:3] @ weight2[1], x2[3:] @ weight2[2]])
    expected.backward(grad)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weight.grad, weight2.grad)
    torch.testing.assert_close(x.grad, x2.grad)
    assert not weight.grad[1].any()


def test_the_router_z_loss_is_st_moe_s_by_hand():
    """The mean over tokens of logsumexp(logits)^2: logits (0, 0) give ln 2, (ln 3, 0) give ln 4."""
    from loom.engine.model.moe import router_z_loss

    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2, rel=1e-6)


def test_the_load_balancing_loss_is_switch_transformer_s_per_sequence_by_hand():
    """Per sequence: num_experts / top_k x sum_i (share of the token choices expert i got) x (its mean probability),
    then the mean over the sequences."""
    first = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])  # top-1: experts 0, 0, 1, 0
    even = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])  # choices 0, 1, 0, 1 below: balanced
    probabilities = torch.stack([first, even], dim=1)  # [s, b, experts]
    chosen = torch.stack([torch.tensor([0, 0, 1, 0]), torch.tensor([0, 1, 0, 1])], dim=1)[..., None]
    # first: 2 x (3/4 x 0.65 + 1/4 x 0.35) = 1.15; even: 2 x (1/2 x 1/2 x 2) = 1
    assert load_balancing_loss(probabilities, chosen, 2).item() == pytest.approx((1.15 + 1.0) / 2, rel=1e-6)
    # top-2 of 2 experts: every token chooses both, 1 whatever the probabilities
    both = torch.tensor([[0, 1]] * 4)[:, None, :]
    assert load_balancing_loss(first[:, None], both, 2).item() == pytest.approx(1.0, rel=1e-6)


MODEL = dict(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=96, num_experts=4)
COEFF = 0.5  # large, so that a wrong weight of the loss shows in every gradient
Z_COEFF = 0.05


def _executor_gradients(rank, world):
    from loom.engine.parallel.state import ParallelState
    from loom.engine.pipeline.executor import PipelineExecutor
    from loom.engine.pipeline.schedules import build_schedule

    config = ModelConfig(**MODEL, moe_aux_loss_coeff=COEFF, moe_z_loss_coeff=Z_COEFF)
    model, twin = GPTModel(config, None), GPTModel(config, None)
    for m in (model, twin):
        initialize_parameters(m, seed=3, tp_rank=0, tp_size=1)
    state = ParallelState.create(tp=1, dp=1)
    generator = torch.Generator().manual_seed(1)
    microbatches = [(torch.randint(0, 96, (2, 16), generator=generator),) * 2 for _ in range(3)]
    microbatches = [(tokens, torch.roll(tokens, -1, dims=1)) for tokens, _ in microbatches]
    executor = PipelineExecutor(
        [model], state, (16, 2, 32), torch.device("cpu"), contextlib.nullcontext, torch.float32, router_losses=True
    )
    tokens_in_batch = 3 * 2 * 16
    executor.run(build_schedule(0, 1, 1, 3, False), microbatches, tokens_in_batch)
    # the documented loss: the mean over the batch's tokens of the cross entropy, plus COEFF x the mean over its
    # sequences of each block's load-balancing loss summed over the blocks, plus Z_COEFF x the mean over its tokens of
    # each block's logsumexp(router logits)^2 summed over the blocks, both written here from each block's MLP input
    # (the twin's own losses have a gradient of 0: their weight is never filled in)
    mlp_inputs = []
    for block in twin.layers.values():
        block.mlp.register_forward_pre_hook(lambda module, args: mlp_inputs.append((module, args[0])))
    losses, balance, z = [], [], []
    for tokens, labels in microbatches:
        mlp_inputs.clear()
        losses.append(twin(tokens, labels).sum())
        for mlp, x in mlp_inputs:  # x [s, b, h]
            logits = x @ mlp.router.weight.t()
            z.append((logits.exp().sum(-1).log() ** 2).sum())
            probabilities = logits.softmax(-1)
            chosen = probabilities.topk(2, dim=-1).indices
            for sequence in range(x.shape[1]):
                share = F.one_hot(chosen[:, sequence], 4).sum((0, 1)) / (16 * 2)  # of the sequence's choices
                balance.append(4 * (share * probabilities[:, sequence].mean(0)).sum())
    (sum(losses) / tokens_in_batch + COEFF * sum(balance) / 6 + Z_COEFF * sum(z) / tokens_in_batch).backward()
    return (
        [(name, p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), twin.parameters())],
        {name: float(value) for name, value in executor.router_loss_sums.items()},
        {"moe_aux_loss": float(sum(balance) / 6), "moe_z_loss": float(sum(z) / tokens_in_batch)},
    )


def test_the_executor_back_propagates_the_documented_training_loss():
    """Every parameter's gradient after the pipeline executor's step equals autograd's of the training loss
    model.moe_aux_loss_coeff and model.moe_z_loss_coeff document, and the logged losses are their means per sequence
    (summed over the blocks) and per token."""
    gradients, logged, expected = run_ranks(_executor_gradients, 1)[0]
    assert logged == pytest.approx(expected, rel=1e-6) and logged["moe_aux_loss"] > 1.0
    for name, ours, theirs in gradients:
        torch.testing.assert_close(torch.as_tensor(ours), torch.as_tensor(theirs), rtol=1e-5, atol=1e-8, msg=name)


def test_a_router_far_from_uniform_weighs_a_token_s_experts_by_their_renormalised_probabilities():
    """One block's MLP against a reference written per token: softmax over the router's logits, the top k,
    renormalised (or not), each chosen expert's SwiGLU MLP weighted by it."""
    for norm_top_k in (True, False):
        config = ModelConfig(**MODEL, moe_top_k=2, moe_norm_top_k=norm_top_k)
        model = GPTModel(config, None)
        initialize_parameters(model, seed=5, tp_rank=0, tp_size=1)
        mlp = model.layers["0"].mlp
        with torch.no_grad():
            mlp.router.weight.mul_(50)
        x = torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ours = mlp(x)[:, 0]
            expected = []
            for token in x[:, 0]:
                probabilities = (mlp.router.weight @ token).softmax(-1)
                weights, chosen = probabilities.topk(2)
                weights = weights / weights.sum() if norm_top_k else weights
                out = torch.zeros(32)
                for weight, expert in zip(weights, chosen):
                    gate, up = (mlp.experts.fc1.weight[expert] @ token).chunk(2)
                    out += weight * (mlp.experts.fc2.weight[expert] @ (F.silu(gate) * up))
                expected.append(out)
        torch.testing.assert_close(ours, torch.stack(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"moe_top_k": 1}, "model.moe_top_k is set but model.num_experts is not"),
        ({"num_experts": 2, "moe_top_k": 3}, "model.moe_top_k = 3 sends each token to more experts than"),
        ({"num_experts": 0}, "model.num_experts must be positive"),
        ({"num_experts": 4, "moe_aux_loss_coeff": float("nan")}, "model.moe_aux_loss_coeff must be a number >= 0"),
        ({"num_experts": 4, "moe_aux_loss_coeff": -1.0}, "model.moe_aux_loss_coeff must be a number >= 0"),
        ({"num_experts": 4, "moe_z_loss_coeff": float("inf")}, "model.moe_z_loss_coeff must be a number >= 0"),
        ({"moe_z_loss_coeff": 0.001}, "model.moe_z_loss_coeff is set but model.num_experts is not"),
        ({"num_experts": 4, "bias": True}, "loom's experts have no biases"),
        ({"num_experts": 4, "moe_top_k": 1}, "the router would learn nothing from the loss"),
        ({"num_experts": 4, "moe_expert_bias": True}, "model.moe_expert_bias biases sigmoid scores"),
        ({"num_experts": 4, "moe_router_scale": 0.0}, "model.moe_router_scale must be a number > 0"),
        ({"num_experts": 4, "moe_expert_bias_rate": float("nan")}, "model.moe_expert_bias_rate must be a number >= 0"),
        ({"moe_router_score": "sigmoid"}, "model.moe_router_score is set but model.num_experts is not"),
        ({"num_experts": 4, "moe_dense_layers": 2}, r"model.moe_dense_layers = 2 must be from 0 to .* = 1"),
        ({"num_experts": 4, "moe_ffn_hidden_size": -8}, "model.moe_ffn_hidden_size must be positive"),
        ({"num_experts": 4, "moe_router_groups": 0}, "model.moe_router_groups must be positive"),
        ({"num_experts": 4, "moe_router_groups": 3}, "does not divide model.num_experts = 4 into equal groups"),
        ({"num_experts": 4, "moe_router_group_top_k": 2}, "give the number of groups too"),
        ({"num_experts": 4, "moe_router_groups": 2}, "needs model.moe_router_group_top_k"),
        ({"num_experts": 4, "moe_router_groups": 2, "moe_router_group_top_k": 3}, "must be at most"),
        ({"num_experts": 8, "moe_top_k": 4, "moe_router_groups": 4, "moe_router_group_top_k": 1}, "do not fit"),
        ({"moe_router_fp32": True}, "model.moe_router_fp32 is set but model.num_experts is not"),
    ],
)
def test_settings_a_mixture_of_experts_cannot_take_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**MODEL, "num_experts": None, **fields})


def test_a_checkpoint_from_before_experts_is_another_model_than_a_mixture_of_experts(tmp_path):
    """A checkpoint whose config predates model.num_experts is a dense model: loading it into a mixture of experts
    is refused as another model, naming the setting (before, the refusal came from the tensors, later)."""
    from loom.engine.checkpoint.format import CheckpointError
    from loom.engine.checkpoint.saved_settings import check_same_model
    from loom.engine.config_io import config_to_dict, load_config

    saved = config_to_dict(load_config("tiny"))
    del saved["model"]["num_experts"]
    with pytest.raises(CheckpointError, match="model.num_experts = None there, 4 here"):
        check_same_model(tmp_path, saved, load_config("tiny", {"model": {"num_experts": 4}}))
    # nor is one from before shared experts another model's with one (its tensors would be left unloaded)
    experts = config_to_dict(load_config("tiny", {"model": {"num_experts": 4}}))
    del experts["model"]["moe_shared_ffn_hidden_size"], experts["model"]["moe_shared_expert_gate"]
    shared = {"num_experts": 4, "moe_shared_ffn_hidden_size": 64, "moe_shared_expert_gate": True}
    with pytest.raises(CheckpointError, match="model.moe_shared_ffn_hidden_size = None there, 64 here"):
        check_same_model(tmp_path, experts, load_config("tiny", {"model": shared}))
    # nor one from before dense blocks and experts' own width another model's with them
    del experts["model"]["moe_ffn_hidden_size"], experts["model"]["moe_dense_layers"]
    split = {"num_experts": 4, "moe_dense_layers": 1, "moe_ffn_hidden_size": 128}
    with pytest.raises(CheckpointError, match="moe_ffn_hidden_size = None there, 128 here, model.moe_dense_layers = 0"):
        check_same_model(tmp_path, experts, load_config("tiny", {"model": split}))


def test_sigmoid_routing_with_experts_biases_and_a_scale_is_megatron_core_s():
    """model.moe_router_score = sigmoid with model.moe_expert_bias and model.moe_router_scale: each token's weights
    per expert are megatron-core's topk_routing_with_score_function's (the bias chooses the experts but does not
    weigh them; renormalised; scaled), the block's output its experts' outputs so weighted; the load-balancing loss
    takes megatron-core's compute_routing_scores_for_aux_loss scores and choices, per sequence."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    config = ModelConfig(**MODEL, moe_router_score="sigmoid", moe_router_scale=2.5, moe_expert_bias=True)
    model = GPTModel(config, None)
    initialize_parameters(model, seed=5, tp_rank=0, tp_size=1)
    mlp = model.layers["0"].mlp
    s, b = 6, 2
    x = torch.randn(s, b, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mlp.router.weight.mul_(20)
        mlp.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
        ours = mlp(x).reshape(-1, 32)
        tokens = x.reshape(-1, 32)  # token t of sequence t % b
        logits = tokens @ mlp.router.weight.t()
        weights, chosen = moe_utils.topk_routing_with_score_function(
            logits, 2, score_function="sigmoid", expert_bias=mlp.router.expert_bias, scaling_factor=2.5
        )
        unbiased = moe_utils.topk_routing_with_score_function(logits, 2, score_function="sigmoid")[1]
        assert not torch.equal(chosen, unbiased)  # the bias changed some token's experts
        expected = _weighted_experts(mlp, tokens, weights)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    megatron_loss = _megatron_sequence_aux_loss(moe_utils, logits, 2, "sigmoid", b)
    assert mlp.router_losses["moe_aux_loss"].item() == pytest.approx(megatron_loss, rel=1e-6)


def _weighted_experts(mlp, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's SwiGLU experts' outputs weighted by `weights` [tokens, experts] (zero for those not chosen)."""
    expected = torch.zeros_like(tokens)
    for expert in range(weights.shape[1]):
        gate, up = (tokens @ mlp.experts.fc1.weight[expert].t()).chunk(2, dim=-1)
        expected += weights[:, expert : expert + 1] * ((F.silu(gate) * up) @ mlp.experts.fc2.weight[expert].t())
    return expected


def _megatron_sequence_aux_loss(moe_utils, logits: torch.Tensor, top_k: int, score: str, b: int) -> float:
    """Megatron's load-balancing loss over each sequence's tokens (its seq_aux_loss; token t of sequence t % b), from
    compute_routing_scores_for_aux_loss's choices and scores, averaged over the b sequences."""
    choices, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, top_k, score)
    experts, s = logits.shape[1], logits.shape[0] // b
    per_sequence = [experts / (s * top_k) * (choices[j::b].sum(0) * scores[j::b].mean(0)).sum() for j in range(b)]
    return sum(per_sequence).item() / b


@pytest.mark.parametrize("score, norm_top_k", [("softmax", False), ("softmax", True), ("sigmoid", True)])
def test_group_limited_routing_is_megatron_core_s(score, norm_top_k):
    """model.moe_router_groups / moe_router_group_top_k: 8 experts in 4 groups, each token's 4 experts from its 2
    groups of highest top-2 sum, against megatron-core's topk_routing_with_score_function (softmax: the scores
    not renormalised, Megatron's pre-softmax, or renormalised, the groups then scored by their logits; sigmoid:
    with biases, renormalised, scaled), the block's output its experts' outputs so weighted; the load-balancing
    loss takes megatron-core's ungrouped scores and choices."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    sigmoid = score == "sigmoid"
    routing = {"moe_router_score": score, "moe_expert_bias": sigmoid, "moe_router_scale": 2.5 if sigmoid else 1.0}
    groups = {"moe_router_groups": 4, "moe_router_group_top_k": 2}
    config = ModelConfig(**{**MODEL, "num_experts": 8}, moe_top_k=4, moe_norm_top_k=norm_top_k, **routing, **groups)
    model = GPTModel(config, None)
    initialize_parameters(model, seed=5, tp_rank=0, tp_size=1)
    mlp = model.layers["0"].mlp
    s, b = 8, 2
    x = torch.randn(s, b, 32, generator=torch.Generator().manual_seed(2))
    bias = torch.tensor([0.3, -0.2, 0.0, 0.1, 0.05, -0.1, 0.2, 0.0]) if sigmoid else None
    with torch.no_grad():
        mlp.router.weight.mul_(20)
        if sigmoid:
            mlp.router.expert_bias.copy_(bias)
        ours = mlp(x).reshape(-1, 32)
        tokens = x.reshape(-1, 32)
        logits = tokens @ mlp.router.weight.t()
        megatron = dict(score_function=score, expert_bias=bias, scaling_factor=2.5 if sigmoid else None)
        megatron["use_pre_softmax"] = not norm_top_k
        weights, chosen = moe_utils.topk_routing_with_score_function(logits, 4, num_groups=4, group_topk=2, **megatron)
        ungrouped = moe_utils.topk_routing_with_score_function(logits, 4, **megatron)[1]
        assert not torch.equal(chosen, ungrouped)  # the groups changed some token's experts
        expected = _weighted_experts(mlp, tokens, weights)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    megatron_loss = _megatron_sequence_aux_loss(moe_utils, logits, 4, score, b)
    assert mlp.router_losses["moe_aux_loss"].item() == pytest.approx(megatron_loss, rel=1e-6)


def test_an_fp32_router_computes_its_logits_from_bf16_inputs_in_fp32():
    """model.moe_router_fp32: in a bf16 model the router's logits (seen through the z-loss, the mean of their
    logsumexp squared) are the fp32 product of the bf16 tokens and the router's weight; without it, bf16's."""
    z_loss = {}
    for fp32 in (True, False):
        config = ModelConfig(**MODEL, moe_z_loss_coeff=1.0, moe_router_fp32=fp32)
        model = GPTModel(config, None)
        initialize_parameters(model, seed=5, tp_rank=0, tp_size=1)
        mlp = model.layers["0"].mlp.to(torch.bfloat16)
        x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        with torch.no_grad():
            mlp.router.weight.mul_(7)
            mlp(x)
        z_loss[fp32] = mlp.router_losses["moe_z_loss"].item()
    logits = x.reshape(-1, 32).float() @ mlp.router.weight.float().t()
    reference = torch.logsumexp(logits, -1).square().mean().item()
    assert z_loss[True] == pytest.approx(reference, rel=1e-6)
    assert z_loss[False] != pytest.approx(reference, rel=1e-4)


BIASED = {"num_experts": 4, "moe_router_score": "sigmoid", "moe_expert_bias": True, "moe_expert_bias_rate": 0.01}


def _biased_runs(rank, world, dataset, run_dir):
    """dp 2: each step's bias against the rule worked out here from the step's loads (summed over the two ranks
    here); a checkpoint at step 2, resumed under pp 2, holds each block's biases by name and trains on as the
    dp 2 run did."""
    import torch.distributed as dist
    from training_runs import tiny_config

    from loom.engine.model.moe import expert_biases
    from loom.engine.train import Trainer

    train = {"steps": 4, "global_batch_size": 4, "micro_batch_size": 1, "seq_length": 32}

    def trainer(parallel):
        return Trainer(tiny_config(dataset, run_dir, model=BIASED, parallel=parallel, train=train))

    run, losses, expected_load_sum = trainer({"dp": 2}), [], 4 * 32 * 2  # the batch's tokens x top 2
    counted = {}  # each block's load worked out here from what enters its MLP: sigmoid(x . router) + bias, top 2

    def count(name, mlp, args, output):
        scores = (args[0].reshape(-1, 128) @ mlp.router.weight.t()).sigmoid() + mlp.router.expert_bias
        counted[name] = counted.get(name, 0) + F.one_hot(scores.topk(2).indices, 4).sum((0, 1))

    for name, mlp in run.chunks[0].named_modules():
        if hasattr(mlp, "has_expert_bias"):
            mlp.register_forward_hook(lambda module, args, output, name=name: count(name, module, args, output))
    for step in range(4):
        before = {name: bias.clone() for name, bias in expert_biases(run.chunks).items()}
        counted.clear()
        losses.append(run.train_step()["loss"])
        for name, bias in expert_biases(run.chunks).items():
            load = run.executor.expert_loads[name.removesuffix(".router.expert_bias")].clone()
            assert torch.equal(load, counted[name.removesuffix(".router.expert_bias")])
            dist.all_reduce(load)
            assert load.sum().item() == expected_load_sum
            mean = load.sum().item() / 4
            moved = [0.01 if count < mean else -0.01 if count > mean else 0.0 for count in load.tolist()]
            assert torch.equal(bias, before[name] + torch.tensor(moved)), (step, name, bias, before[name], load)
        if step == 1:
            run.save()
            saved = {name: bias.clone() for name, bias in expert_biases(run.chunks).items()}
    run.close()
    resumed = trainer({"pp": 2})
    assert resumed.step == 2
    here = expert_biases(resumed.chunks)
    assert len(here) == resumed.config.model.num_layers // 2  # this stage's blocks
    assert all(torch.equal(bias, saved[name]) for name, bias in here.items())
    resumed_losses = [resumed.train_step()["loss"] for _ in range(2)]
    resumed.close()
    return losses, resumed_losses, saved


def test_experts_biases_move_towards_balance_and_resume_from_a_checkpoint_under_another_layout(dataset, tmp_path):
    from loom.engine.checkpoint.format import read_metadata
    from loom.engine.checkpoint.load import PieceReader
    from loom.tools.ckpt import inspect, reshard

    losses, resumed, saved = run_ranks(_biased_runs, 2, dataset, str(tmp_path))[0]
    assert any(bias.abs().sum() > 0 for bias in saved.values())
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
    # `loom ckpt reshard` carries them: one copy in the file of TP rank 0 of the stage that holds the block
    resharded = reshard(tmp_path / "checkpoints", tmp_path / "resharded", tp=2, pp=2)
    metadata = read_metadata(resharded)
    for name, bias in saved.items():
        stage = int(name.split(".")[1]) // 2
        assert metadata.index[f"buffer/{name}"] == f"rank{stage * 2:05d}.safetensors"
        assert torch.equal(PieceReader(resharded, metadata).tensor(f"buffer/{name}"), bias)
    # and `loom ckpt inspect` lists them after the parameters
    listed = inspect(resharded).splitlines()
    assert listed[-len(saved) :] == [f"{name:48} {'(4,)':>18} {'(buffer)':>12}  -" for name in sorted(saved)]

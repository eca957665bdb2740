"""Per-rank random streams: dropout masks are replayed exactly by activation recompute, and the
tensor-parallel stream differs across TP ranks while the replicated one does not."""

import pytest
import torch
import torch.nn.functional as F

from loom.engine.config import ModelConfig
from loom.engine.model.gpt import GPTModel
from loom.engine.parallel.random import RNGStreams
from loom.engine.parallel.sharding import initialize_parameters


def _loss_and_grads(recompute: str):
    config = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=50, dropout=0.2, recompute=recompute)
    model = GPTModel(config, None, streams=RNGStreams(seed=5, tp_rank=0, device=torch.device("cpu")))
    initialize_parameters(model, seed=1, tp_rank=0, tp_size=1)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_replays_dropout_masks(recompute):
    loss, grads = _loss_and_grads("none")
    loss_r, grads_r = _loss_and_grads(recompute)
    assert loss == loss_r
    for g, h in zip(grads, grads_r, strict=True):
        assert torch.allclose(g, h, atol=1e-6)


def test_the_embedding_output_is_dropped_on_the_replicated_stream_as_megatron_does():
    """megatron-core's LanguageModelEmbedding drops its output at --hidden-dropout on the default generator without
    sequence parallelism, the one Megatron seeds with the run's seed (+ 100 x the pipeline rank): loom's replicated
    stream. Evaluation drops nothing."""
    config = ModelConfig(num_layers=1, hidden_size=32, num_heads=4, vocab_size=50, dropout=0.3)
    model = GPTModel(config, None, streams=RNGStreams(seed=5, tp_rank=0, device=torch.device("cpu")))
    initialize_parameters(model, seed=1, tp_rank=0, tp_size=1)
    into_first_block = []
    model.layers["0"].register_forward_pre_hook(lambda module, args: into_first_block.append(args[0].detach()))
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:])
    model.eval()
    model(tokens[:, :-1], tokens[:, 1:])
    embedded = model.embed(tokens[:, :-1]).detach()
    torch.manual_seed(5)
    assert torch.equal(into_first_block[0], F.dropout(embedded, 0.3))
    assert (into_first_block[0] == 0).float().mean().item() == pytest.approx(0.3, abs=0.05)
    assert torch.equal(into_first_block[1], embedded)


def test_dropout_is_active_and_streams_advance():
    streams = RNGStreams(seed=5, tp_rank=0, device=torch.device("cpu"))
    with streams.fork("tensor"):
        first = torch.rand(4)
    with streams.fork("tensor"):
        second = torch.rand(4)
    assert not torch.equal(first, second)


def test_tensor_stream_differs_per_tp_rank_replicated_does_not():
    draws = {}
    for rank in (0, 1):
        streams = RNGStreams(seed=5, tp_rank=rank, device=torch.device("cpu"))
        outside = torch.get_rng_state()
        with streams.fork("tensor"):
            tensor = torch.rand(4)
        with streams.fork("replicated"):
            replicated = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), outside), "forking must not disturb the default generator"
        draws[rank] = (tensor, replicated)
    assert not torch.equal(draws[0][0], draws[1][0])
    assert torch.equal(draws[0][1], draws[1][1])


def test_each_pipeline_stage_draws_its_own_masks():
    draws = []
    for pp_rank in (0, 1):
        streams = RNGStreams(seed=5, tp_rank=0, device=torch.device("cpu"), pp_rank=pp_rank)
        with streams.fork("replicated"):
            replicated = torch.rand(4)
        with streams.fork("tensor"):
            tensor = torch.rand(4)
        draws.append((replicated, tensor))
    assert not torch.equal(draws[0][0], draws[1][0]) and not torch.equal(draws[0][1], draws[1][1])


@pytest.mark.parametrize("tp_rank, pp_rank", [(0, 0), (1, 0), (0, 3), (2, 1)])
def test_stream_seeds_are_megatrons(monkeypatch, tp_rank, pp_rank):
    """megatron-core seeds the tensor stream in model_parallel_cuda_manual_seed (recorded here without CUDA);
    megatron/training's _set_random_seed first adds 100 x the pipeline rank to the run's seed."""
    megatron_random = pytest.importorskip("megatron.core.tensor_parallel.random", reason="megatron-core is absent")
    recorded = {}
    monkeypatch.setattr(megatron_random.torch.cuda, "manual_seed", lambda seed: recorded.setdefault("default", seed))
    monkeypatch.setattr(
        megatron_random.CudaRNGStatesTracker, "add", lambda self, name, seed: recorded.setdefault(name, seed)
    )
    run_seed = 1234
    megatron_random.model_parallel_cuda_manual_seed(run_seed + 100 * pp_rank, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    ours = RNGStreams(seed=run_seed, tp_rank=tp_rank, device=torch.device("cpu"), pp_rank=pp_rank).seeds
    assert ours == {"replicated": recorded["default"], "tensor": recorded["model-parallel-rng"]}

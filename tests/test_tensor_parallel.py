"""Tensor-parallel layers, vocab-parallel cross entropy and sequence parallelism against a dense model.

Each rank builds the same model twice from the same seed: once dense (no TP group, the
reference) and once sharded over the TP group; losses and every gradient (unsharded through the
parameters' ShardSpec) must agree within 1e-5.
"""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from loom.engine.config import ModelConfig
from loom.engine.model.gpt import GPTModel
from loom.engine.optim.model_parallel_grads import counted_once, sum_model_parallel_grads
from loom.engine.parallel import sharding
from loom.engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from loom.engine.parallel.param_info import param_info, update_param_info
from loom.engine.parallel.sharding import ShardSpec, initialize_parameters, make_parameter
from loom.engine.parallel.state import ParallelState

SEQ, BATCH = 8, 3


def small_config(**overrides) -> ModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=48,
        vocab_size=101,
        make_vocab_divisible_by=8,
        max_position_embeddings=SEQ,
    )
    base.update(overrides)
    return ModelConfig(**base)


def _loss_and_grads(model: GPTModel, tokens, labels):
    loss = model(tokens, labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compare_with_dense(rank, world, config_kwargs, sequence_parallel):
    torch.manual_seed(0)
    config = small_config(**config_kwargs)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    labels = torch.randint(0, config.vocab_size, (BATCH, SEQ))

    dense = GPTModel(config, None)
    initialize_parameters(dense, seed=7, tp_rank=0, tp_size=1)
    dense_loss, dense_grads = _loss_and_grads(dense, tokens, labels)
    dense_grads = {n: param_info(p).shard_spec.unshard([dense_grads[n]]) for n, p in dense.named_parameters()}

    state = ParallelState.create(tp=world, dp=1)
    tp_group = state.tp_group
    sharded = GPTModel(config, tp_group, sequence_parallel=sequence_parallel)
    initialize_parameters(sharded, seed=7, tp_rank=rank, tp_size=world)
    loss, _ = _loss_and_grads(sharded, tokens, labels)
    params = list(sharded.parameters())
    sum_model_parallel_grads(params, state)

    worst = {"loss": (loss - dense_loss).abs().item() / dense_loss.abs().item()}
    # Replicated parameters must be counted once, sharded ones by every rank.
    dense_norm = torch.cat([g.reshape(-1) for g in dense_grads.values()]).norm().item()
    squares = sum(p.grad.pow(2).sum() for p in params if counted_once(p, rank))
    dist.all_reduce(squares)
    worst["grad_norm"] = abs(squares.sqrt().item() - dense_norm) / dense_norm
    for name, param in sharded.named_parameters():
        shards = [torch.empty_like(param.grad) for _ in range(world)]
        dist.all_gather(shards, param.grad.contiguous())
        full = param_info(param).shard_spec.unshard(shards)
        worst[name] = (full - dense_grads[name]).abs().max().item()
    return worst


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "variant",
    [
        dict(config={}, sp=False),
        dict(config={}, sp=True),
        dict(
            config=dict(
                norm="layernorm",
                activation="gelu",
                position_embedding="learned",
                bias=True,
                tie_embeddings=True,
                num_kv_heads=8,
            ),
            sp=True,
        ),
        # Qwen's pieces: query/key norms (shared by the heads of every TP rank: their gradients sum over TP without
        # sequence parallelism too), biases on QKV alone, heads of 12 where 64 / 8 is 8; half of each turned by RoPE;
        # Granite's multipliers (the embeddings after their TP all-reduce, the logits of each vocabulary shard)
        dict(
            config=dict(
                qk_norm=True,
                qkv_bias=True,
                head_dim=12,
                rotary_percent=0.5,
                embedding_multiplier=3.0,
                residual_multiplier=0.5,
                attention_scale=0.2,
                logits_divisor=2.0,
            ),
            sp=False,
        ),
        # OLMo 2's: norms on attention's and the MLP's outputs (sequence-sharded under sequence parallelism), query
        # and key norms across all heads (weights split with the heads, sums of squares summed over TP both ways)
        dict(config=dict(norm_placement="output", qk_norm=True, qk_norm_per_head=False), sp=True),
        # Nemotron-4's: LayerNorm, a squared-ReLU MLP, no linear biases, half of each head rotated
        dict(config=dict(norm="layernorm", activation="squared_relu", rotary_percent=0.5), sp=True),
        # Gemma 3's: a gated GELU, sandwich norms (four a block, sequence-sharded under sequence parallelism), a
        # window of 3 in the first layer (of 8 positions) and full attention in the second, each with its own RoPE
        dict(
            config=dict(
                activation="geglu",
                norm_placement="both",
                qk_norm=True,
                sliding_window=3,
                full_attention_interval=2,
                rope_local_theta=100.0,
                embedding_multiplier=8.0,
            ),
            sp=True,
        ),
        # Gemma 2's: soft-capped scores (loom's own attention, windowed in the first layer) and logits (each rank's
        # vocabulary shard capped before the vocabulary-parallel loss)
        dict(
            config=dict(
                activation="geglu",
                norm_placement="both",
                sliding_window=3,
                full_attention_interval=2,
                attention_softcap=0.5,
                logits_softcap=0.3,
                attention_scale=1.0,
            ),
            sp=False,
        ),
    ],
    ids=["llama", "llama-sp", "gpt2-sp", "qwen", "olmo2-sp", "nemotron-sp", "gemma3-sp", "gemma2"],
)
def test_tp_model_matches_dense(tp, variant):
    results = run_ranks(_compare_with_dense, tp, variant["config"], variant["sp"])
    for worst in results:
        assert worst.pop("loss") < 1e-5
        bad = {k: v for k, v in worst.items() if v > 1e-5}
        assert not bad, f"gradients differ from the dense model: {bad}"


def _cross_entropy_ranks(rank, world, logits, target, vocab_size, chunk_elements):
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        local, target, rank * local.shape[-1], vocab_size, dist.group.WORLD, chunk_elements
    )
    (loss * torch.arange(1.0, loss.numel() + 1).view_as(loss)).sum().backward()  # a different weight per token
    return loss.detach(), local.grad


@pytest.mark.parametrize(
    "tp, padded, chunk_elements",
    [(1, 16, 1 << 24), (2, 16, 1 << 24), (4, 16, 1 << 24), (2, 16, 20), (4, 32, 1)],
    ids=["tp1", "tp2", "tp4", "tp2-chunks-of-2-tokens", "tp4-one-rank-all-padding-chunks-of-1"],
)
def test_vocab_parallel_cross_entropy_excludes_padding(tp, padded, chunk_elements):
    torch.manual_seed(1)
    vocab = 13
    logits = torch.randn(5, 2, padded) * 4
    logits[..., vocab:] = 50.0  # would dominate the softmax if padding leaked into it
    target = torch.randint(0, vocab, (5, 2))
    reference = logits[..., :vocab].clone().requires_grad_()
    expected = F.cross_entropy(reference.reshape(-1, vocab), target.reshape(-1), reduction="none").view(5, 2)
    (expected * torch.arange(1.0, 11).view(5, 2)).sum().backward()
    results = run_ranks(_cross_entropy_ranks, tp, logits, target, vocab, chunk_elements)
    grad = torch.cat([g for _, g in results], dim=-1)
    for loss, _ in results:
        assert torch.allclose(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert torch.allclose(grad[..., :vocab], reference.grad, atol=1e-5, rtol=1e-6)
    assert torch.all(grad[..., vocab:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_loss_kernels_give_f_cross_entropy(dtype):
    """model.compile's loss: each chunk's passes are inductor kernels (the gradient one element-wise expression
    written in place); chunks of 3 tokens with a shorter last one, padding that would dominate if it leaked."""
    torch.manual_seed(3)
    vocab, padded = 13, 16
    logits = torch.randn(7, 2, padded) * 4
    logits[..., vocab:] = 50.0
    target = torch.randint(0, vocab, (7, 2))
    reference = logits[..., :vocab].to(dtype).clone().requires_grad_()
    expected = F.cross_entropy(reference.float().reshape(-1, vocab), target.reshape(-1), reduction="none")
    (expected * torch.arange(1.0, 15)).sum().backward()
    ours = logits.to(dtype).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(ours, target, 0, vocab, None, chunk_elements=3 * padded, compiled=True)
    (loss.reshape(-1) * torch.arange(1.0, 15)).sum().backward()
    torch.testing.assert_close(loss.reshape(-1), expected.detach(), rtol=1e-6, atol=1e-5)
    rounding = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(ours.grad[..., :vocab].float(), reference.grad.float(), rtol=rounding, atol=1e-5)
    assert torch.all(ours.grad[..., vocab:] == 0)


def _bf16_cross_entropy(rank, world, logits, target, vocab_size):
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, rank * local.shape[-1], vocab_size, dist.group.WORLD)
    loss.mean().backward()
    return loss.detach(), local.grad.float()  # (bf16 values, exactly; numpy has no bf16 to carry them)


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_logits_give_f_cross_entropy_to_bf16_rounding(tp):
    """The loss is fp32 arithmetic on the bf16 logits (F.cross_entropy of them upcast, to fp32 rounding); the
    gradient is written in bf16 over the logits, so it equals the reference's to one bf16 rounding."""
    torch.manual_seed(2)
    vocab = 1000
    logits = (torch.randn(64, 2, 1024) * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (64, 2))
    reference = logits[..., :vocab].clone().requires_grad_()
    expected = F.cross_entropy(reference.float().reshape(-1, vocab), target.reshape(-1), reduction="none")
    expected.mean().backward()
    results = run_ranks(_bf16_cross_entropy, tp, logits, target, vocab)
    grad = torch.cat([g for _, g in results], dim=-1)
    for loss, _ in results:
        torch.testing.assert_close(loss.reshape(-1), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad[..., :vocab].float(), reference.grad.float(), rtol=2**-7, atol=1e-9)
    assert torch.all(grad[..., vocab:] == 0)


def _mappings_traced_and_eager(rank, world):
    """Each mapping's output and input gradient, by the c10d collectives (eager) and by the functional ones (what
    torch.compile traces: is_compiling patched true, c10d's made to fail)."""
    from contextlib import ExitStack
    from unittest import mock

    from loom.engine.parallel import mappings

    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 2, 6, generator=generator)  # [sequence, batch, hidden]
    names = [
        "copy_to_tensor_region",
        "reduce_from_tensor_region",
        "scatter_to_tensor_region",
        "gather_from_tensor_region",
        "scatter_to_sequence_region",
        "gather_from_sequence_region",
        "reduce_scatter_to_sequence_region",
    ]
    results = {}
    for traced in (False, True):
        with ExitStack() as patches:
            if traced:
                patches.enter_context(mock.patch.object(torch.compiler, "is_compiling", return_value=True))
                refuse = mock.Mock(side_effect=AssertionError("an in-place c10d collective while traced"))
                for target, name in ((dist, "all_reduce"), (dist, "all_gather"), (mappings, "all_gather_single")):
                    patches.enter_context(mock.patch.object(target, name, refuse))
                patches.enter_context(mock.patch.object(mappings, "reduce_scatter_single", refuse))
            for name in names:
                given = x.clone().requires_grad_()
                out = getattr(mappings, name)(given, group)
                out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(rank + 7)))
                results[name, traced] = (out.detach(), given.grad)
    return {
        name: [(a - b).abs().max().item() for a, b in zip(results[name, False], results[name, True])] for name in names
    }


def test_the_collectives_torch_compile_traces_equal_the_eager_ones():
    """Compiled, the mappings use the functional collectives (torch 2.11 cut the autograd graph at the in-place
    ones: a compiled block at tp 2 got zero weight gradients); this runs that path eagerly against c10d's."""
    for differences in run_ranks(_mappings_traced_and_eager, 2):
        for name, (output, gradient) in differences.items():
            assert output < 1e-6 and gradient < 1e-6, name


def test_shard_spec_roundtrip_with_blocks_and_padding():
    spec = ShardSpec((10, 3), 0, blocks=(4, 2, 4))
    full = torch.arange(30.0).view(10, 3)
    shards = [spec.shard(full, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 3, 12, 18, 21]  # rows 0-1 of Q, row 4 of K, rows 6-7 of V
    assert torch.equal(spec.unshard(shards), full)
    padded = ShardSpec((5, 2), 0, padded_size=8)
    parts = [padded.shard(torch.ones(5, 2), r, 4) for r in range(4)]
    assert [p.sum().item() for p in parts] == [4, 4, 2, 0]
    assert torch.equal(padded.unshard(parts), torch.ones(5, 2))


INIT_SPECS = {
    "qkv blocks, rows": ShardSpec((48, 5), 0, blocks=(16, 16, 16)),
    "columns": ShardSpec((6, 40), 1),
    "padded vocabulary": ShardSpec((37, 5), 0, padded_size=40),
    "replicated": ShardSpec((9, 5)),
}


@pytest.mark.parametrize("spec", INIT_SPECS.values(), ids=INIT_SPECS.keys())
def test_every_tp_size_initialises_slices_of_the_same_tensor(spec, monkeypatch):
    # Slabs of 3 rows/columns (15 or 18 elements), so slabs straddle the boundaries of blocks and ranks.
    monkeypatch.setattr(sharding, "SLAB_ELEMENTS", 18)
    assert sharding.slab_size(spec) == 3
    full = sharding.full_init(("normal", 0.5), spec, seed=11, name="w")
    for tp in (1, 2, 4):
        if spec.dim is not None and any(block % tp for block in spec._blocks()):
            continue
        shards = []
        for rank in range(tp):
            shards.append(torch.full(spec.local_shape(tp), float("nan")))
            sharding.init_shard(shards[-1], ("normal", 0.5), spec, 11, "w", rank, tp)
            assert torch.equal(shards[-1], spec.shard(full, rank, tp))  # padding rows included (zeros)
        assert torch.equal(spec.unshard(shards), full)
    # normal(0, 0.5) values, each slab its own draw (no two slabs, or a slab and the next seed, repeat)
    assert full.unique().numel() == full.numel()
    assert abs(full.mean().item()) < 0.15 and 0.4 < full.std().item() < 0.6
    assert not torch.equal(full, sharding.full_init(("normal", 0.5), spec, seed=12, name="w"))


class LargestAllocation(TorchDispatchMode):
    """Records the number of elements of the largest tensor any operation returns."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.elements = max(self.elements, tensor.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tp4_rank_initialises_its_shard_without_the_full_tensor(dtype):
    full_shape = (4096, 512)  # 2M elements: 8 slabs; a quarter is 2 slabs
    module = torch.nn.Module()
    module.weight = make_parameter(ShardSpec(full_shape, 0, blocks=(2048, 1024, 1024)), 4, ("normal", 0.02))
    module.weight.data = module.weight.data.to(dtype)
    update_param_info(module.weight, name="layers.0.attention.qkv.weight")
    with LargestAllocation() as largest:
        initialize_parameters(module, seed=1, tp_rank=3, tp_size=4)
    shard = module.weight.numel()
    assert shard == 4096 * 512 // 4
    # a slab (2**18 elements) at a time, plus a shard-sized fp32 buffer for a bf16 parameter; never the full size
    assert largest.elements == (sharding.SLAB_ELEMENTS if dtype == torch.float32 else shard)
    full = sharding.full_init(
        ("normal", 0.02), param_info(module.weight).shard_spec, 1, "layers.0.attention.qkv.weight"
    )
    assert torch.equal(module.weight.float(), param_info(module.weight).shard_spec.shard(full, 3, 4).to(dtype).float())


PEAK_MEMORY_PROBE = """
import resource, sys
import torch
import torch.nn.functional as F
from loom.engine.parallel.cross_entropy import vocab_parallel_cross_entropy

torch.manual_seed(0)
tokens, vocab = 4096, 32768
logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_()
target = torch.randint(0, vocab, (tokens,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[1] == "loom":
    loss = vocab_parallel_cross_entropy(logits, target, 0, vocab, None)
else:  # the textbook recipe: upcast everything, let autograd keep the fp32 log-softmax
    loss = F.cross_entropy(logits.float(), target, reduction="none")
loss.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_cross_entropy_peak_memory_stays_near_the_logits_size():
    """A bf16 [4096, 32768] logits tensor is 256 MiB: the textbook recipe adds fp32 copies of it (measured
    here as peak RSS in a fresh process); the chunked one adds a few fp32 chunks and writes the gradient over
    the logits."""
    peaks = {}
    for recipe in ("loom", "textbook"):
        result = subprocess.run(
            [sys.executable, "-c", PEAK_MEMORY_PROBE, recipe], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        peaks[recipe] = int(result.stdout.strip())
    logits_bytes = 4096 * 32768 * 2
    print({k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    # fp32 chunks only: the gradient lands in the logits' own storage (measured: 132 MiB; 425 MiB when backward
    # allocated a bf16 gradient beside them)
    assert peaks["loom"] < logits_bytes
    assert peaks["textbook"] > 2 * peaks["loom"]  # measured: 1541 MiB

"""Gradient-accumulation fusion (optim.grad_accumulation_fusion, engine/parallel/grad_fusion.py): loom's linear layers
add their weight gradients into the gradient buffer in backward; the hooks' adds are skipped for them. References:
the same layers with autograd's gradients added by the hooks (the unfused path), eager and compiled."""

from __future__ import annotations

import torch
from dist_utils import run_ranks
from training_runs import tiny_config

from loom.engine.optim.grad_buffer import GradBuffer
from loom.engine.parallel import grad_fusion
from loom.engine.parallel.grad_fusion import FUSED, fusable_weights
from loom.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear


class _Mlp(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = ColumnParallelLinear(32, (48,), None, bias=True, init_std=0.2)
        self.down = RowParallelLinear(48, 32, None, bias=False, init_std=0.2)
        self.norm = torch.nn.LayerNorm(32)  # a parameter no layer fuses: the hook adds its gradient
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.2)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.nn.functional.gelu(self.up(x))))


def _accumulated(
    dtype: torch.dtype, fused: bool, compiled: bool = False, in_flight: bool = False, autocast: bool = False
) -> tuple[list[torch.Tensor], bool]:
    """Each parameter's main_grad after three micro-batches (all forwards first, as a pipeline keeps them in flight,
    if `in_flight`; fp32 inputs under bf16 autocast if `autocast`), and whether autograd's .grad was left anywhere."""
    mlp = _Mlp(dtype)
    params = list(mlp.parameters())
    buffer = GradBuffer(params, None, 1, 0, 2**20, fusable=fusable_weights([mlp]) if fused else ())
    assert {id(p) for p in buffer.fused} == ({id(mlp.up.weight), id(mlp.down.weight)} if fused else set())
    model = torch.compile(mlp) if compiled else mlp
    buffer.start_step()
    torch.manual_seed(1)
    inputs = [torch.randn(8, 2, 32, dtype=torch.float32 if autocast else dtype) for _ in range(3)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = [model(x).float().square().sum() for x in inputs] if in_flight else []
        for x in inputs if not in_flight else []:
            model(x).float().square().sum().backward()
    for loss in losses:
        loss.backward()
    buffer.finish()
    left = [p.grad is not None and p.dtype != torch.float32 for p in params]
    grads = [p.main_grad.clone() for p in params]
    buffer.remove_hooks()
    assert not any(hasattr(p, FUSED) for p in params)
    return grads, any(left)


def test_fused_layers_accumulate_what_the_hooks_would_have_added(monkeypatch):
    """bf16 parameters, fp32 buffer: on CPU the fused backward adds the same bf16 product the unfused path adds, so
    the buffers are equal bit for bit (with bf16 or, under autocast, fp32 activations); the GEMM runs once per fused
    weight per micro-batch and no .grad is left.
    fp32 parameters: the GEMM accumulates into the buffer itself (addmm_), equal to the adds up to rounding."""
    calls = []
    accumulate = grad_fusion.accumulate_weight_grad
    monkeypatch.setattr(grad_fusion, "accumulate_weight_grad", lambda *a: (calls.append(a[0].shape), accumulate(*a)))
    fused, left = _accumulated(torch.bfloat16, fused=True)
    assert len(calls) == 2 * 3 and not left
    unfused, _ = _accumulated(torch.bfloat16, fused=False)
    assert len(calls) == 2 * 3
    for a, b in zip(fused, unfused, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b) and a.abs().sum() > 0
    # fp32 activations under autocast: the weight gradient is of the input as autocast cast it for the GEMM
    for a, b in zip(
        _accumulated(torch.bfloat16, True, autocast=True)[0],
        _accumulated(torch.bfloat16, False, autocast=True)[0],
        strict=True,
    ):
        assert torch.equal(a, b)
    for a, b in zip(_accumulated(torch.float32, True)[0], _accumulated(torch.float32, False)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_accumulation_compiles_into_one_graph_and_survives_micro_batches_in_flight():
    """Compiled, the custom op mutates the buffer inside the backward graph (no break, no copy back); with three
    micro-batches' forwards before their backwards, each backward adds to a buffer the previous one changed."""
    mlp = _Mlp(torch.float32)
    buffer = GradBuffer(list(mlp.parameters()), None, 1, 0, 2**20, fusable=fusable_weights([mlp]))
    explained = torch._dynamo.explain(mlp)(torch.randn(8, 2, 32, requires_grad=True))
    buffer.remove_hooks()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    reference, _ = _accumulated(torch.float32, fused=False)
    for compiled in (False, True):
        got, _ = _accumulated(torch.float32, fused=True, compiled=compiled, in_flight=True)
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _pipeline_runs(rank, world, dataset, run_dir):
    """Losses of 3 bf16 pp2 steps (1F1B keeps micro-batches in flight) with the fusion on and off."""
    from loom.engine.train import Trainer

    out = {}
    for fusion in (True, False):
        config = tiny_config(
            dataset,
            f"{run_dir}/{fusion}",
            parallel={"pp": 2},
            optim={"grad_accumulation_fusion": fusion},
            train={"steps": 3, "global_batch_size": 8, "micro_batch_size": 2, "precision": "bf16", "seq_length": 32},
        )
        trainer = Trainer(config)
        out[fusion] = len(trainer.grads.fused), [trainer.train_step()["loss"] for _ in range(3)]
        trainer.close()
    return out


def test_a_bf16_pipeline_trains_the_same_with_and_without_the_fusion(dataset, tmp_path):
    """Each stage's 8 block linears (of the tiny model's 16) fuse; on CPU the fused sums are the unfused ones, so the
    losses are equal."""
    for runs in run_ranks(_pipeline_runs, 2, dataset, str(tmp_path)):
        (fused, with_fusion), (none, without) = runs[True], runs[False]
        assert (fused, none) == (8, 0)
        assert with_fusion == without


def test_a_torch_without_the_mixed_dtype_addmm_falls_back_to_the_plain_add(monkeypatch):
    """addmm with an fp32 result over bf16 operands is CUDA-only: where torch refuses it (here, the CPU), the first
    refusal turns it off and main_grad is left for the plain product-and-add."""
    monkeypatch.setitem(grad_fusion._MIXED_ADDMM, "usable", True)
    main_grad = torch.ones(4, 3)
    a, b = torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)
    assert not grad_fusion._mixed_addmm(main_grad, a, b)
    assert not grad_fusion._MIXED_ADDMM["usable"] and torch.equal(main_grad, torch.ones(4, 3))

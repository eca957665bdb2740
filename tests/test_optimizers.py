"""LAMB and Adafactor against straightforward single-device references written here, on the whole
(logical) parameters, and the same under TP2 x DP2 sharding (LAMB also with ZeRO-1); Adafactor against
transformers' Adafactor; the AdamW path (decay groups, global-norm clipping, the gradient buffer) against
torch.optim.AdamW with clip_grad_norm_; fp16 loss scaling skips a step with an inf gradient without touching any
state."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from loom.engine.config import ModelConfig, OptimConfig
from loom.engine.model.gpt import GPTModel
from loom.engine.optim.algorithms import Adafactor
from loom.engine.optim.distributed import DistributedOptimizer
from loom.engine.optim.grad_buffer import GradBuffer
from loom.engine.optim.loss_scaler import LossScaler
from loom.engine.parallel.param_info import param_info
from loom.engine.parallel.sharding import initialize_parameters
from loom.engine.parallel.state import ParallelState

MODEL = dict(
    num_layers=1,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    vocab_size=100,
    make_vocab_divisible_by=8,
    norm="layernorm",
    bias=True,
)
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


def reference_lamb(weights, grads, state, step):
    for name, w in weights.items():
        g = grads[name]
        m, v = state.setdefault(name, (torch.zeros_like(w), torch.zeros_like(w)))
        m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        update = (m / (1 - BETAS[0] ** step)) / ((v / (1 - BETAS[1] ** step)).sqrt() + EPS)
        trust = 1.0  # norms and biases (no weight decay) take Adam's step, as apex's FusedLAMB does by default
        if w.ndim >= 2:
            update = update + WD * w
            w_norm, u_norm = w.norm(), update.norm()
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        w.sub_(LR * trust * update)


def reference_adafactor(weights, grads, state, step):
    beta2 = 1 - step**-0.8
    for name, w in weights.items():
        g = grads[name]
        sq = g * g + 1e-30
        if w.ndim >= 2:
            row, col = state.setdefault(name, (torch.zeros(w.shape[0]), torch.zeros(w.shape[1])))
            row.mul_(beta2).add_(sq.mean(dim=1), alpha=1 - beta2)
            col.mul_(beta2).add_(sq.mean(dim=0), alpha=1 - beta2)
            update = g / torch.sqrt(torch.outer(row / row.mean(), col))
            w.mul_(1 - LR * WD)
        else:
            (v,) = state.setdefault(name, (torch.zeros_like(w),))
            v.mul_(beta2).add_(sq, alpha=1 - beta2)
            update = g / v.sqrt()
        rms = update.pow(2).mean().sqrt()
        w.sub_(LR * update / max(1.0, rms.item()))


def _compare(rank, world, tp, name, zero1):
    dp = world // tp
    state = ParallelState.create(tp=tp, dp=dp)
    config = ModelConfig(**MODEL)
    model = GPTModel(config, state.tp_group)
    initialize_parameters(model, seed=3, tp_rank=state.tp_rank, tp_size=tp)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    grads = GradBuffer(params, state.dp_group, dp, state.dp_rank, bucket_bytes=2048, zero=int(zero1))
    optim = OptimConfig(
        name=name,
        lr=LR,
        min_lr=0.0,
        weight_decay=WD,
        beta1=BETAS[0],
        beta2=BETAS[1],
        eps=EPS,
        clip_grad=0.0,
        zero=int(zero1),
    )
    optimizer = DistributedOptimizer(named, grads, optim, state, config.num_layers)

    dense = GPTModel(config, None)
    initialize_parameters(dense, seed=3, tp_rank=0, tp_size=1)
    specs = {n: param_info(p).shard_spec for n, p in named}
    weights = {n: param_info(p).shard_spec.unshard([p.detach().clone()]) for n, p in dense.named_parameters()}
    reference, ref_state = (reference_lamb if name == "lamb" else reference_adafactor), {}
    worst = 0.0
    for step in range(1, 4):
        generator = torch.Generator().manual_seed(step)
        full_grads = {n: torch.randn(w.shape, generator=generator) for n, w in weights.items()}
        grads.start_step()
        share = 0.25 if state.dp_rank == 0 else 0.75 / max(dp - 1, 1)  # DP shares that sum to the whole
        for n, p in named:
            grads.add_gradient(p, specs[n].shard(full_grads[n], state.tp_rank, tp) * (share if dp > 1 else 1.0))
        grads.finish()
        optimizer.step(LR)
        reference(weights, full_grads, ref_state, step)
        for n, p in named:
            shards = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(shards, p.detach().contiguous(), group=state.tp_group)
            worst = max(worst, (specs[n].unshard(shards) - weights[n]).abs().max().item())
    return worst


@pytest.mark.parametrize(
    "name, world, tp, zero1",
    [
        ("lamb", 1, 1, False),
        ("lamb", 4, 2, False),
        ("lamb", 4, 2, True),
        ("adafactor", 1, 1, False),
        ("adafactor", 4, 2, False),
    ],
    ids=["lamb", "lamb-tp2dp2", "lamb-tp2dp2-zero1", "adafactor", "adafactor-tp2dp2"],
)
def test_matches_single_device_reference(name, world, tp, zero1):
    for worst in run_ranks(_compare, world, tp, name, zero1):
        assert worst < 1e-6


def _fp16_skip(rank, world):
    state = ParallelState.create(tp=1, dp=world)
    config = ModelConfig(**MODEL)
    model = GPTModel(config, None)
    initialize_parameters(model, seed=1, tp_rank=0, tp_size=1)
    model.half()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    grads = GradBuffer(params, state.dp_group, world, state.dp_rank, bucket_bytes=4096)
    scaler = LossScaler(initial_scale=1024.0, growth_interval=2, hysteresis=1)
    optimizer = DistributedOptimizer(named, grads, OptimConfig(lr=1e-3, min_lr=0.0), state, 1, scaler)
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))

    def step(inject_inf=False):
        grads.start_step()
        # The overflow comes from the last rank's loss, so it is in the gradients before any bucket's reduction
        # starts (written into a gradient after backward it would race the overlapped all-reduce of its bucket).
        overflow = math.inf if inject_inf and rank == world - 1 else 1.0
        (model(tokens[:, :-1], tokens[:, 1:]).float().mean() * scaler.scale * overflow).backward()
        grads.finish()
        return optimizer.step(1e-3)

    log = [(step()["skipped"], scaler.scale)]
    before = [p.detach().clone() for p in params]
    moments = [v["exp_avg"].clone() for v in optimizer.inner.state.values()]
    log.append((step(inject_inf=True)["skipped"], scaler.scale))
    unchanged = all(torch.equal(a, p) for a, p in zip(before, params)) and all(
        torch.equal(m, v["exp_avg"]) for m, v in zip(moments, optimizer.inner.state.values())
    )
    log += [(step()["skipped"], scaler.scale) for _ in range(2)]
    return log, unchanged, scaler.skipped_steps


def test_fp16_inf_gradient_skips_the_step_and_backs_off():
    for log, unchanged, skipped in run_ranks(_fp16_skip, 2):
        # clean step; inf on one rank -> every rank skips and halves; two clean steps -> doubles back
        assert log == [(False, 1024.0), (True, 512.0), (False, 512.0), (False, 1024.0)]
        assert unchanged and skipped == 1


def _adafactor_steps(make_optimizer, steps: int = 6) -> list[torch.Tensor]:
    """A matrix and a stack of matrices (a mixture of experts' weights: each factored on its own) with weight decay
    and a vector without, stepped on gradients alternately large and small."""
    generator = torch.Generator().manual_seed(0)
    matrix, stack, vector = (
        torch.nn.Parameter(torch.randn(8, 6, generator=generator)),
        torch.nn.Parameter(torch.randn(3, 8, 6, generator=generator) * torch.tensor([1.0, 10.0, 0.1])[:, None, None]),
        torch.nn.Parameter(torch.randn(6, generator=generator)),
    )
    optimizer = make_optimizer(
        [{"params": [matrix, stack], "weight_decay": WD}, {"params": [vector], "weight_decay": 0.0}]
    )
    for step in range(1, steps + 1):
        for p in (matrix, stack, vector):
            p.grad = torch.randn(p.shape, generator=generator) * (3.0 if step % 2 else 0.01)
        optimizer.step()
    return [matrix.detach(), stack.detach(), vector.detach()]


def test_adafactor_equals_transformers_adafactor():
    """transformers' Adafactor with an external learning rate and no first moment is loom's (Shazeer & Stern
    2018 with decay rate t^-0.8, update clipping at RMS 1, decoupled weight decay)."""
    optimization = pytest.importorskip("transformers.optimization")

    def theirs(groups):
        return optimization.Adafactor(
            groups, lr=LR, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
            scale_parameter=False, relative_step=False, warmup_init=False,
        )  # fmt: skip

    expected = _adafactor_steps(theirs)
    for ours, wanted in zip(_adafactor_steps(lambda groups: Adafactor(groups, lr=LR)), expected):
        torch.testing.assert_close(ours, wanted, rtol=1e-6, atol=1e-7)


def _adamw_against_torch(rank, world):
    config = ModelConfig(**MODEL)
    state = ParallelState.create(tp=1, dp=1)
    model, twin = GPTModel(config, None), GPTModel(config, None)
    for m in (model, twin):
        initialize_parameters(m, seed=3, tp_rank=0, tp_size=1)
    named = list(model.named_parameters())
    grads = GradBuffer([p for _, p in named], state.dp_group, 1, 0, bucket_bytes=4096)
    optim = OptimConfig(name="adamw", lr=LR, min_lr=0.0, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    optim.clip_grad = 0.5
    optimizer = DistributedOptimizer(named, grads, optim, state, config.num_layers)
    # Megatron's rule, stated here independently of loom's param_info: no decay on biases and 1-D weights
    no_decay = [p for n, p in twin.named_parameters() if n.endswith(".bias") or p.ndim == 1]
    decay = [p for n, p in twin.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    norms = []
    for step in range(4):
        tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(step))
        grads.start_step()
        model(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
        grads.finish()
        ours = optimizer.step(LR)["grad_norm"]
        reference.zero_grad()
        twin(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
        norms.append((ours, torch.nn.utils.clip_grad_norm_(twin.parameters(), optim.clip_grad).item()))
        reference.step()
    worst = max((p - q).abs().max().item() for (_, p), q in zip(named, twin.parameters(), strict=True))
    return worst, norms


def test_adamw_with_decay_groups_and_clipping_equals_torch():
    ((worst, norms),) = run_ranks(_adamw_against_torch, 1)
    for ours, theirs in norms:
        assert ours == pytest.approx(theirs, rel=1e-5) and theirs > 0.5  # clipping acted in every step
    assert worst < 1e-5, worst  # steps of ~1e-2 each; fp32 summation order apart


def _bf16_weights_against_torch(rank, world):
    """{zero: (largest difference of fp32 masters, bf16 weights differing from the masters rounded, weights moved)}:
    loom's bf16 weights with fp32 masters, stepped by bf16 gradients, against torch's AdamW on fp32 weights that
    start from the same bf16 values and take the same gradients cast to fp32."""
    config = ModelConfig(**MODEL)
    state = ParallelState.create(tp=1, dp=1)
    out = {}
    for zero in (0, 1):
        model = GPTModel(config, None)
        initialize_parameters(model, seed=3, tp_rank=0, tp_size=1)
        model.bfloat16()
        named = list(model.named_parameters())
        start = [p.detach().clone() for _, p in named]
        twins = [torch.nn.Parameter(p.detach().float()) for _, p in named]
        grads = GradBuffer([p for _, p in named], state.dp_group, 1, 0, bucket_bytes=4096, zero=zero)
        optim = OptimConfig(name="adamw", lr=1e-3, min_lr=0.0, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
        optim.clip_grad, optim.zero = 0.0, zero
        optimizer = DistributedOptimizer(named, grads, optim, state, config.num_layers)
        groups = [
            {"params": [q for (_, p), q in zip(named, twins) if p.ndim >= 2], "weight_decay": WD},
            {"params": [q for (_, p), q in zip(named, twins) if p.ndim < 2], "weight_decay": 0.0},
        ]
        reference = torch.optim.AdamW(groups, lr=1e-3, betas=BETAS, eps=EPS)
        for step in range(10):
            generator = torch.Generator().manual_seed(step)
            gradients = [torch.randn(p.shape, generator=generator).bfloat16() for _, p in named]
            grads.start_step()
            for (_, p), gradient in zip(named, gradients):
                grads.add_gradient(p, gradient)
            grads.finish()
            optimizer.step(1e-3)
            for q, gradient in zip(twins, gradients):
                q.grad = gradient.float()
            reference.step()
        masters = {id(seg.param): seg.master.reshape(-1) for seg in optimizer.segments}
        worst = max((masters[id(p)] - q.detach().reshape(-1)).abs().max().item() for (_, p), q in zip(named, twins))
        rounded = sum(int((p.detach() != q.detach().bfloat16()).sum()) for (_, p), q in zip(named, twins))
        moved = sum(int((p.detach() != s).sum()) for (_, p), s in zip(named, start))
        out[zero] = worst, rounded, moved / sum(p.numel() for _, p in named)
    return out


def test_bf16_weights_keep_fp32_masters_stepped_as_torch_adamw_steps_fp32_weights():
    """Mixed precision's master weights against an outside optimizer: the masters are torch AdamW's fp32 weights
    (same bf16 gradients, cast up), and each bf16 weight is its master rounded to bf16, under ZeRO 0 and 1."""
    (per_zero,) = run_ranks(_bf16_weights_against_torch, 1)
    for zero, (worst, rounded, moved) in per_zero.items():
        assert worst < 1e-7 and rounded == 0, (zero, worst, rounded)
        assert moved > 0.5, zero  # most bf16 weights changed: the updates were not lost to rounding

"""Checks that need a CUDA device: run them the day one is there with `pytest -m gpu` (9 of them took 181 s
on an H200 on 2026-11-27, two of their runs shared since); without CUDA they are skipped (conftest.py). They
hold what CPU tests can only approximate: compiled blocks train like eager ones on the GPU, FP8 trains like
BF16, the loss equals F.cross_entropy on CUDA, the fused weight-gradient GEMM accumulates in fp32, a block is
one graph there too, the planner's memory for llama-1b, NCCL through the launcher, the attention kernels,
Gemma's windows, soft-capping and sandwich norms compiled, and a mixture of experts' grouped GEMMs.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from training_runs import read_metrics, tiny_config

from loom.launch.local import launch_local

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _train(dataset: str, run_dir: Path, steps: int, **sections) -> list[float]:
    """Losses of a tiny bf16 run on the GPU through the launcher (NCCL, world size 1)."""
    train = {"device": "cuda", "precision": "bf16", "steps": steps, **sections.pop("train", {})}
    config = tiny_config(dataset, run_dir, train=train, **sections)
    config.resolve_world(1)
    launch_local(config, 1)
    return [row["loss"] for row in read_metrics(run_dir)]


# Never run on a GPU yet: first, so that a lease cut short still runs them (the others passed on 2026-11-27).
def test_a_run_resumes_and_evaluates_on_cuda(dataset, tmp_path, capfd):
    """A user's day on one GPU: 6 steps straight; the same run stopped after 3 (a checkpoint) and resumed, with
    the straight run's losses (fused AdamW's state, the CUDA generators, the loader's position); `loom eval` of its
    last checkpoint. Never run on a GPU before 2026-11-27's checks were written."""
    from training_runs import loom_here

    eager = {"model": {"compile": "false"}, "checkpoint": {"interval": 3, "save_at_end": True}}
    straight = _train(dataset, tmp_path / "straight", 6, **eager)
    _train(dataset, tmp_path / "run", 6, train={"exit_after": 3}, **eager)
    resumed = _train(dataset, tmp_path / "run", 6, **eager)  # the run's metrics: steps 1-3, then 4-6 resumed
    assert len(resumed) == len(straight) == 6
    for ours, theirs in zip(resumed, straight, strict=True):  # bf16; flash attention's backward adds in any order
        assert abs(ours - theirs) / theirs < 1e-2, (resumed, straight)
    evaluated = loom_here(capfd, "eval", "--checkpoint", str(tmp_path / "run" / "checkpoints"), "--data", dataset)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    said = evaluated.stdout.split("step 6: validation loss ")[1]  # it evaluated the last checkpoint
    assert math.isfinite(float(said.split(",")[0])), evaluated.stdout


NEWER_PIECES = {
    # SDPA's memory-efficient kernel with a window mask, K and V repeated for the grouped heads; local RoPE; four norms
    "gemma3": {"activation": "geglu", "norm_placement": "both", "qk_norm": True, "sliding_window": 16,
               "full_attention_interval": 2, "rope_local_theta": 1e4, "embedding_multiplier": 11.3},
    # loom's own attention with soft-capped scores, windowed; capped logits
    "gemma2": {"activation": "geglu", "norm_placement": "both", "sliding_window": 16, "full_attention_interval": 2,
               "attention_softcap": 20.0, "logits_softcap": 15.0},
    # a mixture of experts (2026-11-29): the experts' GEMMs grouped (torch._grouped_mm on Hopper), routed and summed
    "moe": {"num_experts": 4, "moe_top_k": 2, "moe_shared_ffn_hidden_size": 128, "moe_shared_expert_gate": True},
}  # fmt: skip


@pytest.mark.parametrize("pieces", list(NEWER_PIECES))
def test_newer_pieces_train_compiled_like_eager_on_cuda(pieces, dataset, tmp_path):
    """Sliding windows, soft-capping, sandwich norms and experts (2026-11-29, never on a GPU yet): 8 steps compiled
    (one graph per kind of block) give the eager run's losses, within bf16's rounding."""
    model = {**NEWER_PIECES[pieces], "compile": "false"}
    eager = _train(dataset, tmp_path / "eager", 8, model=model, train={"seq_length": 64})
    compiled = _train(dataset, tmp_path / "compiled", 8, model={**model, "compile": "true"}, train={"seq_length": 64})
    assert all(math.isfinite(loss) for loss in eager)
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a - b) / a < 1e-2, (eager, compiled)


def test_grouped_expert_gemms_on_cuda_equal_a_gemm_per_expert():
    """torch._grouped_mm, a mixture of experts' GEMMs in bf16 on a Hopper GPU (never run on one yet): each expert's
    rows times its weight, forward and backward, against a bf16 GEMM per expert, with an expert that gets no row."""
    from loom.engine.model.moe import grouped_matmul

    generator = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(1000, 256, device=CUDA, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 512, 256, device=CUDA, generator=generator, dtype=torch.bfloat16).transpose(1, 2)
    weight.requires_grad_()
    ends = torch.tensor([300, 300, 700, 1000], device=CUDA, dtype=torch.int32)
    out = grouped_matmul(x, weight, ends)
    grad = torch.randn(out.shape, device=CUDA, generator=generator, dtype=torch.bfloat16)
    out.backward(grad)
    x2, weight2 = (t.detach().clone().requires_grad_() for t in (x, weight))
    starts = [0, 300, 300, 700, 1000]
    expected = torch.cat([x2[starts[e] : starts[e + 1]] @ weight2[e] for e in range(4)])
    expected.backward(grad)
    for ours, theirs in ((out, expected), (x.grad, x2.grad), (weight.grad, weight2.grad)):
        assert (ours.float() - theirs.float()).norm() / theirs.float().norm() < 1e-2
    assert not weight.grad[1].any()
    # no row at all (an expert-parallel rank whose experts no token chose): an empty output, zero weight gradients
    empty = x[:0].detach().requires_grad_()
    none = grouped_matmul(empty, weight, torch.zeros(4, device=CUDA, dtype=torch.int32))
    weight.grad = None
    none.sum().backward()
    assert none.shape == (0, 512) and (weight.grad is None or not weight.grad.any())


def test_a_world_size_1_nccl_run_through_the_launcher(dataset, tmp_path):
    command = [sys.executable, "-m", "loom.launch.cli", "train", "--config", "tiny", "--nproc", "1"]
    command += ["--data.paths", dataset, "--data.tokenizer", "none", "--train.run_dir", str(tmp_path)]
    command += ["--train.device", "cuda", "--train.steps", "4", "--train.eval_interval", "0"]
    command += ["--train.log_interval", "1"]  # tiny.toml logs every 5th step
    command += ["--model.compile", "false"]  # the launcher and NCCL are checked here; compiling, by the checks below
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and all(math.isfinite(row["loss"]) for row in rows)
    assert (tmp_path / "checkpoints" / "latest").is_file()  # saved at the end, by default


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_block_kernels_on_cuda(causal):
    """Context parallelism's block products on CUDA are torch's flash kernels, called by their signatures (never
    run on a GPU before): output, log-sum-exp and gradients against SDPA in fp32, to bf16's rounding."""
    from loom.engine.parallel.context import block_attention, block_attention_backward

    generator = torch.Generator(device=CUDA).manual_seed(0)
    shape_q, shape_k = (2, 8, 256, 64), (2, 8, 256 if causal else 384, 64)
    q = torch.randn(shape_q, device=CUDA, generator=generator, dtype=torch.bfloat16)
    k, v = (torch.randn(shape_k, device=CUDA, generator=generator, dtype=torch.bfloat16) for _ in "kv")
    grad = torch.randn(shape_q, device=CUDA, generator=generator, dtype=torch.bfloat16)
    reference = [t.float().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*reference, is_causal=causal)
    expected.backward(grad.float())
    out, lse = block_attention(q, k, v, 64**-0.5, causal)
    assert (out - expected).norm() / expected.norm() < 1e-2
    grads = block_attention_backward(grad, q, k, v, out.to(torch.bfloat16), lse, 64**-0.5, causal)
    for ours, theirs in zip(grads, (t.grad for t in reference), strict=True):
        assert (ours - theirs).norm() / theirs.norm() < 2e-2


@pytest.fixture(scope="module")
def eager_torch_attention(dataset, tmp_path_factory) -> list[float]:
    """Losses of 3 eager steps with torch's choice of attention kernel, which each backend's run is held to."""
    return _train(dataset, tmp_path_factory.mktemp("auto"), 3, model={"compile": "false"})


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_each_attention_backend_runs_alone_and_agrees_on_cuda(backend, dataset, eager_torch_attention, tmp_path):
    """model.attention_backend leaves torch SDPA that one CUDA kernel (torch's own choice says so): bf16 causal
    attention and its gradients against fp32 products written out; a call the kernel cannot take (an explicit mask
    for flash) fails instead of falling back to unfused math; and 3 eager steps of the tiny model (grouped-query
    heads, which cudnn and efficient get repeated) train like torch's choice."""
    from torch.nn.attention import SDPBackend

    from loom.engine.config_io import load_config
    from loom.engine.model.kernels import choose_kernels, enable_only_sdpa_backend

    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    kernel["efficient"] = SDPBackend.EFFICIENT_ATTENTION
    generator = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v, grad = (
        torch.randn(2, 8, 512, 64, device=CUDA, generator=generator, dtype=torch.bfloat16) for _ in range(4)
    )
    reference = [t.float().requires_grad_() for t in (q, k, v)]
    scores = reference[0] @ reference[1].transpose(-1, -2) / 8
    scores = scores.masked_fill(torch.ones(512, 512, dtype=torch.bool, device=CUDA).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ reference[2]
    expected.backward(grad.float())
    config = load_config("tiny", {"model": {"attention_backend": backend}, "train": {"precision": "bf16"}})
    choose_kernels(config, CUDA)
    try:
        assert torch._fused_sdp_choice(q, k, v, is_causal=True) == int(kernel[backend])
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*ours, is_causal=True)
        out.backward(grad)
        assert (out.float() - expected).norm() / expected.norm() < 1e-2
        for mine, theirs in zip(ours, reference, strict=True):
            assert (mine.grad.float() - theirs.grad).norm() / theirs.grad.norm() < 2e-2
        if backend == "flash":
            with pytest.raises(RuntimeError):
                F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(512, 512, dtype=torch.bool, device=CUDA))
    finally:
        enable_only_sdpa_backend("auto")
    chosen = _train(dataset, tmp_path / backend, 3, model={"compile": "false", "attention_backend": backend})
    for a, b in zip(chosen, eager_torch_attention, strict=True):
        assert abs(a - b) / b < 1e-2


@pytest.fixture(scope="module")
def defaults_run(dataset, tmp_path_factory) -> list[float]:
    """Losses of 10 steps with the defaults (compiled on CUDA, gradient-accumulation fusion), which two checks
    compare with: one run, not two (the checks are to fit a few minutes of a lent GPU)."""
    return _train(dataset, tmp_path_factory.mktemp("defaults"), 10)


def test_compiled_blocks_train_like_eager_ones(dataset, defaults_run, tmp_path):
    eager = _train(dataset, tmp_path / "eager", 10, model={"compile": "false"})
    for a, b in zip(eager, defaults_run, strict=True):
        assert abs(a - b) / a < 1e-2  # bf16: fused kernels round differently


def test_fp8_trains_like_bf16_over_50_steps(markov_dataset, tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    corpus = markov_dataset(400)  # a learnable chain: the losses fall well below ln V
    bf16 = _train(corpus, tmp_path / "bf16", 50)
    fp8 = _train(corpus, tmp_path / "fp8", 50, train={"fp8": "current"})
    # the output layer's GEMMs in FP8 too: on CPU within 0.004 of bf16 after 200 steps, never run on a GPU
    fp8_output = _train(corpus, tmp_path / "fp8-output", 50, train={"fp8": "current", "fp8_output_layer": True})
    assert bf16[-1] < bf16[0] - 0.5
    late = slice(-5, None)
    assert abs(sum(fp8[late]) - sum(bf16[late])) / 5 < 0.05  # gap measured on an H200: +0.006 after 200 steps
    assert abs(sum(fp8_output[late]) - sum(bf16[late])) / 5 < 0.05


def test_the_loss_equals_f_cross_entropy_on_cuda():
    from loom.engine.parallel.cross_entropy import vocab_parallel_cross_entropy

    generator = torch.Generator(device=CUDA).manual_seed(0)
    vocab = 32000
    logits = (3 * torch.randn(512, 2, vocab, device=CUDA, generator=generator)).to(torch.bfloat16)
    target = torch.randint(0, vocab, (512, 2), device=CUDA, generator=generator)
    theirs = logits.clone().requires_grad_()  # ours consumes its logits (their storage receives the gradient)
    reference = F.cross_entropy(theirs.float().view(-1, vocab), target.view(-1), reduction="none").view(512, 2)
    (reference_grad,) = torch.autograd.grad(reference.mean(), theirs)
    logits.requires_grad_(True)
    ours = vocab_parallel_cross_entropy(logits, target, 0, vocab, None)
    (ours_grad,) = torch.autograd.grad(ours.mean(), logits)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)  # fp32 arithmetic on the same bf16 logits
    torch.testing.assert_close(ours_grad, reference_grad, rtol=1e-2, atol=1e-6)  # both rounded to bf16


def test_fused_gradient_accumulation_sums_in_fp32_on_cuda(dataset, defaults_run, tmp_path):
    """The fused weight-gradient GEMM (addmm with an fp32 result over bf16 operands) adds into the fp32 buffer
    without rounding each micro-batch's product to bf16, as the unfused path does; training is unchanged."""
    from loom.engine.parallel.grad_fusion import accumulate_weight_grad

    generator = torch.Generator(device=CUDA).manual_seed(0)
    fused = torch.zeros(1024, 512, device=CUDA)
    unfused, exact = torch.zeros_like(fused), torch.zeros_like(fused, dtype=torch.float64)
    for _ in range(4):
        grad_out = torch.randn(256, 2, 1024, device=CUDA, generator=generator).to(torch.bfloat16)
        x = torch.randn(256, 2, 512, device=CUDA, generator=generator).to(torch.bfloat16)
        accumulate_weight_grad(fused, grad_out, x)
        unfused += (grad_out.flatten(0, 1).t() @ x.flatten(0, 1)).float()
        exact += grad_out.flatten(0, 1).t().double() @ x.flatten(0, 1).double()
    fused_error, unfused_error = ((t.double() - exact).abs().max().item() for t in (fused, unfused))
    assert fused_error < unfused_error / 4, (fused_error, unfused_error)
    plain = _train(dataset, tmp_path / "plain", 10, optim={"grad_accumulation_fusion": False})
    for a, b in zip(plain, defaults_run, strict=True):  # the default fuses
        assert abs(a - b) / a < 1e-2


@pytest.mark.parametrize("fp8", ["off", "current"])
def test_a_block_is_one_graph_on_cuda(fp8):
    from loom.engine.config_io import load_config
    from loom.engine.model.gpt import GPTModel
    from loom.engine.model.kernels import choose_kernels

    if fp8 != "off" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    config = load_config("tiny", {"train": {"precision": "bf16", "fp8": fp8, "device": "cuda"}})
    kernels = choose_kernels(config, CUDA)
    model = GPTModel(config.model, None, kernels=kernels).to(CUDA, torch.bfloat16)
    kernels.weights_updated([model])
    block = model.layers["0"]
    if hasattr(block, "_compiled_call_impl"):
        block._compiled_call_impl = None  # explain traces the block itself
    hidden = torch.randn(128, 2, config.model.hidden_size, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(block)(hidden, model._rotary(128, CUDA))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_llama_1b_peak_memory_is_within_10_percent_of_the_plan(tmp_path):
    """loom's defaults (blocks compiled): the H200 run of 2026-11-26 measured 35.7 GB compiled, where the plan
    (which then counted eager activations for every run) said 40.5 GB; it counts what the compiled blocks save
    since: 35.0 GB. Eager runs (37.8 GB measured) the plan puts at 40.5 GB."""
    from loom.engine.config_io import load_config
    from loom.tools.bench.harness import write_random_tokens
    from loom.tools.plan import GB, estimate, gpu_kind, load_hardware
    from loom.tools.plan_bytes import layout_of

    kind = gpu_kind(torch.cuda.get_device_name())
    if kind is None:
        pytest.skip(f"the planner knows no {torch.cuda.get_device_name()}")
    data = write_random_tokens(tmp_path / "tokens", 128256, 64, 2049)
    overrides = {
        "data": {"paths": [data], "tokenizer": None, "split": "100,0,0"},
        "train": {
            "device": "cuda",
            "steps": 3,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "seq_length": 2048,
            "run_dir": str(tmp_path / "run"),
            "eval_interval": 0,
            "tensorboard": False,
        },
        "checkpoint": {"save_at_end": False},
    }
    config = load_config("llama-1b", overrides)
    config.resolve_world(1)
    launch_local(config, 1)
    measured = max(row["mem_gb"] for row in read_metrics(tmp_path / "run"))
    planned = estimate(config, layout_of(config), load_hardware(kind)).memory["total"] / GB
    assert abs(measured / planned - 1) <= 0.10, (measured, planned)

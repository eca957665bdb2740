"""Kernel choice (engine/model/kernels.py): the native path is the reference, guards say why, FP8 maths on CPU."""

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from training_runs import read_metrics, tiny_config

from loom.engine.config import ConfigError
from loom.engine.config_io import load_config
from loom.engine.model import fp8, kernels
from loom.engine.model.gpt import GPTModel
from loom.engine.model.kernels import Choice, Kernels, build_adamw, choose_kernels, probe_import
from loom.engine.parallel.sharding import initialize_parameters
from loom.launch.local import launch_local

REPO = Path(__file__).resolve().parents[1]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SMALL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 128,
    "vocab_size": 256,
    "make_vocab_divisible_by": 16,
}


def tiny(**sections):
    overrides = {section: dict(values) for section, values in sections.items()}
    return load_config("tiny", overrides)


def train_losses(model_config, kernels_or_none, steps=3, impl="torch.AdamW(foreach)") -> list[float]:
    model = GPTModel(model_config, None, kernels=kernels_or_none)
    initialize_parameters(model, seed=7, tp_rank=0, tp_size=1)
    optimizer = build_adamw([{"params": list(model.parameters()), "weight_decay": 0.1}], 1e-3, (0.9, 0.95), 1e-8, impl)
    tokens = torch.randint(0, model_config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_cpu_auto_chooses_the_native_reference_path_with_reasons():
    chosen = choose_kernels(tiny(), CPU)
    impls = {name: c.impl for name, c in chosen.choices().items()}
    assert impls == {
        "attention": "torch.sdpa",
        "norm": "torch.rms_norm",
        "activation": "torch.swiglu",
        "linear": "torch.linear",
        "optimizer": "torch.AdamW(foreach)",
    }
    assert "transformer_engine:" in chosen.attention.why and "apex:" in chosen.norm.why
    line = chosen.summary()
    assert line.startswith("kernels: attention=torch.sdpa") and "\n" not in line
    assert json.loads(json.dumps(chosen.as_dict()))["linear"]["impl"] == "torch.linear"


def test_auto_native_and_unchosen_models_give_identical_losses():
    config = tiny(model=SMALL)
    reference = train_losses(config.model, None)
    assert train_losses(config.model, choose_kernels(config, CPU)) == reference
    native = tiny(model={**SMALL, "kernels": "native"})
    assert train_losses(native.model, choose_kernels(native, CPU)) == reference


def test_foreach_adamw_is_bit_identical_to_the_for_loop_one():
    config = tiny(model=SMALL)
    model = GPTModel(config.model, None)
    initialize_parameters(model, seed=3, tp_rank=0, tp_size=1)
    results = []
    for foreach in (False, True):
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=foreach)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        results.append(torch.cat([p.detach().flatten() for p in params]))
    assert torch.equal(*results)


def test_compiled_norm_and_swiglu_match_eager():
    chosen = choose_kernels(tiny(model={"compile": True}), CPU)
    assert chosen.norm.impl == "torch.compile(rms_norm)" and chosen.activation.impl == "torch.compile(swiglu)"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 64, generator=generator, requires_grad=True)
    weight = torch.randn(64, generator=generator, requires_grad=True)
    gate = torch.randn(16, 2, 96, generator=generator, requires_grad=True)
    up = torch.randn(16, 2, 96, generator=generator, requires_grad=True)
    for function, reference, inputs in (
        (chosen.norm_function("rmsnorm"), kernels.rms_norm, (x, weight, None, 1e-5)),
        (chosen.activation_function("swiglu"), kernels.swiglu, (gate, up)),
        (chosen.activation_function("squared_relu"), lambda h: torch.relu(h) ** 2, (gate,)),  # Nemotron's relu2
    ):
        leaves = [t for t in inputs if isinstance(t, torch.Tensor)]
        compiled_out = function(*inputs)
        compiled_grads = torch.autograd.grad(compiled_out.square().sum(), leaves)
        eager_out = reference(*inputs)
        eager_grads = torch.autograd.grad(eager_out.square().sum(), leaves)
        # A fused kernel rounds differently: a few fp32 ulps (1.4e-6 absolute on outputs near 8 was seen).
        torch.testing.assert_close(compiled_out, eager_out, rtol=1e-6, atol=1e-6)
        for a, b in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


def _fake_import(error: Exception):
    real = kernels.importlib.import_module

    def fake(name, *args, **kwargs):
        if name.startswith(("transformer_engine", "apex")):
            raise error
        return real(name, *args, **kwargs)

    return fake


def test_the_blocks_compile_with_the_backend_loom_compile_backend_names(monkeypatch):
    """LOOM_COMPILE_BACKEND (the suite runs aot_eager_decomp_partition on CPU) reaches every block's compile, and the
    kernels line says it; a name torch.compile does not know is one line when the model is built."""
    from loom.errors import LoomError

    graphs = []

    def counting(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.register_backend(counting, name="loom_test_counting")
    monkeypatch.setenv("LOOM_COMPILE_BACKEND", "loom_test_counting")
    config = tiny(model={"compile": True, "num_layers": 2})
    chosen = choose_kernels(config, CPU)
    assert "(blocks by loom_test_counting: LOOM_COMPILE_BACKEND)" in chosen.activation.why
    model = GPTModel(config.model, None, kernels=chosen)
    initialize_parameters(model, seed=0, tp_rank=0, tp_size=1)
    torch._dynamo.reset()
    hidden, rotary = torch.randn(16, 1, 128, requires_grad=True), model._rotary(16, CPU, False)
    for block in model.layers.values():  # the blocks alone: the compiled loss is inductor's (and seconds)
        block(hidden, rotary, None, None).sum().backward()
    assert len(graphs) == 1  # one graph, for both blocks
    monkeypatch.setenv("LOOM_COMPILE_BACKEND", "nonsense")
    with pytest.raises(LoomError, match="^LOOM_COMPILE_BACKEND=nonsense is not a torch.compile backend: unset it"):
        GPTModel(config.model, None, kernels=chosen)
    # and before any rank runs, where the kernels are chosen; an eager run says it is unused
    with pytest.raises(LoomError, match="^LOOM_COMPILE_BACKEND=nonsense is not a torch.compile backend"):
        choose_kernels(tiny(model={"compile": True}), CPU)
    eager = choose_kernels(tiny(model={"compile": False}), CPU)
    assert "(LOOM_COMPILE_BACKEND unused)" in eager.activation.why


def test_import_guard_reports_missing_and_broken_packages(monkeypatch):
    missing = ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")
    monkeypatch.setattr(kernels.importlib, "import_module", _fake_import(missing))
    assert probe_import("transformer_engine.pytorch") == (
        None,
        "transformer_engine: not installed (ModuleNotFoundError)",
    )
    broken = OSError("libcudnn.so.9: cannot open shared object file\nmore detail")
    monkeypatch.setattr(kernels.importlib, "import_module", _fake_import(broken))
    module, why = probe_import("transformer_engine.pytorch")
    assert module is None
    assert why == "transformer_engine: import failed (OSError: libcudnn.so.9: cannot open shared object file)"
    dependency = ModuleNotFoundError("No module named 'transformer_engine_torch'", name="transformer_engine_torch")
    monkeypatch.setattr(kernels.importlib, "import_module", _fake_import(dependency))
    assert "import failed" in probe_import("transformer_engine.pytorch")[1]


def test_te_guard_falls_back_under_auto_and_is_one_line_error_under_te(monkeypatch):
    monkeypatch.setattr(kernels.importlib, "import_module", _fake_import(OSError("undefined symbol: cublasLt")))
    chosen = choose_kernels(tiny(), CUDA, capability=(9, 0))  # a pretend H100 whose TE and apex are broken
    assert chosen.attention.impl == "torch.sdpa" and chosen.linear.impl == "torch.linear"
    # model.compile = auto compiles on CUDA: the native norm and SwiGLU are compiled, and with them each block.
    assert chosen.norm.impl == "torch.compile(rms_norm)" and chosen.optimizer.impl == "torch.AdamW(fused)"
    assert chosen.compiles_blocks and "model.compile = auto (compiled on cuda)" in chosen.norm.why
    eager = choose_kernels(tiny(), CPU)
    assert eager.norm.impl == "torch.rms_norm" and not eager.compiles_blocks
    assert "model.compile = auto (eager on cpu)" in eager.activation.why
    forced = choose_kernels(tiny(model={"compile": "false"}), CUDA, capability=(9, 0))
    assert forced.norm.impl == "torch.rms_norm" and not forced.compiles_blocks
    assert "transformer_engine: import failed (OSError: undefined symbol: cublasLt)" in chosen.attention.why
    assert "apex: import failed" in chosen.optimizer.why
    for device in (CUDA, CPU):
        with pytest.raises(ConfigError, match=r"^model.kernels = te needs Transformer Engine") as error:
            choose_kernels(tiny(model={"kernels": "te"}), device, capability=(9, 0))
        assert "\n" not in str(error.value)


@pytest.fixture
def sdpa_flags_restored():
    yield
    kernels.enable_only_sdpa_backend("auto")  # process-wide flags: later tests get torch's defaults back


def test_attention_backend_enables_that_sdpa_kernel_alone_and_auto_gives_them_back(monkeypatch, sdpa_flags_restored):
    monkeypatch.setattr(kernels.importlib, "import_module", _fake_import(ModuleNotFoundError(name="x")))
    flags = torch.backends.cuda
    enabled = lambda: (  # noqa: E731
        flags.flash_sdp_enabled(),
        flags.cudnn_sdp_enabled(),
        flags.mem_efficient_sdp_enabled(),
        flags.math_sdp_enabled(),
    )
    bf16 = {"precision": "bf16"}
    for backend, expected in [("flash", (1, 0, 0, 0)), ("cudnn", (0, 1, 0, 0)), ("efficient", (0, 0, 1, 0))]:
        chosen = choose_kernels(tiny(model={"attention_backend": backend}, train=bf16), CUDA, capability=(9, 0))
        assert chosen.attention.impl == f"torch.sdpa({backend})" and enabled() == tuple(map(bool, expected))
    assert choose_kernels(tiny(train=bf16), CUDA, capability=(9, 0)).attention.impl == "torch.sdpa"
    assert enabled() == (True, True, True, True)  # torch's defaults, where the next config in the process finds them


def test_attention_backend_refusals_are_one_line():
    """On CPU when the kernels are chosen; with ring attention or flash/cudnn in fp32 as the config loads (a GPU
    host's launcher refuses it before any rank starts), and a value that is not a backend."""
    with pytest.raises(ConfigError) as on_cpu:
        choose_kernels(tiny(model={"attention_backend": "cudnn"}, train={"precision": "bf16"}), CPU)
    cases = [
        (
            {"train": {"precision": "fp32"}},
            "model.attention_backend = flash is a CUDA kernel for bf16 or fp16, not train.precision",
        ),
        ({"parallel": {"cp": 2}}, "model.attention_backend = flash with parallel.cp = 2: ring attention runs"),
    ]
    refusals = [str(on_cpu.value)]
    for sections, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            tiny(model={"attention_backend": "flash"}, **sections)
        refusals.append(str(error.value))
    with pytest.raises(ConfigError, match="is not one of auto, flash, cudnn, efficient") as error:
        tiny(model={"attention_backend": "fused"})
    refusals.append(str(error.value))
    assert refusals[0].endswith("on CPU SDPA has one kernel; use --model.attention_backend auto")
    assert all("\n" not in refusal for refusal in refusals)


def test_cudnn_and_efficient_attention_repeat_grouped_kv_heads_as_enable_gqa_would():
    """torch's cuDNN and memory-efficient kernels take no grouped-query heads, so under those backends the block
    repeats each KV head for its query heads: the same logits as SDPA's grouped-query call (CPU, fp32)."""
    grouped = tiny(model={**SMALL, "num_kv_heads": 2})
    logits = {}
    for backend in ("auto", "cudnn"):
        config = dataclasses.replace(grouped.model, attention_backend=backend)
        model = GPTModel(config, None)
        initialize_parameters(model, seed=7, tp_rank=0, tp_size=1)
        assert model.layers["0"].attention.repeat_kv == (backend == "cudnn")
        tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        logits[backend] = model(tokens)
    torch.testing.assert_close(logits["cudnn"], logits["auto"], rtol=1e-6, atol=1e-6)


def test_native_never_probes_optional_packages(monkeypatch):
    def no_import(name, *args, **kwargs):
        raise AssertionError(f"imported {name}")

    monkeypatch.setattr(kernels.importlib, "import_module", no_import)
    chosen = choose_kernels(tiny(model={"kernels": "native"}), CUDA, capability=(9, 0))
    assert chosen.attention.why.startswith("transformer_engine: off (model.kernels = native)")
    assert chosen.optimizer.impl == "torch.AdamW(fused)"


def test_fp8_guard_says_why_it_is_off(monkeypatch):
    monkeypatch.setattr(
        kernels.importlib, "import_module", _fake_import(ModuleNotFoundError(name="transformer_engine"))
    )
    fp8_config = tiny(train={"precision": "bf16", "fp8": "current"})
    cases = [(CPU, None, "fp8: no CUDA device"), (CUDA, (8, 0), "fp8: needs compute capability >= 8.9, got 8.0")]
    for device, capability, why in cases:
        with pytest.raises(ConfigError) as error:
            choose_kernels(fp8_config, device, capability=capability)
        assert str(error.value) == f"train.fp8 = current is unavailable: {why}; use --train.fp8 off"
    chosen = choose_kernels(fp8_config, CUDA, capability=(9, 0))
    assert chosen.linear.impl == "torch._scaled_mm(fp8 current scaling)"
    assert "transformer_engine: not installed" in chosen.linear.why and "compute capability 9.0" in chosen.linear.why
    with pytest.raises(ConfigError, match="train.fp8 = delayed needs Transformer Engine"):
        choose_kernels(tiny(train={"precision": "bf16", "fp8": "delayed"}), CUDA, capability=(9, 0))
    with pytest.raises(ConfigError, match="divisible by 16, but model.ffn_hidden_size per TP rank = 392"):
        choose_kernels(
            tiny(model={"ffn_hidden_size": 392}, train={"precision": "bf16", "fp8": "current"}), CUDA, capability=(9, 0)
        )
    with pytest.raises(ConfigError, match="train.fp8 = current needs train.precision = bf16"):
        tiny(train={"fp8": "current"})
    # a CP rank's GEMMs see seq_length / cp tokens: 1040 x 1 is a multiple of 16, each of 2 CP ranks' 520 is not
    ring = {"seq_length": 1040, "micro_batch_size": 1, "precision": "bf16", "fp8": "current"}
    ring_config = tiny(model={"max_position_embeddings": 1040}, train=ring, parallel={"cp": 2})
    with pytest.raises(
        ConfigError, match=r"tokens per micro-batch on a CP rank \(seq_length / cp \* micro_batch_size\) = 520"
    ):
        choose_kernels(ring_config, CUDA, capability=(9, 0))


def test_fp8_quantisation_maps_amax_to_the_format_maximum_and_round_trips():
    x = torch.randn(64, 48) * 3
    for dtype, mantissa_bits in ((fp8.E4M3, 3), (fp8.E5M2, 2)):
        quantized, scale_inv = fp8.quantize(x, dtype)
        assert quantized.dtype == dtype and quantized.float().abs().max() == torch.finfo(dtype).max
        torch.testing.assert_close(scale_inv, x.abs().max() / torch.finfo(dtype).max)
        restored = fp8.dequantize(quantized, scale_inv)
        normal = x.abs() > x.abs().max() * 2.0**-6  # away from the subnormal range
        relative = ((restored - x).abs() / x.abs())[normal]
        assert relative.max() <= 2.0 ** -(mantissa_bits + 1) + 1e-6  # round to nearest: half an ulp
    zeros, scale_inv = fp8.quantize(torch.zeros(4, 4), fp8.E4M3)
    assert scale_inv == 1 and not zeros.float().isnan().any()


def test_fp8_linear_matches_its_reference_forward_and_backward():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=generator, requires_grad=True)
    weight = (torch.randn(48, 64, generator=generator) * 0.1).requires_grad_()
    y = fp8.fp8_linear(x, weight)
    grad_y = torch.randn(y.shape, generator=generator)
    y.backward(grad_y)
    # Reference: the same quantised operands, multiplied in fp32.
    xq = fp8.dequantize(*fp8.quantize(x.detach().reshape(-1, 64), fp8.E4M3))
    wq = fp8.dequantize(*fp8.quantize(weight.detach(), fp8.E4M3))
    gq = fp8.dequantize(*fp8.quantize(grad_y.reshape(-1, 48), fp8.E5M2))
    torch.testing.assert_close(y.detach().reshape(-1, 48), xq @ wq.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 64), gq @ wq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, gq.t() @ xq, rtol=1e-5, atol=1e-5)
    # And FP8 is close to the full-precision layer.
    exact = F.linear(x.detach(), weight.detach())
    assert (y.detach() - exact).norm() / exact.norm() < 0.05


def test_fp8_linear_with_a_frozen_weight_runs_no_weight_gradient_gemm(monkeypatch):
    """A LoRA base's linears: the input's gradient as with a trainable weight, from one backward GEMM, not two
    (with the weight cast per step and per call alike)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator) * 0.1
    grad_y = torch.randn(32, 48, generator=generator)
    scaled_mm, calls = torch._scaled_mm, []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))
    for copies in (fp8.weight_copies(weight), None):
        grads = {}
        for trainable in (True, False):
            leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
            calls.clear()
            fp8.fp8_linear(leaf, w, None, copies).backward(grad_y)
            grads[trainable] = (leaf.grad, len(calls) - 1)  # the forward GEMM aside
        assert grads[True][1] == 2 and grads[False][1] == 1
        assert torch.equal(grads[True][0], grads[False][0])


def test_scaled_mm_linear_plugs_into_the_model_with_the_same_parameters():
    config = tiny(model=SMALL).model
    native = Kernels.native()
    fp8_kernels = Kernels(
        native.attention,
        native.norm,
        native.activation,
        Choice("torch._scaled_mm(fp8 current scaling)", "test"),
        native.optimizer,
        fp8="current",
    )
    reference = GPTModel(config, None)
    model = GPTModel(config, None, kernels=fp8_kernels)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [
        (n, p.shape) for n, p in reference.named_parameters()
    ]
    assert type(model.layers["0"].mlp.fc1).__name__ == "Fp8ColumnParallelLinear"
    native_losses = train_losses(config, None, steps=4)
    fp8_losses = train_losses(config, fp8_kernels, steps=4)
    assert fp8_losses[-1] < fp8_losses[0]
    for a, b in zip(native_losses, fp8_losses):
        assert abs(a - b) / a < 2e-2


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_output_layer_computes_the_fp8_product_of_the_weight_it_owns(tied):
    """train.fp8_output_layer: the logits are the FP8 GEMM of the final hidden states and the output weight (the
    tied embedding's when tied), its gradient reaches that weight, and training stays within 2% of bf16's."""
    config = tiny(model={**SMALL, "tie_embeddings": tied}).model
    model = GPTModel(config, None, kernels=_scaled_mm_kernels(output_layer=True))
    initialize_parameters(model, seed=3, tp_rank=0, tp_size=1)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in GPTModel(config, None).named_parameters()]
    weight = model.embedding.weight if tied else model.output_weight
    hidden = torch.randn(8, 2, config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = model.output_logits(hidden)
    expected = fp8.fp8_linear(model.final_norm(hidden), weight)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    exact = F.linear(model.final_norm(hidden), weight)
    assert 0 < (logits - exact).norm() / exact.norm() < 0.05
    logits.square().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    fp8_losses = train_losses(config, _scaled_mm_kernels(output_layer=True), steps=4)
    for a, b in zip(train_losses(config, None, steps=4), fp8_losses, strict=True):
        assert abs(a - b) / a < 2e-2


def test_fp8_output_layer_needs_current_scaling_and_a_vocabulary_of_16s():
    with pytest.raises(ConfigError, match="train.fp8_output_layer needs train.fp8 = current"):
        tiny(train={"precision": "bf16", "fp8_output_layer": True})
    fp8_output = {"precision": "bf16", "fp8": "current", "fp8_output_layer": True}
    chosen = choose_kernels(tiny(train=fp8_output), CUDA, capability=(9, 0))
    assert chosen.fp8_output_layer and chosen.linear.why.endswith("the output layer too (train.fp8_output_layer)")
    with pytest.raises(ConfigError, match="the padded vocabulary per TP rank = 4104"):
        choose_kernels(
            tiny(model={"vocab_size": 4100, "make_vocab_divisible_by": 8}, train=fp8_output), CUDA, capability=(9, 0)
        )


def test_optional_packages_are_never_imported_on_cpu(tmp_path):
    # A transformer_engine and an apex that blow up when imported: loom must import, choose and
    # train-configure on CPU without touching them, and still say they are installed.
    for name in ("transformer_engine", "apex"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise RuntimeError('imported on CPU')\n")
    code = (
        "import torch, engine.train, launch.cli\n"
        "from engine.config_io import load_config\n"
        "from engine.model.kernels import choose_kernels\n"
        "k = choose_kernels(load_config('configs/tiny.toml', []), torch.device('cpu'))\n"
        "print(k.attention.why)\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "transformer_engine: installed, but no CUDA device" in result.stdout


def test_kernels_are_logged_at_start_and_recorded_in_the_first_metrics_row(markov_dataset, tmp_path, capfd):
    config = tiny_config(
        markov_dataset(60), tmp_path / "run", train={"steps": 2, "global_batch_size": 4, "micro_batch_size": 2}
    )
    config.resolve_world(1)
    launch_local(config, 1)
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["kernels"]["attention"]["impl"] == "torch.sdpa" and "kernels" not in rows[1]
    assert "kernels: attention=torch.sdpa" in capfd.readouterr().out


def _losses_with_compile(rank, world, dataset, run_dir, compile_model, parallel=None, zero=0):
    from training_runs import tiny_config

    from loom.engine.train import Trainer

    config = tiny_config(
        dataset,
        run_dir,
        model={"compile": compile_model, "num_layers": 2},
        parallel=parallel or {"tp": 2, "sequence_parallel": True},
        optim={"zero": zero},
        train={"steps": 2, "global_batch_size": 4, "micro_batch_size": 1, "seq_length": 32},
    )
    trainer = Trainer(config)
    compiled_blocks = trainer.chunks[-1].compiled_loss and all(
        hasattr(block, "_compiled_call_impl") and block._compiled_call_impl
        for block in trainer.chunks[0].layers.values()
    )
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    trainer.close()
    return losses, compiled_blocks


def test_whole_compiled_blocks_train_like_eager(markov_dataset, tmp_path):
    """model.compile compiles each block with its tensor-parallel collectives, and the cross entropy's chunk
    kernels; the losses stay eager's."""
    from dist_utils import run_ranks

    dataset = markov_dataset(50)
    eager, _ = run_ranks(_losses_with_compile, 2, dataset, str(tmp_path / "eager"), False)[0]
    compiled, blocks_compiled = run_ranks(_losses_with_compile, 2, dataset, str(tmp_path / "compiled"), True)[0]
    assert blocks_compiled
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-6, atol=0)


def _on_scaled_mm(kernels: Kernels, output_layer: bool, weight_copies: bool) -> Kernels:
    """`kernels` with the linears on torch._scaled_mm, which the CPU runs (choose_kernels' guard wants CUDA)."""
    kernels.linear = Choice("torch._scaled_mm(fp8 current scaling)", "test: the CPU runs _scaled_mm")
    kernels.fp8, kernels.fp8_output_layer, kernels.fp8_weight_copies = "current", output_layer, weight_copies
    return kernels


def _scaled_mm_kernels(output_layer: bool = False, weight_copies: bool = True) -> Kernels:
    return _on_scaled_mm(Kernels.native(), output_layer, weight_copies)


def _fp8_on_cpu(config, device) -> Kernels:
    """choose_kernels for `config` with the linears on torch._scaled_mm, the output layer's too, keeping the
    weights' FP8 copies per step unless ZeRO-3 (as choose_kernels decides)."""
    return _on_scaled_mm(choose_kernels(config, device), True, config.optim.zero != 3)


def _fp8_runs(rank, world, dataset, run_dir):
    """Each rank trains the same dp2 run through the Trainer: ZeRO-1 with the FP8 layers' weight casts kept for the
    step and not, and ZeRO-3 (which keeps none), eagerly; then ZeRO-1 and ZeRO-3 with compiled blocks. Per run its
    losses, final weights (not ZeRO-3's: freed between steps) and how many times a weight was quantised (eager
    runs)."""
    from loom.engine import train
    from loom.engine.model import fp8

    quantised = [0]
    quantize_weight = fp8.quantize_weight

    def counted(weight):
        quantised[0] += 1
        return quantize_weight(weight)

    train.choose_kernels = _fp8_on_cpu
    runs = {}
    for name, zero, cached, compiled in (
        ("cached", 1, True, False),
        ("uncached", 1, False, False),
        ("zero3", 3, False, False),
        ("compiled", 1, True, True),
        ("compiled zero3", 3, False, True),
    ):
        config = tiny_config(
            dataset,
            f"{run_dir}/{name}",
            model={"compile": compiled},
            train={"steps": 3, "seq_length": 64},
            parallel={"dp": 2},
            optim={"zero": zero},
        )
        # counted only eagerly: a compiled graph calling the counter would specialise on its value, recompiling
        fp8.quantize_weight = quantize_weight if compiled else counted
        trainer = train.Trainer(config)
        assert trainer.kernels.compiles_blocks == compiled
        for cast in fp8.weight_casts(trainer.chunks):
            cast.enabled = cached
        quantised[0] = 0
        with contextlib.redirect_stdout(io.StringIO()) as log:
            losses = [trainer.train_step()["loss"] for _ in range(3)]
        assert "compiling failed" not in log.getvalue(), (name, log.getvalue())
        whole = trainer.optimizer.sharded_params is None
        weights = torch.cat([p.detach().flatten() for p in trainer.params]) if whole else None
        runs[name] = {"losses": losses, "weights": weights, "quantised": quantised[0]}
        trainer.close()
    return runs


def test_fp8_weight_casts_are_made_once_per_step_and_change_nothing(dataset, tmp_path):
    """ZeRO-1 under dp 2: each rank steps half of the masters and the other half arrives by an all-gather into
    the parameter buffer, which leaves the parameters' version counters alone, so a cache keyed on them alone
    would reuse stale casts; the Trainer's refresh after each step must catch it. Without the per-step copies each
    forward and each backward quantises the weight itself, with the same result. ZeRO-3 (weights gathered per
    block and freed after) quantises the gathered weights in every call and trains as ZeRO-1 does (its third
    loss is of weights both runs updated twice), eagerly and with compiled blocks (whose backward quantises the
    weight ZeRO-3 gathered again)."""
    ranks = run_ranks(_fp8_runs, 2, dataset, str(tmp_path))
    microbatches = 16 // (2 * 2)  # global batch 16, micro-batch 2, dp 2
    layers = 4 * 4 + 1  # tiny: 4 blocks of qkv, attention output, fc1, fc2; the output layer
    for runs in ranks:
        cached, uncached, zero3 = runs["cached"], runs["uncached"], runs["zero3"]
        assert cached["losses"] == uncached["losses"] and cached["losses"][-1] < cached["losses"][0]
        assert torch.equal(cached["weights"], uncached["weights"])
        assert cached["quantised"] == 3 * layers  # after each step
        assert uncached["quantised"] == zero3["quantised"] == 3 * microbatches * 2 * layers
        torch.testing.assert_close(torch.tensor(zero3["losses"]), torch.tensor(cached["losses"]), rtol=1e-5, atol=0)
        compiled, compiled_zero3 = (torch.tensor(runs[name]["losses"]) for name in ("compiled", "compiled zero3"))
        torch.testing.assert_close(compiled_zero3, compiled, rtol=1e-5, atol=0)
    assert ranks[0]["cached"]["losses"] == ranks[1]["cached"]["losses"]


def _block_graphs(rank, world, dataset, run_dir, precision, fp8, recompute, model_settings):
    """What torch._dynamo.explain finds in a transformer block at tp 2 with sequence parallelism (its
    collectives inside the block) under this precision's autocast: (graphs, graph breaks, break reasons)."""
    from training_runs import tiny_config

    from loom.engine import train
    from loom.engine.model.rotary import uses_local_rotary
    from loom.engine.model.transformer import window_mask

    if fp8:  # FP8 on CPU: the guard wants CUDA; "per call": the weights quantised in the block (as under ZeRO-3)
        train.choose_kernels = lambda config, device: _scaled_mm_kernels(weight_copies=fp8 != "per call")
    config = tiny_config(
        dataset,
        run_dir,
        model={"num_layers": 2, "recompute": recompute, **model_settings},
        parallel={"tp": 2, "sequence_parallel": True},
        train={"precision": precision, "steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "seq_length": 32},
    )
    trainer = train.Trainer(config)
    model = trainer.chunks[0]
    hidden = torch.randn(16, 1, 128, dtype=trainer.params[0].dtype, requires_grad=True)
    torch._dynamo.reset()
    block = model.layers["0"]
    mask = None if block.window is None else window_mask(32, block.window, hidden.device)
    rotary = model._rotary(32, hidden.device, uses_local_rotary(config.model, block.window))
    with trainer._autocast():
        explained = torch._dynamo.explain(block)(hidden, rotary, None, mask)
    trainer.close()
    return explained.graph_count, explained.graph_break_count, [str(r.reason) for r in explained.break_reasons]


OLMO2 = {"norm_placement": "output", "qk_norm": True, "qk_norm_per_head": False}
GEMMA2 = {"activation": "geglu", "norm_placement": "both", "sliding_window": 8, "attention_softcap": 50.0}
GEMMA3 = {
    "activation": "geglu",
    "norm_placement": "both",
    "qk_norm": True,
    "sliding_window": 8,
    "rope_local_theta": 1e4,
}


SHARED_GATED_MOE = {"num_experts": 4, "moe_shared_ffn_hidden_size": 128, "moe_shared_expert_gate": True}
GROUPED_FP32_ROUTING = {
    **{"moe_router_score": "sigmoid", "moe_expert_bias": True, "moe_router_groups": 2},
    "moe_router_group_top_k": 1,
    "moe_router_fp32": True,
}


@pytest.mark.parametrize(
    "precision, fp8, recompute, model_settings",
    [
        ("fp32", False, "none", {}),
        ("bf16", False, "selective", {}),
        ("fp16", False, "none", {}),
        ("bf16", True, "none", {}),
        ("bf16", "per call", "none", {}),
        ("bf16", False, "none", OLMO2),  # its query/key norms all-reduce over TP inside the block
        ("bf16", False, "selective", GEMMA3),  # four norms, a windowed layer's mask into recomputed attention
        ("bf16", False, "none", GEMMA2),  # loom's own attention with soft-capped scores
        # routed, grouped expert GEMMs (static shapes), a gated shared expert; DeepSeek-V3's routing (biases, groups)
        # with an fp32 router (an autocast-free region)
        ("bf16", False, "none", {**SHARED_GATED_MOE, **GROUPED_FP32_ROUTING}),
    ],
    ids=[
        "fp32",
        "bf16-selective",
        "fp16",
        "fp8",
        "fp8-weights-cast-per-call",
        "bf16-olmo2",
        "bf16-gemma3",
        "gemma2",
        "bf16-moe",
    ],
)
def test_a_block_is_one_graph_without_breaks(markov_dataset, tmp_path, precision, fp8, recompute, model_settings):
    """model.compile compiles each block whole: dynamo must see one graph, TP collectives and all, with no
    break (a break splits the block into graphs with eager Python between them: the fusion lost)."""
    from dist_utils import run_ranks

    dataset = markov_dataset(50)
    graphs, breaks, reasons = run_ranks(
        _block_graphs, 2, dataset, str(tmp_path), precision, fp8, recompute, model_settings
    )[0]
    assert (graphs, breaks) == (1, 0), reasons


def test_a_compiler_failure_leaves_the_step_eager_and_says_why_in_one_line():
    """Blocks compile inside the first step, where raising would leave TP and pipeline peers waiting in a
    collective: the frame runs eagerly instead, and dynamo's multi-line warning becomes one line."""
    from loom.engine.model.compiling import first_compiled_step

    def failing_backend(graph, inputs):
        raise RuntimeError("no C++ compiler found")

    said: list[str] = []
    function = torch.compile(lambda x: x * 2 + 1, backend=failing_backend)
    with first_compiled_step(said.append):
        out = function(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0)) and len(said) == 1
    assert said[0].startswith("warning: model.compile: compiling failed (RuntimeError: no C++ compiler found)")
    assert not torch._dynamo.config.suppress_errors  # only the first step tolerates it
    said.clear()
    with first_compiled_step(said.append):
        torch.compile(lambda x: x - 1, backend="eager")(torch.ones(3))
    assert len(said) == 1 and said[0].startswith("model.compile: the first step took ")
    # the first evaluation (no timing line) on a later pipeline stage, whose ranks rank 0 does not speak for
    said.clear()
    warned: list[str] = []
    with first_compiled_step(None, warned.append, " on pipeline stage 1"):
        out = torch.compile(lambda x: x + 5, backend=failing_backend)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 6.0)) and said == [] and len(warned) == 1
    assert warned[0].startswith("warning: model.compile on pipeline stage 1: compiling failed (RuntimeError: no C++")


def test_a_stop_that_comes_while_blocks_compile_stops_the_command_after_the_step():
    """`loom bench`'s SIGTERM handler raises its stop: raised mid-compile, dynamo took it for a compiler failure and
    went on eagerly (a lease's time limit did not stop the bench). The stop is held until the step ends, then raised
    by the handler that was there; with none (the default action) it would end the process as before."""
    import signal

    from loom.engine.model.compiling import first_compiled_step
    from loom.launch.local import Stopped

    def signalled_while_compiling(graph, inputs):
        signal.raise_signal(signal.SIGTERM)
        return graph.forward

    def stop(signum, frame):
        raise Stopped("SIGTERM", "stopped by SIGTERM")

    said: list[str] = []
    before = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stopped), first_compiled_step(said.append):
            out = torch.compile(lambda x: x * 3, backend=signalled_while_compiling)(torch.ones(3))
        assert torch.equal(out, torch.full((3,), 3.0)) and said == []  # the step ran whole, compiled; no fallback
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, before)


def test_compiled_blocks_under_zero3_and_context_parallelism_train_like_eager_ones(markov_dataset, tmp_path):
    """cp 2 with ZeRO-3 (which then shards over the two CP ranks, the DP x CP group): the weights are gathered and
    freed around each call of the same compiled graph, and the ring attention runs eagerly between the block's
    graphs (dynamo does not trace its sends); the losses are eager ZeRO-1's."""
    from dist_utils import run_ranks

    dataset = markov_dataset(50)
    cp2 = {"tp": 1, "cp": 2}
    eager, _ = run_ranks(_losses_with_compile, 2, dataset, str(tmp_path / "eager"), False, cp2, 1)[0]
    compiled, blocks_compiled = run_ranks(_losses_with_compile, 2, dataset, str(tmp_path / "z3"), True, cp2, 3)[0]
    assert blocks_compiled
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-6, atol=0)

"""`loom bench mfu` runs on CPU with tiny sizes and prints its table; the table's arithmetic."""

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from training_runs import loom_here, one_line_error

from loom.tools.bench.mfu import format_table

REPO = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a refusal on a machine without GPUs")


def test_bench_mfu_runs_on_cpu_and_prints_its_table(tmp_path, capfd):
    output = tmp_path / "new folder" / "mfu.json"  # made (it ran the whole bench, then failed to write the file)
    result = loom_here(
        capfd,
        *["bench", "mfu", "--config", str(REPO / "configs/tiny.toml")],
        *["--steps", "2", "--warmup", "1", "--microbatches", "1", "--output", str(output)],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "datasheet dense peak: none known for this device; float32 GEMM peak measured now" in out
    assert "run" in out and "MFU(GEMM)" in out and "loom fp32" in out and "plain PyTorch loop (eager)" in out
    assert "loom fp8 (current)" in out and "skipped: train.fp8 = current is unavailable: fp8: no CUDA device" in out
    assert "--train.fp8" not in out  # loom train's advice; the bench refuses that flag (it sets train.fp8 itself)
    assert "ratio loom / plain loop:" in out and "kernels: attention=torch.sdpa" in out
    assert "transformers LlamaForCausalLM (eager, sdpa)" in out and "ratio loom / transformers:" in out
    results = json.loads(output.read_text())
    loom, fp8_row, plain, hf = results["rows"]
    assert loom["name"] == "loom fp32 (defaults)" and "model.compile = auto (eager on cpu)" in loom["note"]
    for row in (loom, plain, hf):
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_measured_gemm"] and row["mfu_datasheet"] is None
        assert abs(row["tflops"] - row["tokens_per_s"] * results["flops_per_token"] / 1e12) < 1e-12
        assert "plan_tokens_per_s" not in row  # the planner knows GPUs, not this CPU
    assert fp8_row["tokens_per_s"] is None and results["gemm_peak_tflops"] > 0 and results["bench"] == "mfu"
    assert results["config"] == str(REPO / "configs/tiny.toml") and results["device"].startswith("CPU")


def test_table_reports_mfu_against_both_peaks_the_ratios_and_the_plan():
    plan = {"plan_tokens_per_s": 50000.0, "plan_mem_gb": 40.0, "plan_gpu": "h100-sxm"}
    rows = [
        {"name": "loom bf16 (defaults)", "tokens_per_s": 40000.0, "mem_gb": 50.0, "note": "kernels: ...", **plan},
        {"name": "loom fp8 (delayed)", "tokens_per_s": 56000.0, "mem_gb": 45.0, "note": ""},
        {"name": "loom fp8 (current, output layer too)", "tokens_per_s": 60000.0, "mem_gb": 44.0, "note": ""},
        {"name": "plain PyTorch loop (torch.compile)", "tokens_per_s": 38000.0, "mem_gb": 55.0, "note": ""},
        {"name": "transformers LlamaForCausalLM (eager, sdpa)", "tokens_per_s": 32000.0, "mem_gb": 52.0, "note": ""},
    ]
    flops = 1e10
    for row in rows:
        row["tflops"] = row["tokens_per_s"] * flops / 1e12
        row["mfu_datasheet"], row["mfu_measured_gemm"] = row["tflops"] / 989.0, row["tflops"] / 800.0
    results = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.x",
        "seq_length": 2048,
        "micro_batch_size": 4,
        "microbatches": 4,
        "flops_per_token": flops,
        "precision": "bf16",
        "datasheet_peak_tflops": 989.0,
        "gemm_peak_tflops": 800.0,
        "gemm_dtype": "bfloat16",
        "rows": rows,
        "kernels": "kernels: attention=te.DotProductAttention",
    }
    table = format_table(results)
    assert "datasheet dense peak: 989 TFLOP/s; bfloat16 GEMM peak measured now: 800.000 TFLOP/s" in table
    loom_line = next(line for line in table.splitlines() if line.startswith("loom bf16"))
    assert "400.000" in loom_line and "40.4%" in loom_line and "50.0%" in loom_line
    assert "ratio loom / plain loop: 1.053" in table and "ratio fp8 / bf16: 1.400" in table
    assert "ratio loom / transformers: 1.250" in table and "ratio fp8, output layer too / bf16: 1.500" in table
    planned = "loom plan (h100-sxm) for loom bf16 (defaults): 50,000 tokens/s (-20.0% measured), 40.0 GB (+25.0%"
    assert planned in table and "note:" not in table
    # a row above the peak measured in the same run (160% on a busy 2-core machine) was printed as a result
    rows[1]["mfu_measured_gemm"] = 1.602
    assert "note: loom fp8 (delayed) ran above the GEMM peak measured now, which cannot be" in format_table(results)


def test_bench_gpu_quick_runs_on_cpu_and_answers_every_row(tmp_path, capfd, monkeypatch):
    """The command a GPU session runs first: here with tiny sizes, so it cannot rot before a device comes. A row
    that raises (the plain loop here) is reported as failed and the others still run: on the first run of these
    changes on an H200 a failing row would have taken the whole table with it."""
    from loom.tools.bench import mfu

    def exploding(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    monkeypatch.setattr(mfu, "_plain_row", exploding)
    # the JSON's write fails at the end (a full disk): the table, printed after it, was lost with it, minutes of
    # a GPU lease; it comes first now (the figures written here all the same, for the checks below)
    from loom.tools.bench import gpu

    def disk_fills_after(output, results):
        gpu_write(output, results)
        raise OSError(errno.ENOSPC, "No space left on device", str(output))

    gpu_write = gpu._write_results
    monkeypatch.setattr(gpu, "_write_results", disk_fills_after)
    output = tmp_path / "gpu.json"
    monkeypatch.chdir(tmp_path)
    result = loom_here(capfd, "bench", "gpu", "--quick", "--output", str(output))
    assert result.returncode == 2 and f"{output}: No space left on device" in result.stderr, result.stderr[-3000:]
    for row in (
        "GEMM peak (measured)",
        "| loom fp32 (defaults) |",
        "| loom fp8 (current) | - | skipped:",
        "| loom fp8 (current, output layer too) | - | skipped:",
        "| FP8 / fp32 tokens/s | - | skipped:",
        "| FP8, output layer too / fp32 tokens/s | - | skipped:",
        "| plain PyTorch loop | - | failed: RuntimeError: CUDA error: an illegal memory access was encountered |",
        "| loom fp32, cudnn attention | - | skipped: model.attention_backend = cudnn",
        "| loom / transformers tokens/s |",
        "| loom / plain loop tokens/s | - |",
        "| FP8 / fp32 on the tiny slice (seq 64, micro-batch 1) | - | skipped:",
        "| FP8, output layer too / fp32 on the tiny slice (seq 64, micro-batch 1) | - | skipped:",
        "| the same, FP8 with the output layer too | - | gap - skipped: train.fp8 = current is unavailable",
    ):
        assert row in result.stdout, result.stdout
    assert "world-size-1 run via the launcher (gloo) | ok, loss" in result.stdout
    assert "--train.fp8" not in result.stdout  # the FP8 skips give their reason, not loom train's advice
    results = json.loads(output.read_text())
    assert results["throughput"]["rows"][0]["tokens_per_s"] > 0 and results["fp8_slice"]["rows"][0]["tokens_per_s"] > 0
    assert results["loss_gap"]["bf16_final_loss"] > 0 and "fp8_note" in results["loss_gap"]
    assert results["launcher"]["ok"] and results["bench"] == "gpu" and results["complete"]


def test_a_stop_signal_ends_the_bench_rather_than_failing_a_row():
    from loom.errors import Interrupted
    from loom.tools.bench import harness

    def stopped():
        raise Interrupted("stopped by SIGTERM")

    with pytest.raises(Interrupted):
        harness.guarded(stopped, lambda why: why, torch.device("cpu"))
    assert harness.guarded(lambda: 1 / 0, lambda why: why, torch.device("cpu")).startswith("failed: ZeroDivisionError")


def test_bench_results_replace_only_earlier_results(tmp_path, capfd):
    """`--output RUN/metrics.jsonl` (or a checkpoint's metadata.json) was replaced by the benchmark's JSON, exit 0;
    so were a GPU's figures by a --quick run on a CPU (any result of the same benchmark counted as the rerun's)."""
    from loom.tools.outputs import claim_result_file

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 8.3}\n{"step": 2, "loss": 8.2}\n')
    for bench in (["gpu", "--quick"], ["mfu", "--config", "tiny"]):
        result = loom_here(capfd, "bench", *bench, "--output", str(metrics))
        one_line_error(result, f"--output {metrics} exists and is not a `loom bench {bench[0]}` result")
    assert metrics.read_text().startswith('{"step": 1')
    earlier = tmp_path / "bench_gpu.json"
    gpu_run = {"bench": "gpu", "config": "llama-1b", "quick": False, "device": "NVIDIA H200", "complete": True}
    earlier.write_text(json.dumps(gpu_run))
    claim_result_file(earlier, "gpu", False, {"config": "llama-1b", "quick": False, "device": "NVIDIA H200"})
    one_line_error(
        loom_here(capfd, "bench", "gpu", "--quick", "--output", str(earlier)),
        f"--output {earlier} holds the result of another `loom bench gpu` (config 'llama-1b', quick False, device "
        "'NVIDIA H200'; this one: config 'tiny', quick True, device 'CPU",
    )
    assert json.loads(earlier.read_text()) == gpu_run
    with pytest.raises(Exception, match="is not a `loom bench mfu` result"):
        claim_result_file(earlier, "mfu", False, {})
    earlier.write_text(json.dumps({"bench": "gpu", "config": "llama-1b"}))  # written before results said more
    with pytest.raises(Exception, match="written by an older loom \\(it records no quick, device\\)"):
        claim_result_file(earlier, "gpu", False, {"config": "llama-1b", "quick": False, "device": "NVIDIA H200"})
    claim_result_file(metrics, "gpu", True, {})


def test_a_rerun_replaces_only_a_result_of_the_same_measurement(tmp_path, capfd):
    """bench mfu took a result of another model for its own (the identity held the --config string, not the model),
    refused the same file given by another path, and replaced a linked --output with a file of its own."""
    config = tmp_path / "tiny.toml"
    config.write_text((REPO / "configs/tiny.toml").read_text())
    target = tmp_path / "figures" / "a.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)  # dangling: written through, as a chart's link is
    quick = ["bench", "mfu", "--steps", "1", "--warmup", "0", "--microbatches", "1", "--no-compile"]
    first = loom_here(capfd, *quick, "--config", str(config), "--output", str(link))
    assert first.returncode == 0, first.stderr[-2000:]
    assert link.is_symlink() and json.loads(target.read_text())["flops_per_token"] > 0
    measured = json.loads(target.read_text())["flops_per_token"]
    rerun = loom_here(capfd, *quick, "--config", str(tmp_path / "." / "tiny.toml"), "--output", str(target))
    assert rerun.returncode == 0, rerun.stderr[-2000:]  # the same model by another path: its rerun
    other = loom_here(capfd, *quick, "--config", str(config), "--model.num_layers", "1", "--output", str(target))
    one_line_error(other, f"--output {target} holds the result of another `loom bench mfu` (flops_per_token")
    assert json.loads(target.read_text())["flops_per_token"] == measured


def test_bench_gpu_without_a_gpu_needs_quick_or_a_config(tmp_path, capfd, monkeypatch):
    """Without --quick on a CPU it started llama-1b, silently, for hours."""
    if torch.cuda.is_available():
        pytest.skip("a refusal on a machine without GPUs")
    monkeypatch.chdir(tmp_path)
    one_line_error(loom_here(capfd, "bench", "gpu"), "this machine shows none", "use --quick")
    assert not (tmp_path / "bench_gpu.json").exists()


def test_a_bench_stopped_part_way_keeps_a_complete_earlier_result(tmp_path):
    """A lease's time limit stopping a rerun replaced the earlier complete figures with a 5-line stub."""
    from loom.tools.bench.gpu import _write_results

    output = tmp_path / "bench_gpu.json"
    assert _write_results(output, {"bench": "gpu", "throughput": {}}) == output  # nothing to keep: written there
    complete = {"bench": "gpu", "throughput": {"rows": []}, "complete": True}
    assert _write_results(output, complete) == output and json.loads(output.read_text()) == complete
    partial = _write_results(output, {"bench": "gpu", "throughput": {"rows": [1]}})
    assert partial == tmp_path / "bench_gpu.partial.json" and "complete" not in json.loads(partial.read_text())
    assert json.loads(output.read_text()) == complete
    # A complete rerun supersedes the stopped run's partial figures (they would read as the newer ones); another
    # device's partial figures are not the rerun's to remove
    other = tmp_path / "other.json"
    _write_results(other, {**complete, "device": "H200"})
    _write_results(other, {"bench": "gpu", "device": "H200"})
    _write_results(other, {**complete, "device": "H100"})
    assert json.loads((tmp_path / "other.partial.json").read_text()) == {"bench": "gpu", "device": "H200"}
    assert _write_results(output, complete) == output and not partial.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--parallel.tp", "2"], "--parallel.tp: loom bench mfu sets it itself"),
        (["--train.steps", "500"], "--train.steps: loom bench mfu sets it itself"),
        (["--checkpoint.interval", "5"], "--checkpoint.interval: loom bench mfu sets it itself"),
        (["--parallel.backend", "nccl"], "--parallel.backend: loom bench mfu sets it itself"),
        (["--train.precision", "bf16", "--train.fp8", "current"], "--train.fp8: loom bench mfu sets it in a row of"),
        pytest.param(
            ["--train.precision", "bf16", "--model.attention_backend", "cudnn"],
            "model.attention_backend = cudnn",
            marks=NO_GPU,
        ),
        pytest.param(["--train.device", "cuda"], "train.device = cuda but no CUDA device is visible", marks=NO_GPU),
        (["--steps", "100000", "--microbatches", "100000"], "lower --steps or --microbatches"),
        (["--fp8-recipe", "delayed", "--fp8-output-layer"], "use --fp8-recipe current (or auto)"),
    ],
)
def test_bench_mfu_refuses_what_it_would_drop_or_cannot_run_before_any_work(flags, message, tmp_path, capfd):
    """Each was accepted: overrides the bench replaces were dropped without a word; a config the device cannot run
    failed its own row with a traceback and exit 0 (or, asking for CUDA here, died in NCCL's setup); a product of
    --steps and --microbatches began writing ~10 TB of random tokens."""
    output = tmp_path / "mfu.json"
    result = loom_here(capfd, "bench", "mfu", "--config", "tiny", "--steps", "1", *flags, "--output", str(output))
    one_line_error(result, message)
    assert not result.stdout and not output.exists()


def test_bench_profile_on_cpu_keeps_the_sizes_it_is_given(monkeypatch, capfd):
    """On CPU the profile shrinks the model's sequence and micro-batch, and shrank them over the user's own."""
    from loom.tools.bench import kernel_profile

    seen = []

    def profile_loom(base, data, run_dir, args, device):
        seen.append((base.train.seq_length, base.train.micro_batch_size))
        return {"aten::mm": 1.0}, 2.0, 1.0

    monkeypatch.setattr(kernel_profile, "profile_loom", profile_loom)
    for flags, sizes in (([], (64, 2)), (["--train.seq_length", "32"], (32, 2))):
        result = loom_here(capfd, "bench", "profile", "--steps", "1", "--no-plain", *flags)
        assert result.returncode == 0, result.stderr
        assert seen.pop() == sizes
    one_line_error(loom_here(capfd, "bench", "profile", "--parallel.cp", "2"), "--parallel.cp: loom bench profile")


def test_kernel_profile_runs_on_cpu_and_says_how_long_the_device_waited(capfd):
    """The GPU session's breakdown command, at tiny sizes: every kind of kernel per step for loom and the plain
    loop, and loom's step against the time a kernel ran (on CPU: a top-level aten operator)."""
    rendezvous_before = {name: os.environ.get(name) for name in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    result = loom_here(capfd, "bench", "profile", "--steps", "2", "--warmup", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    # its world-size-1 group is gone with the variables it set (ranks launched later would read them)
    assert {name: os.environ.get(name) for name in rendezvous_before} == rendezvous_before
    assert not torch.distributed.is_initialized()
    lines = result.stdout.splitlines()
    assert lines[0] == "| ms per step | loom (defaults) | plain loop |"
    total = next(line for line in lines if line.startswith("| total |"))
    assert all(float(cell) > 0 for cell in total.strip("|").split("|")[1:])
    wall, busy, waiting = map(
        float, re.findall(r"took ([\d.]+) ms.* for ([\d.]+) of them.*host: ([\d.]+) ms", lines[-1])[0]
    )
    assert 0 < busy <= wall and waiting == pytest.approx(wall - busy, abs=0.11)


def test_busy_time_counts_overlapping_kernels_once():
    from loom.tools.bench.kernel_profile import busy_ms

    class Event:
        def __init__(self, start, end, name="aten::mm"):
            self.time_range = type("Span", (), {"start": start, "end": end})
            self.name = name

    class Profile:
        def events(self):  # us: 0-10 and 5-15 overlap, 20-30 apart, 1-2 nested, a non-aten record ignored
            return [Event(20, 30), Event(0, 10), Event(5, 15), Event(1, 2), Event(40, 90, "step")]

    assert busy_ms(Profile(), torch.device("cpu"), steps=1) == pytest.approx(0.025)


def test_a_stop_that_comes_while_a_row_compiles_ends_the_bench(monkeypatch):
    """torch.compile wraps a stop raised mid-compile (the lease's SIGTERM) in its own BackendCompilerFailed: the
    plain loop's row took it for a compiler failure and ran again eagerly, and a row's guard would have reported
    it as a failed row and gone on; both end the bench instead."""
    import torch

    from loom.engine.config_io import load_config
    from loom.launch.local import Stopped
    from loom.tools.bench import harness, mfu

    def compiling(**kwargs):
        try:
            raise Stopped("SIGTERM", "stopped by SIGTERM")
        except Stopped as stop:
            raise RuntimeError("backend='inductor' raised: Stopped") from stop

    monkeypatch.setattr(mfu, "run_plain_loop", compiling)
    settings = mfu.Throughput(steps=1, warmup=0, microbatches=1, compile=True)
    with pytest.raises(Stopped):
        mfu._plain_row(settings, load_config("tiny"), torch.device("cpu"))
    with pytest.raises(Stopped):
        harness.guarded(lambda: compiling(), lambda why: why, torch.device("cpu"))
    assert harness.guarded(lambda: 1 / 0, lambda why: why, torch.device("cpu")).startswith("failed: ZeroDivisionError")


def test_the_plain_loop_refuses_what_it_would_time_as_another_model():
    """The plain loop (and transformers' Llama beside it) attends to every earlier position, uncapped, with pre-norm
    blocks: a Gemma 2's ratio against it would compare two different models."""
    from loom.engine.config_io import load_config
    from loom.tools.bench.plain_loop import unsupported_reason

    assert unsupported_reason(load_config("llama-1b").model) is None
    windowed = load_config("llama-1b", ["--model.sliding_window", "512"]).model
    assert "uncapped, with pre-norm blocks" in unsupported_reason(windowed)
    assert unsupported_reason(load_config("gemma2-2b").model) is not None

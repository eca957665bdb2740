"""Where a training step's device time goes, by kernel kind: loom's Trainer beside the plain PyTorch loop.

    loom bench profile [--config llama-1b] [--steps 2] [--optim.grad_dtype bf16 ...]

For the GPU sessions that have minutes, not hours: one command prints ms per step of GEMMs, attention, Triton
(inductor's fused kernels), other element-wise kernels, reductions, the optimizer, copies and collectives, for
loom's defaults on one device and for tools/bench/plain_loop.py on the same shape, then the 15 costliest
kernels of each, and how long loom's step took against the time the device had a kernel running (the rest is
the device waiting for the host). The profiler runs over `--steps` steps after `--warmup` (compilation included
in the warm-up). On CPU it runs with tiny sizes and names aten operators instead of kernels (a smoke test,
tests/test_bench_mfu.py, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from loom.engine.config_io import load_config, parse_overrides
from loom.tools.bench import harness
from loom.tools.bench.plain_loop import run_plain_loop

CPU_SIZES = {"seq_length": 64, "micro_batch_size": 2}
"""The train fields a profile on CPU (a smoke test) shrinks, unless given as overrides."""

# First match wins: substrings of CUDA kernel names (cuBLAS/CUTLASS/cuDNN/FlashAttention/Triton/NCCL naming) and of
# aten operators on CPU. Inductor's kernels are one kind whatever they fuse (their names list the fused ops).
KINDS = (
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("triton (inductor)", ("triton_",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("collective", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy_kernel", "direct_copy", "aten::copy_", "aten::cat", "aten::_to_copy")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "scaled_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("reduction", ("reduce", "norm", "softmax", "aten::max", "aten::sum")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(mark in lowered for mark in marks)), "other element-wise")


def kernel_times(prof, device: torch.device, steps: int) -> dict[str, float]:
    """ms per step of each kernel (device time; on CPU each aten operator's own time)."""
    times: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us > 0 and (device.type == "cuda" or event.key.startswith("aten::")):
            times[event.key] += us / 1000 / steps
    return dict(times)


def summary(times: dict[str, float]) -> dict[str, float]:
    kinds: dict[str, float] = defaultdict(float)
    for name, ms in times.items():
        kinds[kind_of(name)] += ms
    return dict(sorted(kinds.items(), key=lambda item: -item[1]))


def busy_ms(prof, device: torch.device, steps: int) -> float:
    """ms per step in which the device ran at least one kernel (on CPU: an aten operator): the union of their
    intervals, so overlapping (or nested) ones count once."""
    if device.type == "cuda":
        spans = [e.time_range for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        spans = [e.time_range for e in prof.events() if e.name.startswith("aten::")]
    busy, end = 0.0, float("-inf")
    for span in sorted(spans, key=lambda s: s.start):
        if span.end > end:
            busy += span.end - max(span.start, end)
            end = span.end
    return busy / 1000 / steps


def _activities(device: torch.device) -> list:
    return [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]


def profile_loom(base, data: str, run_dir: str, args, device: torch.device) -> tuple[dict[str, float], float, float]:
    """(ms per step of each kernel, ms per step of wall time, ms per step with a kernel running) for loom."""
    from loom.engine.train import Trainer

    config = harness.bench_config(base, data, run_dir, args.warmup + args.steps, args.microbatches)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(config)
        try:
            for _ in range(args.warmup):
                trainer.train_step()
            harness.sync(device)
            with profile(activities=_activities(device)) as prof:
                start = time.perf_counter()
                for _ in range(args.steps):
                    trainer.train_step()
                harness.sync(device)
                wall_ms = (time.perf_counter() - start) * 1000 / args.steps
        finally:
            trainer.close()
    del trainer
    harness.free_memory(device)
    return kernel_times(prof, device, args.steps), wall_ms, busy_ms(prof, device, args.steps)


def profile_plain(base, args, device: torch.device) -> dict[str, float]:
    """The plain loop has no step hook: profile its whole run and divide by its steps (compiling costs host
    time, not kernel time, so the warm-up steps only add their own kernels: counted in the division)."""
    t = base.train
    with profile(activities=_activities(device)) as prof:
        run_plain_loop(
            base.model,
            t.seq_length,
            t.micro_batch_size,
            args.microbatches,
            args.steps,
            args.warmup,
            device,
            t.precision,
            compile_model=device.type == "cuda",
        )
        harness.sync(device)
    harness.free_memory(device)
    return kernel_times(prof, device, args.warmup + args.steps)


def format_report(columns: dict[str, dict[str, float]], top: int = 15) -> str:
    kinds = sorted({k for times in columns.values() for k in summary(times)})
    names = list(columns)
    lines = ["| ms per step | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for kind in kinds + ["total"]:
        cells = [
            sum(times.values()) if kind == "total" else summary(times).get(kind, 0.0) for times in columns.values()
        ]
        lines.append(f"| {kind} | " + " | ".join(f"{ms:.1f}" for ms in cells) + " |")
    for name, times in columns.items():
        lines += ["", f"{name}: the {top} costliest kernels (ms per step)"]
        for kernel, ms in sorted(times.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"  {ms:8.2f}  {kind_of(kernel):18s} {kernel[:110]}")
    return "\n".join(lines)


def run(args: argparse.Namespace, overrides: list[str]) -> None:
    """Entry point of `loom bench profile` (launch/cli_bench.py)."""
    harness.refuse_bench_set_fields(overrides, "profile")
    cuda = torch.cuda.is_available()
    config_name = args.config or ("llama-1b" if cuda else "tiny")
    base = load_config(config_name, overrides)
    if not cuda:  # a smoke test on CPU: tiny sizes, unless asked for others
        given = parse_overrides(overrides).get("train", {})
        sizes = {name: value for name, value in CPU_SIZES.items() if name not in given}
        base = harness.with_overrides(base, {"train": sizes})
    device = harness.bench_device(base, args.warmup + args.steps, args.microbatches)
    columns, step = {}, ""
    with tempfile.TemporaryDirectory() as tmp:
        t = base.train
        data = harness.random_tokens_for(
            base, (args.warmup + args.steps + 1) * t.micro_batch_size * args.microbatches, tmp
        )
        with harness.single_process_group(device):
            name = f"loom ({' '.join(overrides) or 'defaults'})"
            columns[name], wall, busy = profile_loom(base, data, tmp + "/run", args, device)
            step = (
                f"{name}: a step took {wall:.1f} ms (profiled), the device ran kernels for {busy:.1f} of them; "
                f"waiting for the host: {wall - busy:.1f} ms ({100 * (wall - busy) / wall:.0f}%)"
            )
            if not args.no_plain:
                columns["plain loop"] = profile_plain(base, args, device)
    print(format_report(columns) + "\n\n" + step, flush=True)

"""`loom bench ...`: benchmarks that print their figures against baselines measured in the same run.

Thin argument parsing over tools/bench/; `loom bench mfu` is the training-throughput one (tokens/s,
TFLOP/s, MFU against the datasheet and a measured GEMM peak, BF16 vs FP8, loom vs a plain loop).
"""

from __future__ import annotations

import argparse

from loom.launch.arguments import int_in, output_file

OVERWRITE_RESULT = (
    "replace an --output file that is not an earlier result of this benchmark run the same way (config, device)"
)
OVERRIDES = """\
Config fields can be overridden as --section.field value, except what the bench sets itself (the layout:
world size 1; the steps, batch, data and checkpoints: --steps, --warmup, --microbatches, random tokens, nothing
saved)"""

EPILOG_MFU = f"""\
{OVERRIDES} and FP8 (--fp8-recipe, --fp8-output-layer), e.g.
  loom bench mfu --config configs/llama-1b.toml --steps 20 --train.seq_length 2048 --model.compile true
  loom bench mfu --config configs/tiny.toml --steps 5                       (CPU, seconds)
Runs one process (world size 1) on train.device: loom at the config's precision, loom with FP8
(skipped with the reason where unavailable), the same model as a plain PyTorch loop and, where transformers
is installed, LlamaForCausalLM of the same shape (eager, SDPA); then the ratios between them."""


EPILOG_PROFILE = f"""\
Prints ms per step of GEMMs, attention, inductor's fused kernels, other element-wise kernels, reductions,
the optimizer, copies and collectives for loom and for the same model as a plain loop, the 15 costliest
kernels of each, and how long loom's step took against the time the device ran a kernel (the rest: the
device waiting for the host).
{OVERRIDES}, e.g.
  loom bench profile --no-plain --train.precision bf16 --train.fp8 current
On CPU it runs tiny sizes (seq 64, micro-batch 2, unless given others) and names aten operators instead of
kernels: a smoke test, not a measurement."""


def cmd_bench_mfu(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.tools.bench.mfu import run

    run(args, overrides)


def cmd_bench_gpu(args: argparse.Namespace) -> None:
    from loom.tools.bench.gpu import run

    run(args)


def cmd_bench_profile(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.tools.bench.kernel_profile import run

    run(args, overrides)


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks with same-run baselines (mfu, gpu, profile)")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    mfu = kinds.add_parser(
        "mfu",
        help="tokens/s, TFLOP/s and MFU: loom BF16/FP8 vs a plain PyTorch loop",
        epilog=EPILOG_MFU,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mfu.add_argument("--config", required=True, help="TOML config, e.g. configs/llama-1b.toml")
    mfu.add_argument("--steps", type=int_in(1, 100_000), default=10, help="measured steps per run (after --warmup)")
    mfu.add_argument(
        "--warmup", type=int_in(0, 100_000), default=2, help="steps not measured (allocator, autotuning, compile)"
    )
    mfu.add_argument(
        "--microbatches", type=int_in(1, 100_000), default=4, help="micro-batches per step (gradient accumulation)"
    )
    mfu.add_argument(
        "--fp8-recipe",
        choices=("auto", "delayed", "current"),
        default="auto",
        help="FP8 row's recipe; auto: delayed with Transformer Engine, else current (torch._scaled_mm)",
    )
    mfu.add_argument(
        "--fp8-output-layer",
        dest="fp8_output_layers",
        action="store_const",
        const=(True,),
        default=(False,),
        help="the FP8 row runs the output layer's GEMMs in FP8 too (train.fp8_output_layer; needs current scaling)",
    )
    mfu.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the plain loop (default: on CUDA yes, on CPU no: inductor's CPU compile "
        "takes longer than the whole CPU benchmark)",
    )
    mfu.add_argument(
        "--gemm-size",
        type=int_in(16, 65_536),
        help="square GEMM size for the measured peak (default 8192 GPU, 512 CPU)",
    )
    mfu.add_argument("--output", type=output_file, help="also write the figures as JSON to this file")
    mfu.add_argument("--overwrite", action="store_true", help=OVERWRITE_RESULT)
    mfu.set_defaults(handler=cmd_bench_mfu, takes_overrides=True)

    gpu = kinds.add_parser(
        "gpu",
        help="everything a GPU must answer, in one table: GEMM peak, BF16/FP8 MFU, loom vs plain loop, "
        "FP8 loss gap, a world-size-1 NCCL run",
        description="8-10 minutes on one H100/H200 (llama-1b); --quick runs tiny sizes (seconds on CPU).",
    )
    gpu.add_argument("--quick", action="store_true", help="tiny sizes: the CPU check that the command works")
    gpu.add_argument("--config", help="model for the throughput rows (default: llama-1b, or tiny with --quick)")
    gpu.add_argument("--output", type=output_file, help="JSON file for the figures (default: bench_gpu.json)")
    gpu.add_argument("--overwrite", action="store_true", help=OVERWRITE_RESULT)
    gpu.set_defaults(handler=cmd_bench_gpu)

    profile = kinds.add_parser(
        "profile",
        help="where a step's device time goes, by kernel kind: loom's defaults beside the plain PyTorch loop",
        epilog=EPILOG_PROFILE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    profile.add_argument("--config", help="model (default: llama-1b on a GPU, tiny at seq 64 on CPU)")
    profile.add_argument("--steps", type=int_in(1, 10_000), default=2, help="profiled steps (after --warmup)")
    profile.add_argument(
        "--warmup", type=int_in(0, 10_000), default=3, help="steps run first, unprofiled (compiling, autotuning)"
    )
    profile.add_argument(
        "--microbatches", type=int_in(1, 100_000), default=4, help="micro-batches per step (gradient accumulation)"
    )
    profile.add_argument("--no-plain", action="store_true", help="profile loom only, not the plain loop too")
    profile.set_defaults(handler=cmd_bench_profile, takes_overrides=True)

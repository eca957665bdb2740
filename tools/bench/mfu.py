"""`loom bench mfu`: tokens/s, TFLOP/s and MFU of loom's Trainer on one device, against baselines of the same run.

Rows, all on the same device and the same random tokens shape, world size 1:
  loom <precision>     the config as given, with loom's defaults (its precision; kernels and model.compile
                       chosen as in training: compiled on CUDA); `loom plan`'s prediction beside it
  loom fp8             the same with train.fp8 (TE delayed scaling, else torch._scaled_mm current
                       scaling); skipped with the reason when FP8 is unavailable (CPU, pre-Ada GPU)
  plain PyTorch loop   the same model written plainly (tools/bench/plain_loop.py), torch.compile'd
                       on CUDA (--compile / --no-compile to choose)
  transformers         LlamaForCausalLM of the same shape: eager, SDPA, autocast, fused AdamW on CUDA
MFU is model FLOPs (engine/flops.py, the one count) over the datasheet dense peak of the device
(engine.flops.PEAK_TFLOPS; none on CPU) and over a GEMM peak measured in this run (bf16 on CUDA,
the run's precision on CPU). No asserts: figures move with load, compare within one run.

    loom bench mfu --config configs/llama-1b.toml --steps 20 [--train.seq_length 2048 ...]
    loom bench mfu --config configs/tiny.toml --steps 5                   # CPU smoke run, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from loom.engine.atomic import write_text_atomically
from loom.engine.config import ConfigError, LoomConfig
from loom.engine.config_io import load_config
from loom.engine.flops import model_flops_per_token, peak_tflops
from loom.engine.metrics import memory_gb
from loom.engine.model.kernels import PARAM_DTYPES
from loom.tools.bench import harness
from loom.tools.bench.plain_loop import (
    TransformersLlama,
    median,
    run_plain_loop,
    transformers_reason,
    unsupported_reason,
)


@dataclass
class Throughput:
    """How the rows are measured: `loom bench mfu`'s flags (launch/cli_bench.py); `loom bench gpu` sets its own."""

    steps: int
    """Measured steps per run, after `warmup`."""
    warmup: int
    """Steps run first and not measured (the allocator, autotuning, the compile)."""
    microbatches: int
    """Micro-batches per step (gradient accumulation)."""
    fp8_recipe: str = "auto"
    """The FP8 row's recipe: delayed, current, or auto (delayed with Transformer Engine, else current)."""
    fp8_output_layers: tuple[bool, ...] = (False,)
    """One FP8 row for each: whether that row runs the output layer's GEMMs in FP8 too (train.fp8_output_layer)."""
    compile: bool | None = None
    """torch.compile the plain loop; None: on CUDA, not on CPU."""
    gemm_size: int | None = None
    """Square GEMM size for the measured peak; None: 8192 on CUDA, 512 on CPU."""
    attention_backends: tuple[str, ...] = ()
    """Rows of loom's defaults with another of SDPA's kernels alone (model.attention_backend): which is fastest."""
    defaults_row: bool = True
    """Measure loom's defaults (False: only the other loom rows, for a bench that measured the defaults before)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Throughput:
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls) if hasattr(args, field.name)})


@dataclass
class Row:
    name: str
    tokens_per_s: float | None = None
    mem_gb: float | None = None
    note: str = ""
    config: LoomConfig | None = None
    """loom's rows: the config that ran, for `loom plan`'s prediction beside the measurement."""


def gemm_peak_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """Measured dense GEMM throughput: the practical ceiling of this device in this run."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    harness.sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    harness.sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def run_loom(config: LoomConfig, warmup: int, device: torch.device) -> tuple[list[float], float, str]:
    """Train with loom's Trainer; returns tokens/s of the steps after warmup, peak memory (GB), kernels line."""
    from loom.engine.train import Trainer

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the Trainer's console lines; the table says it all
        trainer = Trainer(config)
        try:
            rows = trainer.run()
        finally:
            trainer.close()
    lines = printed.getvalue().splitlines()
    kernels = next((line for line in lines if line.startswith("kernels:")), "")
    # Whether the blocks compiled (and in how long) or fell back to eager decides what the row's figure means.
    compiling = next((line for line in lines if line.startswith(("model.compile", "warning: model.compile"))), "")
    if compiling:
        print(f"bench: {compiling}", file=sys.stderr, flush=True)
        kernels = f"{kernels}; {compiling}" if kernels else compiling
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][warmup:]
    mem = memory_gb(device)
    del trainer
    harness.free_memory(device)
    return rates, mem, kernels


def measure(settings: Throughput, base: LoomConfig, baselines: bool = True) -> dict:
    """Every row's figures (module docstring); without `baselines`, loom's rows only."""
    from loom.engine.train import pick_device

    device = pick_device(base.train.device, 0)
    t = base.train
    precision = t.precision
    results = {
        "device": harness.device_name(device),
        "torch": torch.__version__,
        "precision": precision,
        "seq_length": t.seq_length,
        "micro_batch_size": t.micro_batch_size,
        "microbatches": settings.microbatches,
        "rows": [],
    }
    flops = model_flops_per_token(base.model, t.seq_length)
    steps = settings.warmup + settings.steps
    with tempfile.TemporaryDirectory() as tmp:
        data = harness.random_tokens_for(base, (steps + 1) * t.micro_batch_size * settings.microbatches, tmp)
        rows = []
        started = time.perf_counter()

        def done(row: Row) -> None:
            rows.append(row)
            report_row(row, time.perf_counter() - started)

        def defaults_row() -> Row:
            config = harness.bench_config(base, data, str(Path(tmp) / "bf16"), steps, settings.microbatches)
            rates, mem, kernels = run_loom(config, settings.warmup, device)
            results["kernels"] = kernels
            return Row(f"loom {precision} (defaults)", median(rates), mem, kernels, config)

        if settings.defaults_row:
            done(_guarded(f"loom {precision} (defaults)", defaults_row, device))
        for backend in settings.attention_backends:
            done(_guarded(*_attention_backend_row(settings, base, data, tmp, steps, device, backend), device))
        for output_layer in settings.fp8_output_layers:
            done(_guarded(*_fp8_row(settings, base, data, tmp, steps, device, output_layer), device))
        if baselines:
            if device.type == "cuda":  # the baselines run with torch's choice of attention kernel, whatever loom's was
                from loom.engine.model.kernels import enable_only_sdpa_backend

                enable_only_sdpa_backend("auto")
            done(_guarded("plain PyTorch loop", lambda: _plain_row(settings, base, device), device))
            done(_guarded("transformers LlamaForCausalLM", lambda: _transformers_row(settings, base, device), device))
    gemm_dtype = PARAM_DTYPES["bf16" if device.type == "cuda" else precision]
    size = settings.gemm_size or (8192 if device.type == "cuda" else 512)
    gemm = gemm_peak_tflops(device, gemm_dtype, size, repeats=50 if device.type == "cuda" else 10)
    datasheet = (
        peak_tflops(results["device"], "bf16" if precision == "fp32" and device.type == "cuda" else precision)
        if device.type == "cuda"
        else None
    )
    results.update(
        flops_per_token=flops,
        gemm_peak_tflops=gemm,
        gemm_dtype=str(gemm_dtype).replace("torch.", ""),
        datasheet_peak_tflops=datasheet,
    )
    for row in rows:
        achieved = row.tokens_per_s * flops / 1e12 if row.tokens_per_s else None
        results["rows"].append(
            {
                "name": row.name,
                "tokens_per_s": row.tokens_per_s,
                "tflops": achieved,
                "mfu_datasheet": achieved / datasheet if achieved and datasheet else None,
                "mfu_measured_gemm": achieved / gemm if achieved else None,
                "mem_gb": row.mem_gb,
                "note": row.note,
                **_planned(row, results["device"]),
            }
        )
    return results


def _guarded(name: str, make_row: Callable[[], Row], device: torch.device) -> Row:
    return harness.guarded(make_row, lambda why: Row(name, note=why), device)


def report_row(row: Row, seconds: float) -> None:
    """One stderr line per finished row: the command runs minutes on a GPU, and a run cut short keeps its figures."""
    figures = f"{row.tokens_per_s:,.0f} tokens/s, {row.mem_gb:.1f} GB" if row.tokens_per_s else row.note
    print(f"bench: {row.name}: {figures} ({seconds:.0f} s so far)", file=sys.stderr, flush=True)


def _planned(row: Row, device: str) -> dict:
    """`loom plan`'s tokens/s and memory for a loom row that ran, on a GPU the planner knows; {} otherwise."""
    from loom.tools.plan import GB, estimate, gpu_kind, load_hardware
    from loom.tools.plan_bytes import layout_of

    kind = gpu_kind(device) if row.config is not None and row.tokens_per_s else None
    if kind is None:
        return {}
    predicted = estimate(row.config, layout_of(row.config), load_hardware(kind))
    return {
        "plan_tokens_per_s": predicted.tokens_per_s_per_gpu,
        "plan_mem_gb": predicted.memory["total"] / GB,
        "plan_gpu": kind,
    }


def row_by_name(results: dict, prefix: str) -> dict:
    """The row whose name starts with `prefix` (loom, loom fp8, plain, transformers)."""
    return next(row for row in results["rows"] if row["name"].startswith(prefix))


def fp8_rows(results: dict) -> list[dict]:
    """The FP8 rows, one per Throughput.fp8_output_layers entry."""
    return [row for row in results["rows"] if row["name"].startswith("loom fp8")]


def fp8_detail(row: dict) -> str:
    """The label ", output layer too" for an FP8 row whose output layer ran in FP8, else the empty string."""
    return ", output layer too" if row["name"].endswith("output layer too)") else ""


def _variant_row(
    name: str,
    configure: Callable[[], LoomConfig],
    warmup: int,
    device: torch.device,
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Row:
    """A loom row of a variant of the defaults (FP8, an attention kernel), or why it is skipped: its config, checked
    as the Trainer checks it before any work, cannot run on `device`."""
    try:
        config = harness.checked(configure, device)
    except ConfigError as error:
        return Row(name, note=harness.skip_note(error))
    with around():
        rates, mem, kernels = run_loom(config, warmup, device)
    return Row(name, median(rates), mem, kernels, config)


def _fp8_row(
    settings: Throughput, base: LoomConfig, data: str, tmp: str, steps: int, device: torch.device, output_layer: bool
) -> tuple[str, Callable[[], Row]]:
    """The FP8 row's name and how to measure it."""
    recipe = settings.fp8_recipe
    if recipe == "auto" and output_layer:  # the output layer in FP8 is loom's own linear: current scaling
        recipe = "current"
    if recipe == "auto":
        from loom.engine.model.kernels import probe_import

        has_te = device.type == "cuda" and probe_import("transformer_engine.pytorch")[0] is not None
        recipe = "delayed" if has_te else "current"
    name = f"loom fp8 ({recipe}{', output layer too' if output_layer else ''})"
    run_dir = str(Path(tmp) / f"fp8{'-output' if output_layer else ''}")

    def configure() -> LoomConfig:
        train = dict(precision="bf16", fp8=recipe, fp8_output_layer=output_layer)
        return harness.bench_config(base, data, run_dir, steps, settings.microbatches, **train)

    return name, lambda: _variant_row(name, configure, settings.warmup, device)


@contextlib.contextmanager
def fresh_graphs():
    """Tracing fixes which SDPA kernel a compiled graph calls, and dynamo does not guard on the choice: without a
    reset an attention-backend row would reuse the defaults row's graphs (torch's choice) and measure them again,
    and the rows after it would reuse its graphs. Rows of another shape (bench gpu's 8B slice) take fresh graphs
    too: every block shares one code object, and dynamo compiles a second shape of it with dynamic sizes, slower
    kernels than the static ones the first shape got (and the rows after would get them as well)."""
    from loom.engine.model.kernels import enable_only_sdpa_backend

    torch._dynamo.reset()
    try:
        yield
    finally:
        enable_only_sdpa_backend("auto")  # the rows after this one run with torch's choice again
        torch._dynamo.reset()


def _attention_backend_row(
    settings: Throughput, base: LoomConfig, data: str, tmp: str, steps: int, device: torch.device, backend: str
) -> tuple[str, Callable[[], Row]]:
    """The row of loom's defaults with SDPA's `backend` kernel alone: its name and how to measure it."""
    name = f"loom {base.train.precision}, {backend} attention"

    def configure() -> LoomConfig:
        chosen = harness.with_overrides(base, {"model": {"attention_backend": backend}})
        return harness.bench_config(chosen, data, str(Path(tmp) / backend), steps, settings.microbatches)

    return name, lambda: _variant_row(name, configure, settings.warmup, device, around=fresh_graphs)


def _loop_shape(settings: Throughput, base: LoomConfig, device: torch.device) -> dict:
    """run_plain_loop's arguments for the shape loom's rows train."""
    t = base.train
    return dict(
        c=base.model,
        seq_length=t.seq_length,
        micro_batch=t.micro_batch_size,
        microbatches=settings.microbatches,
        steps=settings.steps,
        warmup=settings.warmup,
        device=device,
        precision=t.precision,
    )


def _transformers_row(settings: Throughput, base: LoomConfig, device: torch.device) -> Row:
    """transformers' LlamaForCausalLM, eager with SDPA, autocast and fused AdamW, on the same shape."""
    name = "transformers LlamaForCausalLM (eager, sdpa)"
    reason = unsupported_reason(base.model) or transformers_reason()
    if reason:
        return Row(name, note=f"skipped: {reason}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rates = run_plain_loop(**_loop_shape(settings, base, device), compile_model=False, model_class=TransformersLlama)
    mem = memory_gb(device)
    harness.free_memory(device)
    return Row(name, median(rates), mem)


def _plain_row(settings: Throughput, base: LoomConfig, device: torch.device) -> Row:
    compiled = settings.compile if settings.compile is not None else device.type == "cuda"
    name = f"plain PyTorch loop ({'torch.compile' if compiled else 'eager'})"
    reason = unsupported_reason(base.model)
    if reason:
        return Row(name, note=f"skipped: {reason}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    plain = _loop_shape(settings, base, device)
    note = ""
    try:
        rates = run_plain_loop(**plain, compile_model=compiled)
    except Exception as error:  # noqa: BLE001 -- a compiler failure must not lose the other rows
        if (stop := harness.stop_within(error)) is not None:
            raise stop from None
        if not compiled:
            raise
        note = f"torch.compile failed ({type(error).__name__}), eager instead"
        name = "plain PyTorch loop (eager)"
        rates = run_plain_loop(**plain, compile_model=False)
    mem = memory_gb(device)
    harness.free_memory(device)
    return Row(name, median(rates), mem, note)


def format_table(results: dict) -> str:
    datasheet = results["datasheet_peak_tflops"]
    lines = [
        f"device: {results['device']}, torch {results['torch']}, seq {results['seq_length']}, "
        f"micro-batch {results['micro_batch_size']} x {results['microbatches']}, "
        f"{results['flops_per_token'] / 1e9:.3f} GFLOP/token (model FLOPs)",
        f"datasheet dense peak: {f'{datasheet:.0f} TFLOP/s' if datasheet else 'none known for this device'}; "
        f"{results['gemm_dtype']} GEMM peak measured now: {results['gemm_peak_tflops']:.3f} TFLOP/s",
        "",
        f"{'run':<44} {'tokens/s':>12} {'TFLOP/s':>10} {'MFU(sheet)':>10} {'MFU(GEMM)':>10} {'mem GB':>8}",
    ]
    for row in results["rows"]:
        if row["tokens_per_s"] is None:
            lines.append(f"{row['name']:<44} {'-':>12} {'-':>10} {'-':>10} {'-':>10} {'-':>8}  {row['note']}")
            continue
        sheet = f"{100 * row['mfu_datasheet']:.1f}%" if row["mfu_datasheet"] is not None else "-"
        lines.append(
            f"{row['name']:<44} {row['tokens_per_s']:>12,.0f} {row['tflops']:>10.3f} {sheet:>10} "
            f"{100 * row['mfu_measured_gemm']:>9.1f}% {row['mem_gb']:>8.2f}"
        )
    above_peak = [row["name"] for row in results["rows"] if (row["mfu_measured_gemm"] or 0) > 1]
    if above_peak:
        lines.append(
            f"note: {', '.join(above_peak)} ran above the GEMM peak measured now, which cannot be: the machine was "
            "busy while the peak (or the runs) were timed, so these figures are noise; rerun on a quiet machine, "
            "with more --steps"
        )
    loom, plain, hf = (
        row_by_name(results, prefix)["tokens_per_s"]
        for prefix in (f"loom {results['precision']}", "plain", "transformers")
    )
    lines.append("")
    lines.append(f"ratio loom / plain loop: {loom / plain:.3f}" if loom and plain else "ratio loom / plain loop: -")
    lines.append(f"ratio loom / transformers: {loom / hf:.3f}" if loom and hf else "ratio loom / transformers: -")
    for row in fp8_rows(results):
        fp8, what = row["tokens_per_s"], f"fp8{fp8_detail(row)} / {results['precision']}"
        lines.append(f"ratio {what}: {fp8 / loom:.3f}" if fp8 and loom else f"ratio {what}: - ({row['note']})")
    for row in results["rows"]:
        if row.get("plan_tokens_per_s") and row["tokens_per_s"]:
            lines.append(
                f"loom plan ({row['plan_gpu']}) for {row['name']}: {row['plan_tokens_per_s']:,.0f} tokens/s "
                f"({row['tokens_per_s'] / row['plan_tokens_per_s'] - 1:+.1%} measured), {row['plan_mem_gb']:.1f} GB "
                f"({row['mem_gb'] / row['plan_mem_gb'] - 1:+.1%} measured)"
            )
    lines.append(results.get("kernels", ""))
    return "\n".join(lines)


FP8_FLAGS = {"train.fp8": "--fp8-recipe", "train.fp8_output_layer": "--fp8-output-layer"}
"""`loom bench mfu`'s own flags for what its FP8 row sets."""


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    """Entry point of `loom bench mfu` (launch/cli_bench.py): check, measure, print the table, optionally save JSON."""
    from loom.tools.outputs import claim_result_file

    harness.refuse_bench_set_fields(overrides, "mfu", FP8_FLAGS)
    if args.fp8_recipe == "delayed" and True in args.fp8_output_layers:
        raise ConfigError(
            "--fp8-output-layer runs loom's own FP8 linears, which scale currently: use --fp8-recipe current (or auto)"
        )
    base = load_config(args.config, overrides)
    device = harness.bench_device(base, args.warmup + args.steps, args.microbatches)
    t = base.train
    # what was measured, as the result records it: the model (its FLOPs per token), the shape, the device, FP8's rows
    identity = {
        "device": harness.device_name(device),
        "precision": t.precision,
        "seq_length": t.seq_length,
        "micro_batch_size": t.micro_batch_size,
        "microbatches": args.microbatches,
        "flops_per_token": model_flops_per_token(base.model, t.seq_length),
        "fp8_recipe": args.fp8_recipe,
        "fp8_output_layers": list(args.fp8_output_layers),
    }
    output = claim_result_file(Path(args.output), "mfu", args.overwrite, identity) if args.output else None
    with harness.single_process_group(device):
        results = measure(Throughput.from_args(args), base)
    print(format_table(results), flush=True)
    if output is not None:
        result = {"bench": "mfu", "config": args.config, **results, **identity}
        write_text_atomically(output, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output}")
    return results

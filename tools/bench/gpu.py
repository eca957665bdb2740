"""`loom bench gpu [--quick]`: what a device must answer the first time one is there, as one markdown table + JSON.

1. the BF16 GEMM peak measured now, beside the datasheet's dense peak;
2. llama-1b (by default) BF16 training with loom's defaults (what a user gets: compiled on CUDA): tokens/s,
   model TFLOP/s, MFU by the standard formula (engine/flops.py) against the datasheet and against the measured
   GEMM peak, peak memory (`loom bench mfu`'s measurement), and `loom plan`'s prediction with its error;
3. the same with FP8 (Transformer Engine when installed, else torch._scaled_mm) and its ratio to BF16 (and, with
   the levers below, with the output layer's GEMMs in FP8 too: train.fp8_output_layer);
4. loom against the same model as a plain (torch.compile'd on CUDA) PyTorch loop and as transformers'
   LlamaForCausalLM (eager, SDPA, autocast, fused AdamW: what most users would otherwise train);
5. both FP8 runs against BF16 on an 8B-shaped slice (llama-8b's dimensions, 4 layers, seq 8192, micro-batch 1,
   no recompute),
   where the GEMMs are large enough for FP8 to pay;
   then the levers (llama-1b with cuDNN's attention, and with the output layer in FP8): measured after what the
   targets ask for, so that a lease that cuts the bench short cuts them;
6. the BF16 vs FP8 loss gap after N steps on a learnable synthetic corpus (a shallower model, so it fits), and
   with the output layer in FP8 too;
7. a world-size-1 run through the launcher (NCCL on CUDA, gloo on CPU), as `loom train --nproc 1` runs it,
   with a small global batch (the preset's 512 sequences took 96 s), eager.

On CPU the same code runs with tiny sizes (`--quick`, tested in the suite), so the command cannot rot before
a GPU arrives; FP8 rows then say why they are skipped. No asserts: the figures are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loom.engine.atomic import write_text_atomically
from loom.engine.config import ConfigError, LoomConfig
from loom.engine.config_io import load_config
from loom.tools.bench import harness, mfu
from loom.tools.outputs import claim_result_file
from loom.tools.synthetic_data import write_markov_dataset
from loom.tools.train_run import train

# (config, overrides of the throughput runs, steps, warm-up, micro-batches, loss-gap steps, loss-gap layers)
DEFAULT_OUTPUT = "bench_gpu.json"
FULL = ("llama-1b", {}, 10, 3, 4, 200, 4)
QUICK = ("tiny", {"train": {"seq_length": 64, "micro_batch_size": 2}}, 2, 1, 1, 3, 2)
# The FP8 slice: (config, overrides, micro-batches)
# (without the preset's selective recompute, which a 4-layer slice on one GPU does not need: it reran each block's
# attention forward in bf16 beside both precisions' GEMMs, and the run of 2026-11-27 was planned without it)
FULL_SLICE = (
    "llama-8b",
    {"model": {"num_layers": 4, "recompute": "none"}, "train": {"seq_length": 8192, "micro_batch_size": 1}},
    4,
)
QUICK_SLICE = (
    "tiny",
    {"model": {"num_layers": 2, "recompute": "none"}, "train": {"seq_length": 64, "micro_batch_size": 1}},
    1,
)
IDENTITY = ("config", "quick", "device")
"""What a result is of: an earlier result in the output file is replaced only by a rerun with the same."""
GAP_VOCAB = 32000  # the loss-gap corpus's vocabulary: a learnable Markov chain needs no 128k table


def _loss_curve(config: LoomConfig) -> list[float]:
    from loom.engine.train import Trainer

    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(config)
        try:
            rows = trainer.run()
        finally:
            trainer.close()
    return [row["loss"] for row in rows if "loss" in row]


def loss_gap(base: LoomConfig, steps: int, layers: int, workdir: Path, device: torch.device) -> dict:
    """Final losses of BF16 and FP8 training on the same synthetic corpus; FP8 skipped with its reason."""
    vocab = min(base.model.vocab_size, GAP_VOCAB)
    t = base.train
    documents = max(200, steps * t.micro_batch_size * 2 * t.seq_length // 200)
    data = write_markov_dataset(workdir / "markov", vocab, documents)
    shallow = harness.with_overrides(base, {"model": {"num_layers": layers, "vocab_size": vocab}})
    result = {"steps": steps, "layers": layers, "vocab_size": vocab}
    bf16 = harness.bench_config(shallow, data, str(workdir / "gap-bf16"), steps, 2, precision="bf16")
    result["bf16_final_loss"] = _loss_curve(bf16)[-1]
    print(f"bench: loss gap: bf16 {result['bf16_final_loss']:.4f} after {steps} steps", file=sys.stderr, flush=True)
    train = dict(precision="bf16", fp8="current")
    # FP8's blocks, then the output layer's GEMMs in FP8 too: by `loom plan` FP8's way to 1.25x (docs/gpu.md), if
    # its loss holds (a lever, before the launcher row: that row passed on the H200 and is what a lease cut here loses)
    for name, gap, extra in (("fp8", "gap", {}), ("fp8_output_layer", "gap_output_layer", {"fp8_output_layer": True})):
        run_dir = str(workdir / f"gap-{name}")
        configure = functools.partial(harness.bench_config, shallow, data, run_dir, steps, 2, **train, **extra)
        try:
            config = harness.checked(configure, device)
        except ConfigError as error:
            result[f"{name}_note"] = harness.skip_note(error)
            return result
        result.update(_final_loss(name, config, device))
        if f"{name}_final_loss" in result:
            result[gap] = result[f"{name}_final_loss"] - result["bf16_final_loss"]
    return result


def _final_loss(name: str, config: LoomConfig, device: torch.device) -> dict:
    """{NAME_final_loss: the last step's loss of training `config`}, or {NAME_note: why it failed}."""
    return harness.guarded(
        lambda: {f"{name}_final_loss": _loss_curve(config)[-1]}, lambda why: {f"{name}_note": why}, device
    )


def _guarded(measure: Callable[[], dict], failed: dict, device: torch.device) -> dict:
    """`measure()`, or `failed` with the error as its note: the later parts still run."""
    return harness.guarded(measure, lambda why: {**failed, "fp8_note": why}, device)


def launcher_run(config_name: str, overrides: dict, workdir: Path, device: torch.device) -> dict:
    """`loom train --nproc 1` for a few steps, as a user starts it (tools/train_run.py): NCCL on CUDA, gloo on CPU."""
    micro = overrides.get("train", {}).get("micro_batch_size") or load_config(config_name).train.micro_batch_size
    sections = {
        "data": {"paths": [write_markov_dataset(workdir / "launch", 4096, 200)], "tokenizer": None},  # synthetic ids
        "train": {
            "run_dir": str(workdir / "launch-run"),
            "steps": 5,
            "eval_interval": 0,
            "tensorboard": False,
            "global_batch_size": 2 * micro,
            "device": device.type,
        },
        "checkpoint": {"save_at_end": False},
        # eager: the row checks the launcher and NCCL, and compiling llama-1b again took a minute of an 8-minute budget
        "model": {"vocab_size": 4096, "compile": False},
    }
    for section, fields in overrides.items():
        sections.setdefault(section, {}).update(fields)
    config = load_config(config_name, sections)
    backend = "nccl" if device.type == "cuda" else "gloo"
    start = time.perf_counter()

    def trained() -> dict:
        rows = train(config, nproc=1)
        return {"backend": backend, "ok": True, "seconds": time.perf_counter() - start, "final_loss": rows[-1]["loss"]}

    def failed(why: str) -> dict:
        return {"backend": backend, "ok": False, "seconds": time.perf_counter() - start, "error": why}

    return harness.guarded(trained, failed, device)


def _fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _planned(row: dict) -> str:
    if not row.get("plan_tokens_per_s"):
        return ""
    return (
        f"; plan ({row['plan_gpu']}): {row['plan_tokens_per_s']:,.0f} tokens/s "
        f"({row['tokens_per_s'] / row['plan_tokens_per_s'] - 1:+.1%} measured), {row['plan_mem_gb']:.1f} GB "
        f"({row['mem_gb'] / row['plan_mem_gb'] - 1:+.1%} measured)"
    )


def _ratio(a: dict, b: dict) -> float | None:
    return a["tokens_per_s"] / b["tokens_per_s"] if a["tokens_per_s"] and b["tokens_per_s"] else None


def format_markdown(results: dict) -> str:
    t = results["throughput"]
    loom, plain, hf = (mfu.row_by_name(t, prefix) for prefix in (f"loom {t['precision']}", "plain", "transformers"))
    gap, launch, piece = results["loss_gap"], results["launcher"], results["fp8_slice"]
    slice_bf16 = mfu.row_by_name(piece, f"loom {piece['precision']}")
    sheet = t["datasheet_peak_tflops"]

    def mfu_cells(row: dict) -> str:
        return f"{_fmt(row['mfu_datasheet'], '.1%')} of datasheet, {_fmt(row['mfu_measured_gemm'], '.1%')} of GEMM peak"

    lines = [
        f"### loom bench gpu: {t['device']}, torch {t['torch']}, config {results['config']}",
        "",
        "| measure | value | against |",
        "| --- | --- | --- |",
        f"| {t['gemm_dtype']} GEMM peak (measured) | {t['gemm_peak_tflops']:.3g} TFLOP/s | datasheet "
        f"{_fmt(sheet, '.0f', ' TFLOP/s')} |",
    ]
    for row in (loom, *mfu.fp8_rows(t), plain, hf):
        if row["tokens_per_s"] is None:
            lines.append(f"| {row['name']} | - | {row['note']} |")
        else:
            lines.append(
                f"| {row['name']} | {row['tokens_per_s']:,.0f} tokens/s, {row['tflops']:.3g} TFLOP/s, "
                f"{row['mem_gb']:.1f} GB | MFU {mfu_cells(row)}{_planned(row)} |"
            )
    for row in t["rows"]:
        if row["name"].endswith(" attention"):
            ratio = _ratio(row, loom)
            figures = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f} tokens/s"
            against = row["note"] if ratio is None else f"{ratio:.3f} x the defaults"
            lines.append(f"| {row['name']} | {figures} | {against} |")
    for fp8 in mfu.fp8_rows(t):
        ratio = _ratio(fp8, loom)
        lines.append(
            f"| FP8{mfu.fp8_detail(fp8)} / {t['precision']} tokens/s | {_fmt(ratio)} | "
            f"{fp8['note'] if ratio is None else ''} |"
        )
    lines += [
        f"| loom / plain loop tokens/s | {_fmt(_ratio(loom, plain))} | {plain['name']} {plain['note']} |",
        f"| loom / transformers tokens/s | {_fmt(_ratio(loom, hf))} | {hf['name']} {hf['note']} |",
    ]
    for slice_fp8 in mfu.fp8_rows(piece):
        slice_ratio = _ratio(slice_fp8, slice_bf16)
        lines.append(
            f"| FP8{mfu.fp8_detail(slice_fp8)} / {piece['precision']} on the {results['slice_config']} slice "
            f"(seq {piece['seq_length']}, micro-batch {piece['micro_batch_size']}) | {_fmt(slice_ratio)} | "
            + (
                slice_fp8["note"]
                if slice_ratio is None
                else f"{slice_bf16['tokens_per_s']:,.0f} vs {slice_fp8['tokens_per_s']:,.0f} tokens/s"
                f"{_planned(slice_fp8)}"
            )
            + " |"
        )
    lines += [
        f"| loss after {gap['steps']} steps ({gap['layers']} layers) | BF16 {_fmt(gap['bf16_final_loss'], '.4f')}, FP8 "
        f"{_fmt(gap.get('fp8_final_loss'), '.4f')} | gap {_fmt(gap.get('gap'), '+.4f')} {gap.get('fp8_note', '')} |",
        f"| the same, FP8 with the output layer too | {_fmt(gap.get('fp8_output_layer_final_loss'), '.4f')} | gap "
        f"{_fmt(gap.get('gap_output_layer'), '+.4f')} "
        f"{gap.get('fp8_output_layer_note', gap.get('fp8_note', ''))} |",
        f"| world-size-1 run via the launcher ({launch['backend']}) | "
        + (f"ok, loss {launch['final_loss']:.4f}" if launch["ok"] else launch["error"])
        + f" | {launch['seconds']:.0f} s |",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Entry point of `loom bench gpu` (launch/cli_bench.py)."""
    config_name, overrides, steps, warmup, microbatches, gap_steps, gap_layers = QUICK if args.quick else FULL
    slice_name, slice_overrides, slice_microbatches = QUICK_SLICE if args.quick else FULL_SLICE
    config_name = args.config or config_name
    base = load_config(config_name, overrides)
    device = harness.bench_device(base, warmup + steps, microbatches)
    if device.type != "cuda" and not (args.quick or args.config):
        raise ConfigError(
            "loom bench gpu measures llama-1b on a GPU, and this machine shows none (on CPU it would run for hours); "
            "use --quick (tiny sizes, the check that the command works) or --config a small model"
        )
    identity = dict(zip(IDENTITY, (config_name, args.quick, harness.device_name(device)), strict=True))
    output = claim_result_file(Path(args.output or DEFAULT_OUTPUT), "gpu", args.overwrite, identity)
    # What the issue's targets ask first (defaults, FP8, the baselines; the 8B slice), then the levers after them
    # (cuDNN's attention, the output layer in FP8: by `loom plan`, FP8's one way to 1.25x, docs/gpu.md), so that a
    # lease that cuts the bench short cuts the levers.
    targets = mfu.Throughput(steps=steps, warmup=warmup, microbatches=microbatches)
    levers = dataclasses.replace(targets, defaults_row=False, attention_backends=("cudnn",), fp8_output_layers=(True,))
    slice_throughput = dataclasses.replace(targets, microbatches=slice_microbatches, fp8_output_layers=(False, True))
    results = {"bench": "gpu", **identity, "slice_config": slice_name}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with harness.single_process_group(device):
                results["throughput"] = mfu.measure(targets, base)
                with mfu.fresh_graphs():
                    slice_config = load_config(slice_name, slice_overrides)
                    results["fp8_slice"] = mfu.measure(slice_throughput, slice_config, False)
                results["throughput"]["rows"] += mfu.measure(levers, base, False)["rows"]
                results["loss_gap"] = _guarded(
                    lambda: loss_gap(base, gap_steps, gap_layers, Path(tmp), device),
                    {"steps": gap_steps, "layers": gap_layers, "bf16_final_loss": None},
                    device,
                )
                print(f"bench: loss gap: {json.dumps(results['loss_gap'])}", file=sys.stderr, flush=True)
            results["launcher"] = launcher_run(config_name, overrides, Path(tmp), device)
            print(f"bench: launcher: {json.dumps(results['launcher'])}", file=sys.stderr, flush=True)
        results["complete"] = True
    except BaseException:  # stopped part-way (a lease's limit): the parts that finished are kept, "complete" absent
        try:
            _write_results(output, results)
        except OSError as error:  # said, without taking the place of what stopped the bench
            print(f"bench: could not keep the figures: {error}", file=sys.stderr, flush=True)
        raise
    print(format_markdown(results), flush=True)  # first: a write that fails (a full disk) must not take it too
    print(f"wrote {_write_results(output, results)}")
    return results


def _partial_path(output: Path) -> Path:
    """NAME.partial.json beside NAME.json: where a stopped bench's figures go when NAME.json is complete."""
    return output.with_name(f"{output.stem}.partial{output.suffix}")


def _write_results(output: Path, results: dict) -> Path:
    """Write the results whole; those of a bench stopped part-way go beside a complete earlier result (a rerun's,
    which claim_result_file let this run replace), as NAME.partial.json, rather than over it."""
    target = output
    if not results.get("complete"):
        try:
            earlier_complete = json.loads(output.read_text()).get("complete", False)
        except (OSError, ValueError, AttributeError):
            earlier_complete = False
        if earlier_complete:
            target = _partial_path(output)
            print(
                f"bench: stopped part-way: its figures are in {target}; {output} keeps the complete result of an "
                "earlier run",
                file=sys.stderr,
                flush=True,
            )
    write_text_atomically(target, json.dumps(results, indent=2) + "\n")
    if results.get("complete"):
        _remove_superseded_partial(output, results)
    return target


def _remove_superseded_partial(output: Path, results: dict) -> None:
    """A complete result supersedes the NAME.partial.json an earlier stopped run of the same bench left beside it
    (same config, quick and device): left there, it would read as the newer figures."""
    partial = _partial_path(output)
    try:
        earlier = json.loads(partial.read_text())
    except (OSError, ValueError):
        return
    same = isinstance(earlier, dict) and all(earlier.get(key) == results.get(key) for key in ("bench", *IDENTITY))
    if same and not earlier.get("complete"):
        partial.unlink(missing_ok=True)
        print(f"bench: removed {partial}: the figures of a stopped run, superseded by these", file=sys.stderr)

"""`loom plan`: a thin wrapper over tools/plan.py."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from loom.launch.arguments import image_file, int_in

EPILOG = """\
Examples:
  loom plan --config llama-70b --gpus 1024 --gpu h100-sxm --train.global_batch_size 1024 --train.seq_length 4096
  loom plan --config llama-8b --gpus 8 --layout "tp=2,zero=1" --top 3 --plot plan.png
  loom plan --config configs/tiny.toml --gpus 8 --json
Model and batch come from the config and its --section.field overrides. Without --layout every layout is
searched (tp x cp x pp x vp x dp x micro-batch x recompute x ZeRO; cp, context parallelism, where the model
has rotary positions and no dropout); keys given in --layout are held and the rest searched. The layout fields
as overrides hold their key the same way: --parallel.tp 8 is --layout tp=8 (likewise parallel.cp, parallel.pp,
parallel.vp, parallel.dp, train.micro_batch_size, model.recompute, optim.zero, optim.offload). Memory is per
GPU on the pipeline rank holding the most, activations as compiled blocks keep them (model.compile = auto
compiles on a GPU; --model.compile false plans an eager run, which keeps more); time is per optimizer step.
Exit status 1 when no layout fits (the nearest is shown, and --json says "fits": false). The equations, their
sources, the constants (tools/gpus.toml) and the blind spots: docs/planner.md."""


def _fp8_as_loom_runs_it(overrides: list[str]) -> list[str]:
    """`--train.precision fp8` (the issue's spelling) is how loom trains in FP8: bf16 with train.fp8 = current
    (its own FP8 linears; Transformer Engine's delayed scaling plans the same)."""
    out = list(overrides)
    for i, flag in enumerate(out):
        if flag == "--train.precision=fp8" or (flag == "--train.precision" and out[i + 1 : i + 2] == ["fp8"]):
            out[i : i + (1 if "=" in flag else 2)] = ["--train.precision=bf16", "--train.fp8=current"]
            break
    return out


# The config fields that are a layout's keys: given as overrides, they hold that key as --layout does (one
# spelling per idea: --parallel.tp 8 means the same to plan as to train).
_LAYOUT_FIELDS = {
    ("parallel", "tp"): "tp",
    ("parallel", "cp"): "cp",
    ("parallel", "pp"): "pp",
    ("parallel", "vp"): "vp",
    ("parallel", "dp"): "dp",
    ("parallel", "ep"): "ep",
    ("train", "micro_batch_size"): "micro_batch_size",
    ("model", "recompute"): "recompute",
    ("optim", "zero"): "zero",
    ("optim", "offload"): "offload",
}


def _layout_overrides(config, overrides: list[str]) -> dict:
    """The layout keys held by `--section.field` overrides, with the config's (validated) values."""
    from loom.engine.config_io import parse_overrides

    given = parse_overrides(overrides)
    return {
        key: getattr(getattr(config, section), name)
        for (section, name), key in _LAYOUT_FIELDS.items()
        if name in given.get(section, {})
    }


def _with_offload(config, gpus: int, hardware, fixed: dict) -> str:
    """What offloading the optimizer to the CPU would fit (not searched unless asked: it trades step time)."""
    from loom.tools.plan import plan

    if "offload" in fixed:
        return ""
    fitting = [e for e in plan(config, gpus, hardware, {**fixed, "offload": "cpu"}) if e.fits]
    if not fitting:
        return ""
    best = fitting[0]
    fit = "1 layout fits, at" if len(fitting) == 1 else f"{len(fitting):,} layouts fit, the fastest at"
    return (
        f"; with --optim.offload cpu {fit} {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU and "
        f"{best.host_bytes / 1e9:.0f} GB of host memory per GPU"
    )


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.engine.config import ConfigError
    from loom.engine.config_io import load_config, parse_overrides
    from loom.tools.charts import claim_chart_file
    from loom.tools.plan import load_hardware, plan, plot, table

    given = parse_overrides(overrides)
    # a preset's expert parallelism is searched, not held (as its tp and pp are): checked at ep 1 unless given
    searched = [] if "ep" in given.get("parallel", {}) else ["--parallel.ep", "1"]
    config = load_config(args.config, [*_fp8_as_loom_runs_it(overrides), *searched])
    if config.lora.enabled:
        raise ConfigError(
            f"loom plan models full training, not LoRA (lora.rank = {config.lora.rank}: frozen weights, adapters "
            "alone in the optimizer): plan the base model's config without --lora.*, an upper bound for its LoRA run"
        )
    hardware = load_hardware(args.gpu, args.gpus_per_node)
    per_node = hardware.gpus_per_node
    if args.gpus > per_node and args.gpus % per_node:
        raise ConfigError(
            f"--gpus {args.gpus} is not whole nodes of {per_node} GPUs; give a multiple of {per_node} (or "
            "--gpus-per-node)"
        )
    if args.plot:
        claim_chart_file(Path(args.plot), "--plot", args.overwrite, "plan")
    if config.train.fp8 != "off" and "fp8" not in hardware.peak_tflops:
        raise ConfigError(
            f"{args.gpu} has no FP8 tensor cores; plan it without FP8 (drop --train.precision fp8, or add "
            "--train.fp8 off)"
        )
    fixed = _fixed_layout(config, args, overrides)
    estimates = plan(config, args.gpus, hardware, fixed)
    if not estimates:
        raise ConfigError(
            f"no layout of {args.gpus} GPUs divides this model and batch"
            + (f" with {args.layout}" if args.layout else "")
            + " (heads, layers, global batch / (micro-batch x dp), micro-batches per pipeline rank)"
        )
    shown = estimates[: args.top]
    fits = any(e.fits for e in estimates)
    if args.json:
        print(
            json.dumps(
                {"gpu": args.gpu, "gpus": args.gpus, "fits": fits, "layouts": [e.as_json() for e in shown]}, indent=1
            )
        )
    else:
        print(_heading(config, args, estimates))
        print(table(shown, args.gpu))
    if args.plot:
        plot(shown, Path(args.plot))
        if not args.json:
            print(f"wrote {args.plot}")
    if not fits:
        nearest = estimates[0]
        print(
            f"error: nothing fits: the nearest needs {nearest.memory['total'] / 1e9:.1f} GB per GPU ({nearest.reason})"
            + _with_offload(config, args.gpus, hardware, fixed),
            file=sys.stderr,
        )
        sys.exit(1)


def _fixed_layout(config, args: argparse.Namespace, overrides: list[str]) -> dict:
    """The layout fields the search holds: --layout's and the config overrides' (given once), checked."""
    from loom.engine.config import ConfigError
    from loom.tools.plan import parse_layout

    fixed = parse_layout(args.layout) if args.layout else {}
    for key, value in _layout_overrides(config, overrides).items():
        if key in fixed and fixed[key] != value:
            raise ConfigError(f"--layout says {key}={fixed[key]} but an override says {value}; give it once")
        fixed[key] = value
    if "zero" in fixed and (refusal := config.zero_refusal(fixed["zero"], fixed.get("ep", 1))):
        raise ConfigError(refusal)
    if "offload" in fixed and (refusal := config.optim.offload_refusal(fixed["offload"])):
        raise ConfigError(refusal)
    if "ep" in fixed and (refusal := config.expert_parallel_refusal(fixed["ep"])):
        raise ConfigError(refusal)
    if refusal := config.model.context_parallel_refusal(fixed.get("cp", 1), config.train.seq_length):
        raise ConfigError(refusal)  # said, not left to "no layout divides this model"
    if "tp" in fixed:
        config.model.check_tensor_parallel(fixed["tp"])
    sizes = {key: fixed[key] for key in ("tp", "cp", "pp", "dp") if key in fixed}
    if args.gpus % math.prod(sizes.values()):
        spelled = " x ".join(f"{key}={value}" for key, value in sizes.items())
        raise ConfigError(
            f"{spelled} takes {math.prod(sizes.values())} GPUs at a time, which --gpus {args.gpus} cannot be split into"
        )
    return fixed


def _heading(config, args: argparse.Namespace, estimates: list) -> str:
    """The table's first line: the model, the batch, the precision and what was searched."""
    from loom.tools.plan_bytes import blocks_compiled

    m, t = config.model, config.train
    output = ", output layer too" if t.fp8_output_layer else ""
    precision = t.precision + (f" with fp8 GEMMs ({t.fp8}{output})" if t.fp8 != "off" else "")
    blocks = "compiled blocks" if blocks_compiled(config) else "eager blocks"
    return (
        f"{config.train.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads; "
        f"batch {t.global_batch_size} x {t.seq_length} tokens, {precision}, {blocks}; {args.gpus} x {args.gpu}: "
        f"{len(estimates):,} layouts, {sum(e.fits for e in estimates):,} fit"
    )


def add_parser(commands) -> None:
    from loom.tools.plan_time import gpu_names  # torch-free: `loom plan` imports no torch

    p = commands.add_parser(
        "plan",
        help="which layout fits a model on a cluster, and how fast it runs (no GPU needed)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="model config: a preset name or a TOML file (default: loom's defaults)")
    p.add_argument("--gpus", type=int_in(1, 1 << 20), required=True, help="GPUs in the job")
    p.add_argument("--gpu", choices=gpu_names(), default="h100-sxm", help="GPU kind (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int_in(1, 64), help="GPUs per node (default: the GPU kind's usual 8)")
    p.add_argument("--layout", help='hold some keys, e.g. "tp=8,cp=2,pp=4,vp=2,dp=2,mbs=1,recompute=selective,zero=1"')
    p.add_argument("--top", type=int_in(1, 10_000), default=8, help="layouts shown (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--plot", type=image_file, help="write the shown layouts' memory and time breakdowns to this PNG (or PDF, SVG)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace --plot even if it is not a chart `loom plan` drew")
    p.set_defaults(handler=cmd_plan, takes_overrides=True)

"""`loom demo`: every capability that has landed, end to end, on the embedded default corpus.

corpus (Python stdlib) -> clean (repair + code filters) -> exact and MinHash near dedup -> SentencePiece tokenizer ->
.bin/.idx -> 3D-parallel training on local CPU ranks (tensor + sequence, interleaved pipeline, data parallel with the
ZeRO-1 optimizer) with validation and a checkpoint -> the measured pipeline timeline next to the ideal one -> the
checkpoint resharded and training resumed under another layout (pipeline x context parallel: each sequence split over
2 ranks, ring attention; ZeRO-3, weights sharded too, with the optimizer offloaded to the CPU) -> evaluation ->
Hugging Face export -> Megatron-LM export and its import back -> the whole model fine-tuned from its weights (bf16,
ZeRO-2) -> LoRA adapters fine-tuned on it, merged, and exported for PEFT -> a mixture-of-experts variant trained under
tensor and sequence parallelism and exported as a Mixtral, and with DeepSeek-V3's routing under expert parallelism
-> the run continued as a Slurm job (where sbatch is on
PATH) -> a summary. Each step's outputs stay in the work directory, so the next command (`loom train
--config configs/tiny.toml ...`) can reuse them. Steps whose outputs already exist are reused, not redone. The data
steps (1-5) are launch/demo_data.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
import tomllib
from pathlib import Path

from loom.engine.config import ConfigError, LoomConfig
from loom.engine.config_io import config_to_dict, load_config
from loom.engine.run_dir import CHECKPOINTS, CONFIG, SCHEDULE_CHART, read_metrics
from loom.launch.arguments import OLDER, add_parallel_size, int_in, output_dir
from loom.launch.demo_data import prepare_data, preview_first_sample, step

DEMO_MARK = ".loom-demo"
"""Written into a workdir the demo used, so that its next run there may replace the demo's own outputs."""

DEMO_OUTPUTS = (
    "runs/tiny",
    "runs/tiny-resharded",
    "runs/tiny-resumed",
    "runs/tiny-finetuned",
    "runs/tiny-lora",
    "runs/tiny-lora-merged",
    "runs/tiny-slurm",
    "hf",
    "hf-lora-adapter",
    "megatron",
    "runs/tiny-from-megatron",
    "runs/tiny-moe",
    "runs/tiny-moe-biased",
    "hf-moe",
)
"""What each demo writes anew (a fresh run, not a resume of an earlier demo's)."""

DEMO_DATA = (
    "data/corpus.jsonl",
    "data/clean",
    "data/dedup",
    "data/near_dedup",
    "data/tokenizer.model",
    "data/stdlib_text_document.bin",
    "data/stdlib_text_document.idx",
)
"""The data steps' outputs: an earlier demo's are reused (or rebuilt), so another's would be used or replaced."""


def _claim_workdir(workdir: Path) -> None:
    """Clear an earlier demo's outputs from `workdir`; refuse, before any work, a workdir where they would
    replace files no demo wrote there (`--workdir .` beside the README's runs/tiny, say)."""
    present = [workdir / name for name in DEMO_OUTPUTS if (workdir / name).exists()]
    data = [workdir / name for name in DEMO_DATA if (workdir / name).exists()]
    if (present or data) and not (workdir / DEMO_MARK).exists() and not _an_older_demo(workdir):
        names = ", ".join(str(path.relative_to(workdir)) for path in (present + data)[:3])
        raise ConfigError(
            f"--workdir {workdir} holds {names}, which no demo wrote there and the demo would use or replace; give "
            "it a folder of its own (the default is demo/)"
        )
    for path in present:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / DEMO_MARK).write_text(
        "loom demo's workdir: its next run here replaces runs/tiny*, hf/, hf-moe/, hf-lora-adapter/, megatron/\n"
    )


def _an_older_demo(workdir: Path) -> bool:
    """A workdir a demo used before the mark existed: its runs/tiny trained on this workdir's demo dataset."""
    try:
        trained = tomllib.loads((workdir / "runs" / "tiny" / CONFIG).read_text())["data"]["paths"]
    except (OSError, ValueError, KeyError):
        return False
    return [str(Path(p).resolve()) for p in trained] == [str((workdir / "data/stdlib_text_document").resolve())]


def run_demo(workdir: Path, max_docs: int | None, nproc: int, steps: int, tp: int, pp: int, vp: int) -> dict:
    layout = load_config("configs/tiny.toml", {"parallel": {"tp": tp, "pp": pp, "vp": vp}})
    layout.resolve_world(nproc)  # a layout the training step would refuse is refused before the data steps run
    _claim_workdir(workdir)
    summary: dict = {}
    prefix, tokenizer_model = prepare_data(workdir / "data", max_docs, summary)
    config = _train(workdir, prefix, tokenizer_model, nproc, steps, (tp, pp, vp), summary)
    _schedule(Path(config.train.run_dir), summary)
    summary["layout"] = f"tp={tp} pp={pp} vp={vp} dp={config.parallel.dp}"
    summary.update(_move_checkpoint(workdir, config, steps))
    summary.update(_finetune(workdir, config, steps))
    summary.update(_experts(workdir, config, steps))
    summary.update(_slurm_job(workdir, config, steps))
    return summary


def _train(
    workdir: Path, prefix: str, tokenizer_model: str, nproc: int, steps: int, layout: tuple, summary: dict
) -> LoomConfig:
    """Step 6: tiny.toml under the demo's 3D layout, with validation and a checkpoint at its last step."""
    from loom.engine.preflight import preflight
    from loom.launch.cli_datasets import build_sample_indices
    from loom.launch.local import launch_local
    from loom.tools.plan import predicted_line

    tp, pp, vp = layout
    run_dir = workdir / "runs" / "tiny"
    config = load_config(
        "configs/tiny.toml",
        {
            "data": {"paths": [prefix], "tokenizer": tokenizer_model},
            "train": {
                "run_dir": str(run_dir),
                "steps": steps,
                "eval_interval": max(1, steps // 2),
                "log_interval": max(1, min(5, steps // 10)),  # a short demo's first and last rows differ
                "record_pipeline_timeline": True,
            },
            "checkpoint": {"interval": steps},
            "parallel": {"tp": tp, "pp": pp, "vp": vp, "sequence_parallel": True},
            "optim": {"zero": 1},
        },
    )
    preflight(config, nproc)
    print(f"offline, as `loom data index` in a preprocessing job: {build_sample_indices(config)}")
    preview_first_sample(config, tokenizer_model)
    start = step(
        f"6/11 train: configs/tiny.toml on {nproc} CPU ranks: tp={tp} (sequence parallel) x pp={pp} "
        f"(interleaved, vp={vp}) x dp={config.parallel.dp} (ZeRO-1), {steps} steps"
    )
    print(predicted_line(config, None)[0])
    launch_local(config, nproc)
    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    summary.update(
        first_loss=train_rows[0]["loss"],
        first_step=train_rows[0]["step"],
        last_loss=train_rows[-1]["loss"],
        val_loss=val_rows[-1]["val_loss"] if val_rows else None,
        val_ppl=val_rows[-1]["val_ppl"] if val_rows else None,
        train_seconds=round(time.perf_counter() - start, 1),
        run_dir=str(run_dir),
        steps=steps,
    )
    return config


def _schedule(run_dir: Path, summary: dict) -> None:
    """Step 7: the last step's measured pipeline timeline drawn next to the ideal schedule."""
    from loom.tools.schedule_plot import describe, draw, load_measured

    step("7/11 schedule: the last step's measured pipeline timeline next to the ideal one")
    layout, measured = load_measured(run_dir)
    text, timeline = describe(layout["pp"], layout["vp"], layout["microbatches"])
    print(text)
    summary["schedule_png"] = str(run_dir / SCHEDULE_CHART)
    summary["bubble"] = timeline.bubble_fraction
    draw(layout["pp"], layout["vp"], layout["microbatches"], Path(summary["schedule_png"]), measured)


def _move_checkpoint(workdir: Path, config, steps: int) -> dict:
    """Reshard the checkpoint offline, resume under another layout, evaluate, export to Hugging Face."""
    from loom.engine.checkpoint.format import CheckpointError
    from loom.launch.local import launch_local
    from loom.tools.ckpt import reshard
    from loom.tools.hf import export_hf

    start = step(
        "8/11 checkpoint: reshard to tp=1 pp=2 offline, resume on 4 ranks as pp=2 x cp=2 (sequences split over 2 "
        "ranks; ZeRO-3 over them, CPU offload) for "
        f"{steps // 2} more steps, evaluate, export to Hugging Face and to Megatron-LM (and back)"
    )
    runs = workdir / "runs"
    resharded = reshard(runs / "tiny" / CHECKPOINTS, runs / "tiny-resharded" / CHECKPOINTS, tp=1, pp=2)
    print(f"resharded: {resharded}")
    try:  # a writer aimed at another run's checkpoints is refused, not obeyed (it would repoint `latest`)
        reshard(runs / "tiny" / CHECKPOINTS, runs / "tiny" / CHECKPOINTS, tp=1, pp=2)
    except CheckpointError as refusal:
        print(f"the same reshard into the run's own checkpoints is refused: {refusal}")
    trained = config_to_dict(config)
    resumed = load_config(
        None,
        {
            **trained,
            "parallel": {"tp": 1, "pp": 2, "vp": 1, "cp": 2, "dp": None, "sequence_parallel": False},
            "optim": {**trained["optim"], "zero": 3, "offload": "cpu"},  # ZeRO-1's state resumes into any stage
        },
    )
    resumed.train.run_dir, resumed.train.steps = str(runs / "tiny-resumed"), steps + steps // 2
    resumed.train.record_pipeline_timeline, resumed.checkpoint.load = False, str(resharded)
    resumed.resolve_world(4)
    launch_local(resumed, 4)
    rows = read_metrics(runs / "tiny-resumed")
    hf_dir = export_hf(runs / "tiny-resumed" / CHECKPOINTS, workdir / "hf")
    val = [r for r in rows if "val_loss" in r]
    files = ", ".join(sorted(p.name for p in hf_dir.iterdir()))
    print(
        f"exported {hf_dir} ({files}: transformers' Llama and AutoTokenizer load it) in "
        f"{time.perf_counter() - start:.1f} s"
    )
    megatron = _megatron_round_trip(runs / "tiny-resumed" / CHECKPOINTS, workdir)
    sample = _sample(runs / "tiny-resumed" / CHECKPOINTS, config.data.tokenizer)
    print(f"sample (greedy, KV-cached, as `loom generate` writes it): {sample!r}")
    return {
        "megatron": megatron,
        "sample": sample,
        "resumed_from": steps,
        "resumed_loss": [r for r in rows if "loss" in r][-1]["loss"],
        "resumed_val_loss": val[-1]["val_loss"] if val else None,
        "hf_dir": str(hf_dir),
    }


def _megatron_round_trip(checkpoints: Path, workdir: Path) -> str:
    """Export the resumed model as Megatron-LM's torch_dist checkpoint, import it back, and compare every weight."""
    import torch

    from loom.engine.checkpoint.format import find_loadable
    from loom.engine.checkpoint.load import PieceReader
    from loom.tools.megatron_checkpoint import import_megatron
    from loom.tools.megatron_export import export_megatron

    exported, flags = export_megatron(checkpoints, workdir / "megatron")
    back, _ = import_megatron(workdir / "megatron", workdir / "runs" / "tiny-from-megatron" / CHECKPOINTS)
    (ours, ours_meta), (theirs, theirs_meta) = find_loadable(checkpoints), find_loadable(back)
    mine, again = PieceReader(ours, ours_meta), PieceReader(theirs, theirs_meta)
    same = sum(torch.equal(mine.model(name), again.model(name)) for name in ours_meta.specs)
    told = f"{exported} (Megatron-LM --load, with {flags.split(' --hidden-dropout')[0]}); import-megatron reads it back"
    print(f"exported {told}: {same} of {len(ours_meta.specs)} weights identical")
    return f"{told}: {same} of {len(ours_meta.specs)} weights identical"


def _finetune(workdir: Path, config, steps: int) -> dict:
    """The resumed model fine-tuned whole (checkpoint.finetune: its weights at step 1 of a schedule of its own, in
    bf16 with ZeRO-2 over 2 data-parallel ranks), then LoRA adapters on it at tp 2, merged into it and exported for
    PEFT."""
    from loom.launch.local import launch_local
    from loom.tools.hf import export_peft_adapter
    from loom.tools.lora import merge_lora

    lora_steps = max(2, steps // 4)
    start = step(
        f"9/11 fine-tune: the resumed model's weights from step 1 (fresh optimizer, bf16, ZeRO-2 over dp=2) for "
        f"{lora_steps} steps; rank-8 LoRA adapters on the resumed model (base frozen), tp=2 on 2 ranks for "
        f"{lora_steps} steps, merged into a full checkpoint, exported as a PEFT adapter"
    )
    runs = workdir / "runs"
    trained = config_to_dict(config)
    lr = trained["optim"]["lr"]  # a fine-tune's: lower, without warm-up
    whole = load_config(
        None,
        {
            **trained,
            "parallel": {"tp": 1, "pp": 1, "vp": 1, "dp": None, "sequence_parallel": False},
            "optim": {**trained["optim"], "zero": 2, "lr": lr / 3, "min_lr": lr / 30, "warmup_steps": 0},
            "train": {**trained["train"], "precision": "bf16", "steps": lora_steps, "record_pipeline_timeline": False},
            "checkpoint": {
                **trained["checkpoint"],
                "interval": lora_steps,
                "load": str(runs / "tiny-resumed"),
                "finetune": True,
            },
        },
    )
    whole.train.run_dir = str(runs / "tiny-finetuned")
    whole.resolve_world(2)
    launch_local(whole, 2)
    finetuned = [r["loss"] for r in read_metrics(runs / "tiny-finetuned") if "loss" in r]
    tuned = load_config(
        None,
        {
            **config_to_dict(config),
            "parallel": {"tp": 2, "pp": 1, "vp": 1, "dp": None, "sequence_parallel": True},
            "lora": {"rank": 8, "alpha": 16.0, "base": str(runs / "tiny-resumed" / CHECKPOINTS)},
        },
    )
    tuned.train.run_dir, tuned.train.steps, tuned.train.record_pipeline_timeline = (
        str(runs / "tiny-lora"),
        lora_steps,
        False,
    )
    tuned.checkpoint.interval = lora_steps
    tuned.resolve_world(2)
    launch_local(tuned, 2)
    rows = read_metrics(runs / "tiny-lora")
    merged = merge_lora(runs / "tiny-lora", runs / "tiny-lora-merged" / CHECKPOINTS)
    adapter = export_peft_adapter(runs / "tiny-lora", workdir / "hf-lora-adapter")
    print(f"merged {merged}; PEFT adapter {adapter} in {time.perf_counter() - start:.1f} s")
    return {
        "finetune_loss": (finetuned[0], finetuned[-1]),
        "lora_loss": [r for r in rows if "loss" in r][-1]["loss"],
        "lora_adapter": str(adapter),
    }


def _experts(workdir: Path, config, steps: int) -> dict:
    """The tiny model with a mixture of experts in every block, trained from scratch under tensor and sequence
    parallelism with its load-balancing loss, then exported to Hugging Face as the Mixtral it is."""
    from loom.engine.checkpoint.format import find_loadable
    from loom.engine.checkpoint.load import saved_expert_biases
    from loom.launch.local import launch_local
    from loom.tools.hf import export_hf

    moe_steps = max(2, steps // 4)
    start = step(
        f"10/11 experts: the tiny model with 4 experts a block (each token to its top 2, as Mixtral), trained from "
        f"scratch on 2 ranks (tp=2, sequence parallel) for {moe_steps} steps, exported to Hugging Face"
    )
    trained = config_to_dict(config)
    moe = load_config(
        None,
        {
            **trained,
            "model": {**trained["model"], "num_experts": 4, "moe_top_k": 2},
            "parallel": {"tp": 2, "pp": 1, "vp": 1, "dp": None, "sequence_parallel": True},
            "train": {**trained["train"], "steps": moe_steps, "record_pipeline_timeline": False, "eval_interval": 0},
            "checkpoint": {**trained["checkpoint"], "interval": moe_steps},
        },
    )
    moe.train.run_dir = str(workdir / "runs" / "tiny-moe")
    moe.resolve_world(2)
    launch_local(moe, 2)
    rows = [row for row in read_metrics(workdir / "runs" / "tiny-moe") if "loss" in row]
    exported = export_hf(Path(moe.train.run_dir), workdir / "hf-moe")
    print(f"exported {exported} in {time.perf_counter() - start:.1f} s")
    # DeepSeek-V3's routing: sigmoid scores and auxiliary-loss-free balancing, each expert's bias moved towards the
    # batch's mean load after every step; under expert parallelism, each rank holding two of the four experts, and
    # group-limited routing with a group per rank (DeepSeek-V2's device-limited routing: a token's experts on one rank)
    print(
        "the same with DeepSeek-V3's routing (sigmoid scores, experts' biases instead of most of the balancing loss) "
        "on 2 ranks each holding two of the four experts (parallel.ep = 2), a token's two experts on one of them "
        "(model.moe_router_groups = 2)"
    )
    biased = load_config(None, config_to_dict(moe))
    routing = {"moe_router_score": "sigmoid", "moe_expert_bias": True, "moe_expert_bias_rate": 0.01}
    routing.update(moe_router_groups=2, moe_router_group_top_k=1)
    biased.model = dataclasses.replace(biased.model, **routing, moe_aux_loss_coeff=0.0001)  # DeepSeek-V3's weight
    biased.parallel.tp, biased.parallel.sequence_parallel, biased.parallel.dp, biased.parallel.ep = 1, False, None, 2
    biased.train.run_dir = str(workdir / "runs" / "tiny-moe-biased")
    biased.resolve_world(2)
    launch_local(biased, 2)
    biases = saved_expert_biases(*find_loadable(Path(biased.train.run_dir)))
    return {
        "moe_loss": (rows[0]["loss"], rows[-1]["loss"]),
        "moe_balance": rows[-1]["moe_aux_loss"] / moe.model.num_layers,
        "moe_hf": str(exported),
        "moe_biases": (min(b.min().item() for b in biases.values()), max(b.max().item() for b in biases.values())),
    }


def _sample(checkpoints: Path, tokenizer: str, prompt: str = "def ") -> str:
    """What the trained model writes after `prompt`: the first thing a person looks at after training."""
    import sentencepiece

    from loom.tools.generate import generate, load_model

    model, _ = load_model(checkpoints)
    processor = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
    ids = processor.encode(prompt)
    return processor.decode(ids + generate(model, ids, 24, stop_ids=(processor.eos_id(),)))


def _slurm_job(workdir: Path, config, steps: int) -> dict:
    """Continue the resumed run as a Slurm job, where this machine can submit one."""
    from loom.launch.slurm import SlurmOptions, slurm_unavailable, submit
    from loom.launch.slurm_jobs import follow

    step(f"11/11 slurm: continue the run as a Slurm job (1 node x 4 tasks, tp=2 x dp=2) for {steps // 2} more steps")
    reason = slurm_unavailable()
    if reason:
        print(
            f"skipped: {reason}. `python -m loom.tools.slurm_cluster up /tmp/loom-slurm` starts a one-node cluster "
            "here (root; installs Debian's Slurm); `source /tmp/loom-slurm/env.sh`, then run the demo again"
        )
        return {"slurm": None, "slurm_skipped": reason}
    runs = workdir / "runs"
    job_config = load_config(
        None, {**config_to_dict(config), "parallel": {"tp": 2, "pp": 1, "vp": 1, "dp": None, "sequence_parallel": True}}
    )
    job_config.train.run_dir, job_config.train.steps = str(runs / "tiny-slurm"), steps + 2 * (steps // 2)
    job_config.train.record_pipeline_timeline = False
    job_config.checkpoint.load = str(runs / "tiny-resumed" / CHECKPOINTS)
    job = submit(job_config, SlurmOptions(tasks_per_node=4, time_minutes=10, job_name="loom-demo"))
    print(f"submitted job {job.job_id}; following rank 0's log", flush=True)
    state = follow(job.job_id, Path(job_config.train.run_dir))
    rows = read_metrics(runs / "tiny-slurm")
    losses = [r["loss"] for r in rows if "loss" in r]
    return {
        "slurm": {
            "job_id": job.job_id,
            "state": state,
            "last_loss": losses[-1] if losses else None,
            "run_dir": job_config.train.run_dir,
        }
    }


def _plan_at_scale() -> str:
    """What `loom plan` says of a real job: the best layout of llama-70b on 1,024 H100s."""
    from loom.tools.plan import load_hardware, plan

    config = load_config("llama-70b", {"train": {"global_batch_size": 1024, "seq_length": 4096, "precision": "bf16"}})
    best = plan(config, 1024, load_hardware("h100-sxm"))[0]
    return (
        f"llama-70b on 1,024 H100s: {best.layout.describe()}, {best.memory['total'] / 1e9:.0f} GB per GPU, "
        f"MFU {best.mfu:.0%} (loom plan --config llama-70b --gpus 1024; docs/planner.md)"
    )


def _print_summary(summary: dict) -> None:
    print("\n== summary")
    print(
        f"corpus       {summary['corpus_mb']} MB of Python stdlib, {summary['clean']['rejected']:,} rejected by clean, "
        f"{summary['dedup']['removed']:,} exact and {summary['near_dedup']['removed']:,} near duplicates removed "
        f"-> {summary['documents']:,} documents, "
        f"{summary['tokens']:,} tokens"
    )
    print(
        f"training     {summary['layout']}, ZeRO-1: loss {summary['first_loss']:.3f} at step {summary['first_step']} "
        f"-> {summary['last_loss']:.3f} at step {summary['steps']} in {summary['train_seconds']} s"
    )
    if summary["val_loss"] is not None:
        print(f"validation   loss {summary['val_loss']:.3f}, perplexity {summary['val_ppl']:.1f}")
    print(f"pipeline     ideal bubble {summary['bubble']:.1%}; measured vs ideal: {summary['schedule_png']}")
    print(
        "checkpoint   resharded to tp=1 pp=2, resumed as pp=2 x cp=2 (context parallel) with ZeRO-3 + CPU offload "
        f"from step {summary['resumed_from']}: "
        f"loss {summary['resumed_loss']:.3f}, validation {summary['resumed_val_loss']:.3f}"
    )
    print(f"hugging face {summary['hf_dir']} (transformers.LlamaForCausalLM.from_pretrained loads it)")
    print(f"megatron     {summary['megatron']}")
    first, last = summary["finetune_loss"]
    print(
        f"fine-tune    the resumed weights from step 1 (checkpoint.finetune), bf16, ZeRO-2 over dp=2: loss "
        f"{first:.3f} -> {last:.3f}"
    )
    print(
        f"lora         rank-8 adapters at tp=2 on the resumed model: loss {summary['lora_loss']:.3f}; "
        f"PEFT adapter {summary['lora_adapter']}"
    )
    first, last = summary["moe_loss"]
    print(
        f"experts      4 a block, top 2, tp=2 SP: loss {first:.3f} -> {last:.3f}, load balance "
        f"{summary['moe_balance']:.2f} a block (1 is even); {summary['moe_hf']} (a MixtralForCausalLM); "
        f"DeepSeek-V3's routing at ep 2: experts' biases {summary['moe_biases'][0]:+.2f} .. "
        f"{summary['moe_biases'][1]:+.2f}"
    )
    print(f"sample       {summary['sample']!r}  (loom generate --checkpoint {summary['run_dir']}-resumed/checkpoints)")
    slurm = summary.get("slurm")
    if slurm:
        print(
            f"slurm        job {slurm['job_id']} {slurm['state']} as tp=2 x dp=2: loss {slurm['last_loss']:.3f} "
            f"({slurm['run_dir']})"
        )
    else:
        print(f"slurm        skipped ({summary['slurm_skipped']}); see docs/slurm.md")
    print(f"plan         {_plan_at_scale()}")
    print(f"run          {summary['run_dir']}/metrics.jsonl, tensorboard/, config.toml")
    print("next         loom train --config configs/tiny.toml --nproc 4 --parallel.tp 2   (same losses, any layout)")


def _cmd_demo(args: argparse.Namespace) -> None:
    summary = run_demo(Path(args.workdir), args.max_docs, args.nproc, args.steps, args.tp, args.pp, args.vp)
    _print_summary(summary)


def add_parser(commands) -> None:
    p = commands.add_parser("demo", help="the whole pipeline on the embedded corpus, on CPU ranks")
    p.add_argument(
        "--workdir",
        type=output_dir,
        default="demo",
        help="where data and runs go: data/ is reused, an earlier demo's runs and exports are replaced (a folder "
        "holding other files in their places is refused)",
    )
    p.add_argument(
        "--max-docs",
        type=int_in(80, 1_000_000),
        help="use only this many corpus documents (faster); at least 80, or the 98,1,1 split leaves validation none",
    )
    p.add_argument("--nproc", type=int_in(1, 1024), default=8, help="local ranks for training")
    add_parallel_size(p, "tp", "tensor-parallel size", default=2)
    add_parallel_size(p, "pp", "pipeline stages (the rest of --nproc is data parallel)", default=2)
    add_parallel_size(p, "vp", "interleaved chunks per pipeline stage", default=2)
    p.add_argument(
        "--train.steps",
        "--steps",
        dest="steps",
        type=int_in(2, 100_000),
        default=50,
        help="training steps" + OLDER,
    )
    p.set_defaults(handler=_cmd_demo)

"""`loom ckpt inspect|reshard|export-hf|import-hf|import-megatron|export-megatron|merge-lora`, `loom eval` and
`loom generate`: thin wrappers over tools/ and the trainer."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from loom.engine.config import ConfigError
from loom.launch.arguments import (
    OLDER,
    add_parallel_size,
    dataset_prefix,
    existing_dir,
    existing_file,
    existing_path,
    float_in,
    int_in,
    output_dir,
    seed,
)

OVERWRITE = (
    "replace what --output holds (another run's checkpoints or model files): it is moved into "
    "OUTPUT/replaced/<time>/, not deleted; without it such an output is refused"
)
LORA_BASE = "a LoRA checkpoint's base model, if it moved since training (checked to be the same by its sha256)"


def _inspect(args: argparse.Namespace) -> None:
    from loom.tools.ckpt import inspect

    print(inspect(Path(args.directory)))


SHOW_TIME_AFTER_S = 2.0
"""A checkpoint tool's time is shown once it passes this (a 1B model's merge or export takes tens of seconds in
silence otherwise); a quick command, or its one-line error, stays alone."""


@contextlib.contextmanager
def _writing(args: argparse.Namespace) -> Iterator[None]:
    """The lock on --output while the command writes there: two writers into one folder would share iter_N.tmp
    (each clearing the other's files) or model.safetensors (engine/run_lock.writing_output). An --output the
    command made and failed to fill (a full disk, a stop) is removed again."""
    from loom.data_tools.progress import Elapsed
    from loom.engine.run_lock import writing_output

    output = Path(args.output)
    existed = output.exists()
    command = f"ckpt {args.ckpt_command}"
    shown = Elapsed(f"loom {command}: reading and writing a model into {args.output}", delay_s=SHOW_TIME_AFTER_S)
    with writing_output(output, command, named=f"--output {args.output}"), shown:
        try:
            yield
        except BaseException:
            if not existed:
                with contextlib.suppress(OSError):
                    output.rmdir()  # only if empty: what the failed command left that looks written stays seen
            raise


def _reshard(args: argparse.Namespace) -> None:
    from loom.tools.ckpt import reshard

    with _writing(args):
        final = reshard(Path(args.checkpoint), Path(args.output), args.tp, args.pp, args.vp, overwrite=args.overwrite)
    print(
        f"wrote {final} for tp={args.tp} pp={args.pp} vp={args.vp} (any dp loads it); "
        f"resume with --checkpoint.load {args.output}"
    )


def _base(args: argparse.Namespace) -> Path | None:
    return Path(args.lora_base) if args.lora_base else None


def _export_hf(args: argparse.Namespace) -> None:
    from loom.tools.hf import export_hf, export_peft_adapter

    if args.adapter_only:
        if args.dtype or args.tokenizer:
            raise ConfigError(
                f"--{'dtype' if args.dtype else 'tokenizer'} is for the whole model's export; --adapter-only writes "
                "the adapters alone, in float32"
            )
        with _writing(args):
            out = export_peft_adapter(
                Path(args.checkpoint), Path(args.output), _base(args), args.base_model, args.overwrite
            )
        named = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        print(
            f"wrote {out}: adapter_config.json + adapter_model.safetensors; base_model_name_or_path "
            + (f"{named}" if named else "unset (the base was not imported from Hugging Face; pass --base-model)")
            + " (peft.PeftModel.from_pretrained(base, DIR) loads it onto the exported base)"
        )
        return
    if args.base_model:
        raise ConfigError("--base-model names the base of a PEFT adapter; it goes with --adapter-only")
    moved = Path(args.tokenizer) if args.tokenizer else None
    with _writing(args):
        out = export_hf(Path(args.checkpoint), Path(args.output), _base(args), args.overwrite, args.dtype, moved)
    written = json.loads((out / "config.json").read_text())
    tokenizer = " + the tokenizer (AutoTokenizer loads it)" if (out / "tokenizer_config.json").is_file() else ""
    print(
        f"wrote {out}: model.safetensors ({written['torch_dtype']}) + config.json "
        f"(transformers.{written['architectures'][0]}.from_pretrained loads it){tokenizer}"
    )


def _merge_lora(args: argparse.Namespace) -> None:
    from loom.tools.lora import merge_lora

    with _writing(args):
        final = merge_lora(Path(args.checkpoint), Path(args.output), _base(args), args.overwrite)
    print(f"wrote {final}: the base model with the adapters folded in; export, generate or train from it")


def _import_hf(args: argparse.Namespace) -> None:
    from loom.tools.hf import import_hf

    with _writing(args):
        final = import_hf(Path(args.input), Path(args.output), args.overwrite)
    print(
        f"wrote {final}; fine-tune it with --checkpoint.load {args.output} --checkpoint.finetune true in a run "
        f"directory of its own (or LoRA: --lora.base {args.output})"
    )


def _import_megatron(args: argparse.Namespace) -> None:
    from loom.tools.megatron_checkpoint import import_megatron

    with _writing(args):
        final, imported = import_megatron(Path(args.input), Path(args.output), args.overwrite)
    print(f"wrote {final}: {imported}")
    print(
        f"fine-tune it with --checkpoint.load {args.output} --checkpoint.finetune true in a run directory of its own "
        f"(or LoRA: --lora.base {args.output}); Megatron-built .bin/.idx datasets train as they are"
    )


def _export_megatron(args: argparse.Namespace) -> None:
    from loom.engine.checkpoint.format import MEGATRON_TRACKER
    from loom.tools.megatron_export import export_megatron

    with _writing(args):
        iteration, flags = export_megatron(
            Path(args.checkpoint), Path(args.output), _base(args), args.overwrite, args.dtype
        )
    print(f"wrote {iteration} and {Path(args.output) / MEGATRON_TRACKER}")
    print(f"Megatron-LM loads it under any tensor/pipeline layout with: --load {args.output} --finetune {flags}")
    if iteration.name != "release":
        step = int(iteration.name.removeprefix("iter_"))
        print(
            f"or, in place of --finetune, --no-load-optim --no-load-rng to go on at iteration {step} with "
            "its samples consumed, a fresh optimizer and learning-rate schedule (not with --vocab-file: Megatron then "
            "compares its --tokenizer-type with the checkpoint's, which loom does not know)"
        )


EVAL_ATTEMPTS = 3
"""How many checkpoints `loom eval` of a live run tries when the run's retention removes the one it reads."""
WHOLE_DATASET = "0,100,0"
"""`loom eval --split`'s default: every document of --data is in the part evaluated."""


def refuse_to_run_as_a_rank(command: str) -> None:
    """`loom eval` and `loom generate` start their own ranks (--nproc): under torchrun or srun (RANK and WORLD_SIZE
    > 1 in the environment) each process ran the whole command, every node printing the same result."""
    world = os.environ.get("WORLD_SIZE", "1")
    if "RANK" in os.environ and world.isdigit() and int(world) > 1:
        raise ConfigError(
            f"loom {command} starts its own ranks (--nproc N), but RANK={os.environ['RANK']}, WORLD_SIZE={world} in "
            "the environment make this process one rank of a torchrun/srun launch: run it once, outside torchrun "
            "(unset RANK and WORLD_SIZE if they are left from another job)"
        )


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> None:
    refuse_to_run_as_a_rank("eval")
    from loom.engine.checkpoint.format import CheckpointError
    from loom.launch.local import RankFailed
    from loom.tools.ckpt import open_checkpoint

    given = Path(args.checkpoint)
    for attempt in range(1, EVAL_ATTEMPTS + 1):
        directory = None
        try:
            directory, metadata = open_checkpoint(given)
            return _evaluate(args, overrides, directory, metadata)
        except (ConfigError, CheckpointError, RankFailed, OSError):
            # A run that trains on beside this evaluation deletes its older checkpoints (checkpoint.keep).
            if not (_removed(directory) if directory is not None else not given.exists()):
                raise
            where = directory or given
            removed = f"checkpoint {where} was removed while it was read (a live run's checkpoint.keep?)"
            if attempt == EVAL_ATTEMPTS or directory is None or given.resolve() == directory.resolve():
                raise ConfigError(f"{removed}; evaluate a copy of it, or when that run has stopped") from None
            print(f"{removed}; evaluating the newest one again", flush=True)


def _removed(directory: Path) -> bool:
    """Whether checkpoint `directory`, intact when the evaluation opened it, is gone or going (a removal underway
    leaves a folder without all its files)."""
    from loom.engine.checkpoint.format import CheckpointError, read_metadata

    try:
        read_metadata(directory, verify_hashes=False)
    except (CheckpointError, OSError):
        return True
    return False


def _evaluate(args: argparse.Namespace, overrides: list[str], directory: Path, metadata) -> None:
    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.config_io import config_from_dict, parse_overrides
    from loom.engine.parallel.rendezvous import start_rank_server
    from loom.engine.preflight import preflight
    from loom.launch.local import launch_local
    from loom.tools.generate import check_trained_tokenizer

    if metadata.lora_base is None and parse_overrides(overrides).get("lora", {}).get("base"):
        raise ConfigError(f"{directory} is not a LoRA checkpoint, so --lora.base has nothing to do; drop it")
    trained_with = (metadata.tokenizer or {}).get("path") or metadata.config["data"].get("tokenizer")
    raw = metadata.config
    raw["parallel"].update(tp=1, pp=1, vp=1, cp=1, ep=1, dp=None)
    raw["optim"].update(zero=0, offload="none")
    raw["data"].update(paths=[args.data], split=args.split, weights=None)
    recorded = (metadata.tokenizer or {}).get("path")
    if raw["data"].get("tokenizer") and recorded and Path(recorded).is_file():
        raw["data"]["tokenizer"] = recorded  # the config's may be relative to where training ran: not here
    with tempfile.TemporaryDirectory() as run_dir:
        raw["train"].update(run_dir=run_dir, tensorboard=False, eval_iters=args.iters)
        raw["checkpoint"].update(load=str(directory), interval=0, verify=False)  # open_checkpoint checked it
        for section, values in parse_overrides(overrides).items():
            raw[section].update(values)
        config = config_from_dict({s: {k: v for k, v in fields.items() if v is not None} for s, fields in raw.items()})
        start_rank_server()  # its imports overlap the checks below
        preflight(config, args.nproc, training=False)
        tokenizer = config.data.tokenizer
        if tokenizer and Path(tokenizer).is_file():  # the model knows which it learned; the dataset, which built it
            explicit = "tokenizer" in parse_overrides(overrides).get("data", {})
            advice = "its loss would score another vocabulary's ids: evaluate on a dataset built with that tokenizer"
            check_trained_tokenizer(tokenizer, metadata, trained_with, explicit, advice)
        check_same_tokenizer(config.data.paths, config.data.tokenizer)  # the dataset's manifest knows
        t = config.train
        part = "all of it" if args.split == WHOLE_DATASET else "train,valid,test"
        print(
            f"loom eval: {t.eval_iters} batches of {t.global_batch_size} x {t.seq_length} tokens of {args.data}'s "
            f"valid split (--split {args.split}: {part}) on "
            f"{args.nproc} rank(s), {t.precision} (--iters, --train.global_batch_size, --train.seq_length, "
            "--train.precision)",
            flush=True,
        )
        launch_local(config, args.nproc, mode="eval")


def cmd_generate(args: argparse.Namespace) -> None:
    refuse_to_run_as_a_rank("generate")
    import sys

    from loom.engine.config_io import config_from_dict
    from loom.tools.ckpt import open_checkpoint
    from loom.tools.generate import (
        generate,
        generate_parallel,
        load_model,
        open_tokenizer,
        parse_prompt_ids,
        stop_reason,
    )

    if args.nproc != args.tp * args.pp:
        raise ConfigError(f"--nproc {args.nproc} must equal --parallel.tp x --parallel.pp = {args.tp} x {args.pp}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt is not valid UTF-8 text; pass UTF-8, or the prompt as --prompt-ids") from None
    opened = open_checkpoint(Path(args.checkpoint))
    config = config_from_dict(opened[1].config)
    processor = open_tokenizer(opened[1], config, args.tokenizer, needed=args.prompt_ids is None)
    if args.prompt_ids is not None:
        prompt = parse_prompt_ids(args.prompt_ids)
    else:
        prompt = ([processor.bos_id()] if processor.bos_id() >= 0 else []) + processor.encode(args.prompt)
    # With a tokenizer, the ids it can decode (a model's vocabulary may be padded beyond its pieces).
    vocab_size = processor.vocab_size() if processor is not None else config.model.vocab_size
    if not prompt or max(prompt) >= vocab_size or min(prompt) < 0:
        raise ConfigError(f"the prompt's token ids must lie in [0, {vocab_size}); got {prompt[:8]}")
    positions = config.model.max_position_embeddings
    if len(prompt) > positions:
        raise ConfigError(
            f"the prompt has {len(prompt):,} tokens but the model has {positions:,} positions; shorten it"
        )
    stops = (processor.eos_id(),) if processor is not None and processor.eos_id() >= 0 else ()
    job = dict(
        prompt=prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=stops,
        vocab_size=vocab_size,
    )
    if args.nproc > 1:
        from loom.launch.local import killed_rank, stopped_rank
        from loom.tools.generate import RankDied

        try:  # the model is loaded by the ranks alone, each its own part: split because it may not fit one process
            produced = generate_parallel(opened, args.tp, args.pp, _base(args), **job)
        except RankDied as died:
            stopped = stopped_rank([(died.rank, died.exitcode)], "the generation")
            raise stopped or killed_rank(died.rank, died.exitcode) from None
    else:
        produced = generate(load_model(Path(args.checkpoint), base=_base(args), opened=opened)[0], **job)
    if processor is not None:
        print(processor.decode(prompt + produced))
    else:
        print(" ".join(str(t) for t in prompt + produced))
    print(
        f"generated {len(produced)} of up to {args.max_new_tokens} tokens after a {len(prompt)}-token prompt; "
        f"stopped {stop_reason(produced, args.max_new_tokens, stops, positions)}",
        file=sys.stderr,
    )


def _checkpoint_input(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--checkpoint",
        "--input",
        dest="checkpoint",
        type=existing_path,
        required=True,
        help=f"{what}: an iter_N directory, a checkpoints/ folder or a run directory" + OLDER,
    )


def _checkpoint_output(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--output", type=output_dir, required=True, help=what)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE)


def add_parsers(commands) -> None:
    ckpt = commands.add_parser(
        "ckpt",
        help="checkpoint tools: inspect, reshard, export-hf, import-hf, import-megatron, export-megatron, merge-lora",
    )
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    tools = (_add_inspect, _add_reshard, _add_export_hf, _add_merge_lora, _add_import_hf)
    for add in (*tools, _add_import_megatron, _add_export_megatron):
        add(sub)
    _add_eval(commands)
    _add_generate(commands)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="layout, step, tokens and the tensor table of a checkpoint")
    p.add_argument(
        "directory", type=existing_path, help="an iter_N directory or a checkpoints/ folder (its newest intact one)"
    )
    p.set_defaults(handler=_inspect)


def _add_reshard(sub) -> None:
    p = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint for another tp/pp/vp layout, offline, streaming",
        description="Any layout already loads any checkpoint; resharding writes the pieces a "
        "target layout reads, one file per rank. DP needs no reshard.",
    )
    _checkpoint_input(p, "the checkpoint to reshard")
    _checkpoint_output(p, "a checkpoints/ folder of its own to write iter_N and latest into")
    add_parallel_size(p, "tp", "target tensor-parallel size (default 1)", default=1)
    add_parallel_size(p, "pp", "target pipeline stages (default 1)", default=1)
    add_parallel_size(p, "vp", "target chunks per stage", default=1)
    p.set_defaults(handler=_reshard)


def _add_export_hf(sub) -> None:
    p = sub.add_parser(
        "export-hf",
        help="write a Hugging Face model (safetensors + config.json): Llama-format (Qwen2, Qwen3, Phi-3, Granite, "
        "OLMo 2, Nemotron, Gemma; Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, MiniMax-M2, GLM-4.5 for a mixture of "
        "experts), or GPT-2 for a GPT-2-shaped one",
    )
    _checkpoint_input(p, "the checkpoint to export")
    _checkpoint_output(p, "a folder of its own for model.safetensors and config.json")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write only its adapters as a PEFT adapter directory (without it: the merged model)",
    )
    p.add_argument(
        "--base-model",
        help="with --adapter-only: base_model_name_or_path for PEFT, e.g. a hub name or the base's export folder "
        "(default: the Hugging Face folder the base was imported from, where it was)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="the weights' dtype in model.safetensors (default: what an imported model came in, else float32: "
        "loom's weights as they are; bfloat16 halves the file, as most published models are)",
    )
    p.add_argument(
        "--tokenizer",
        type=existing_file,
        help="where the tokenizer the model trained with is now, if it moved (checked by the sha256 the checkpoint "
        "records); written beside the model for AutoTokenizer",
    )
    p.add_argument("--lora.base", dest="lora_base", type=existing_path, help=LORA_BASE)
    p.set_defaults(handler=_export_hf)


def _add_merge_lora(sub) -> None:
    p = sub.add_parser(
        "merge-lora",
        help="fold a LoRA run's adapters into its base: a full checkpoint",
        description="Reads the adapters and the base model they point to (checked by sha256) and writes "
        "W + (alpha/r) B A for every adapted layer as a weights-only checkpoint (step 0, any layout loads it).",
    )
    _checkpoint_input(p, "the LoRA run's checkpoint")
    _checkpoint_output(p, "a checkpoints/ folder of its own to write iter_0000000 and latest into")
    p.add_argument("--lora.base", dest="lora_base", type=existing_path, help=LORA_BASE)
    p.set_defaults(handler=_merge_lora)


def _add_import_hf(sub) -> None:
    p = sub.add_parser(
        "import-hf",
        help="turn a Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, OLMo 2, Nemotron, "
        "Gemma, Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, MiniMax-M2, GLM-4.5, GPT-2) into a loom checkpoint",
        description="Reads config.json and the *.safetensors weights (a shard index's files) of a LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4), "
        "GraniteForCausalLM, Olmo2ForCausalLM, NemotronForCausalLM, GemmaForCausalLM (Gemma 2 and 3's too; an "
        "image-text Gemma 3's text model), MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, "
        "Qwen2MoeForCausalLM, MiniMaxM2ForCausalLM, Glm4MoeForCausalLM or GPT2LMHeadModel, with default, linear, "
        "llama3, longrope or yarn RoPE, and writes a loom checkpoint of step 0 with that model's [model] settings, "
        "loadable in any layout."
        " A setting loom cannot compute alike is refused, never dropped; a sliding window is model.sliding_window"
        " (a Qwen's, over its later layers alone, becomes max_position_embeddings, where full attention computes "
        "the same). Example: loom ckpt import-hf --input Llama-3.2-1B --output imported/llama-1b, then fine-tune "
        "with --checkpoint.load imported/llama-1b --checkpoint.finetune true.",
    )
    p.add_argument("--input", type=existing_dir, required=True, help="directory with config.json and *.safetensors")
    _checkpoint_output(p, "a checkpoints/ folder of its own to write iter_0000000 and latest into")
    p.set_defaults(handler=_import_hf)


def _add_import_megatron(sub) -> None:
    p = sub.add_parser(
        "import-megatron",
        help="turn a Megatron-LM checkpoint (torch_dist or torch, any layout it trained in) into a loom checkpoint",
        description="Reads Megatron-LM's --save folder (the iteration its latest_checkpointed_iteration.txt names) "
        "or one iter_N folder in it, saved with --ckpt-format torch_dist (Megatron's default) or the older torch "
        "(mp_rank_* folders; megatron-core's model or the legacy one of --use-legacy-models): the model's shape "
        "from the run's arguments, the weights as saved, whatever tensor/pipeline/virtual-pipeline layout trained "
        "them; the optimizer state is not read. Megatron is not needed. A setting loom cannot compute the same way "
        "(mixture of experts, QK L2 norms, sliding windows, ...) is refused with Megatron's flag.",
    )
    p.add_argument(
        "--input", type=existing_dir, required=True, help="Megatron-LM's --save folder, or an iter_N folder in it"
    )
    _checkpoint_output(p, "a checkpoints/ folder of its own to write iter_0000000 and latest into")
    p.set_defaults(handler=_import_megatron)


def _add_export_megatron(sub) -> None:
    p = sub.add_parser(
        "export-megatron",
        help="write a Megatron-LM checkpoint (torch_dist) of a loom checkpoint's model",
        description="Writes OUTPUT/latest_checkpointed_iteration.txt and OUTPUT/iter_N (N: the checkpoint's step) "
        "as Megatron-LM's --ckpt-format torch_dist save does, for the model alone (a LoRA run's with its adapters "
        "folded in), with the Megatron-LM arguments that describe it; Megatron-LM loads it into any "
        "tensor/pipeline layout with --finetune (or --no-load-optim --no-load-rng to go on at iteration N), the model "
        "flags printed here. Megatron is not needed here.",
    )
    _checkpoint_input(p, "the checkpoint to export")
    _checkpoint_output(p, "a folder of its own for Megatron-LM's --load (its --save layout)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the weights' dtype (default float32: loom's weights as they are; Megatron-LM casts them to its "
        "--bf16/--fp16 parameters on load)",
    )
    p.add_argument("--lora.base", dest="lora_base", type=existing_path, help=LORA_BASE)
    p.set_defaults(handler=_export_megatron)


def _add_eval(commands) -> None:
    p = commands.add_parser(
        "eval",
        help="validation loss and perplexity of a checkpoint on a dataset, any layout",
        epilog="Layout and other fields: --parallel.tp 2 --nproc 2, --train.micro_batch_size 4, ... "
        "(a LoRA checkpoint whose base moved: --lora.base DIR)",
    )
    p.add_argument(
        "--checkpoint", type=existing_path, required=True, help="an iter_N directory or a checkpoints/ folder"
    )
    p.add_argument(
        "--data.paths",
        "--data",
        dest="data",
        metavar="PREFIX",
        type=dataset_prefix,
        required=True,
        help=".bin/.idx prefix" + OLDER,
    )
    p.add_argument(
        "--data.split",
        "--split",
        dest="split",
        default=WHOLE_DATASET,
        help="train,valid,test weights; the valid part is evaluated (default: the whole dataset)" + OLDER,
    )
    p.add_argument(
        "--iters", type=int_in(1, 1_000_000), default=4, help="global batches to evaluate (default: %(default)s)"
    )
    p.add_argument("--nproc", type=int_in(1, 1024), default=1, help="local ranks (default: %(default)s)")
    p.set_defaults(handler=cmd_eval, takes_overrides=True)


def _add_generate(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="continue a prompt with a checkpoint's model (KV-cached; greedy or sampled)",
        description="Runs on one process, or split over --nproc = tp x pp local ranks as training splits it; "
        "a checkpoint of any layout loads (a LoRA run's adapters folded in). Greedy output equals "
        "transformers' greedy generate on the exported model, under every layout. The text goes to stdout; "
        "how many tokens were generated and why it stopped (end of text, --max-new-tokens, the model's "
        "positions) to stderr.",
    )
    p.add_argument(
        "--checkpoint", type=existing_path, required=True, help="an iter_N directory or a checkpoints/ folder"
    )
    p.add_argument(
        "--tokenizer",
        type=existing_file,
        help="SentencePiece .model or Hugging Face tokenizer.json (default: the checkpoint config's data.tokenizer); "
        "must be the one it trained on",
    )
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue")
    prompt.add_argument("--prompt-ids", help="the prompt as token ids, e.g. '1 2 3' or '1,2,3' (no tokenizer needed)")
    p.add_argument("--max-new-tokens", type=int_in(1, 1 << 20), default=64, help="tokens to add (default: %(default)s)")
    p.add_argument(
        "--temperature", type=float_in(0, 100), default=0.0, help="0: greedy; > 0 samples (default: %(default)s)"
    )
    p.add_argument(
        "--top-p",
        type=float_in(0, 1, low_open=True),
        default=1.0,
        help="nucleus sampling mass in (0, 1] (default: %(default)s)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the sampling (default: %(default)s)")
    p.add_argument("--nproc", type=int_in(1, 1024), default=1, help="local ranks, tp x pp (default: %(default)s)")
    add_parallel_size(p, "tp", "tensor-parallel ranks", older=False, default=1)
    add_parallel_size(p, "pp", "pipeline stages (correct, not fast)", older=False, default=1)
    p.add_argument("--lora.base", dest="lora_base", type=existing_path, help=LORA_BASE)
    p.set_defaults(handler=cmd_generate)

"""`loom ckpt inspect|reshard|export-hf|import-hf` and `loom eval`: thin wrappers over tools/ and the trainer."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from loom.launch.arguments import positive_int


def _inspect(args: argparse.Namespace) -> None:
    from loom.tools.ckpt import inspect

    print(inspect(Path(args.directory)))


def _reshard(args: argparse.Namespace) -> None:
    from loom.tools.ckpt import reshard

    final = reshard(Path(args.input), Path(args.output), args.tp, args.pp, args.vp)
    print(
        f"wrote {final} for tp={args.tp} pp={args.pp} vp={args.vp} (any dp loads it); "
        f"resume with --checkpoint.load {args.output}"
    )


def _export_hf(args: argparse.Namespace) -> None:
    from loom.tools.hf import export_hf, export_peft_adapter

    if args.adapter_only:
        print(
            f"wrote {export_peft_adapter(Path(args.input), Path(args.output))}: adapter_config.json + "
            "adapter_model.safetensors (peft.PeftModel.from_pretrained(base, DIR) loads it onto the exported base)"
        )
        return
    print(
        f"wrote {export_hf(Path(args.input), Path(args.output))}: model.safetensors + config.json "
        f"(transformers.LlamaForCausalLM.from_pretrained loads it)"
    )


def _merge_lora(args: argparse.Namespace) -> None:
    from loom.tools.lora import merge_lora

    final = merge_lora(Path(args.input), Path(args.output))
    print(f"wrote {final}: the base model with the adapters folded in; export, generate or train from it")


def _import_hf(args: argparse.Namespace) -> None:
    from loom.tools.hf import import_hf

    final = import_hf(Path(args.input), Path(args.output))
    print(f"wrote {final}; train from it with --checkpoint.load {args.output}")


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.engine.config_io import config_from_dict, parse_overrides
    from loom.engine.preflight import preflight
    from loom.launch.local import launch_local
    from loom.tools.ckpt import open_checkpoint

    directory, metadata = open_checkpoint(Path(args.checkpoint))
    raw = metadata.config
    raw["parallel"].update(tp=1, pp=1, vp=1, dp=None)
    raw["optim"].update(zero=0, zero1=False, offload="none")
    raw["data"].update(paths=[args.data], split=args.split, weights=None)
    with tempfile.TemporaryDirectory() as run_dir:
        raw["train"].update(run_dir=run_dir, tensorboard=False, eval_iters=args.iters)
        raw["checkpoint"].update(load=str(directory), interval=0)
        for section, values in parse_overrides(overrides).items():
            raw[section].update(values)
        config = config_from_dict({s: {k: v for k, v in fields.items() if v is not None} for s, fields in raw.items()})
        preflight(config, args.nproc)
        t = config.train
        print(
            f"loom eval: {t.eval_iters} batches of {t.global_batch_size} x {t.seq_length} tokens on {args.nproc} "
            f"rank(s), {t.precision} (--iters, --train.global_batch_size, --train.seq_length, --train.precision)",
            flush=True,
        )
        launch_local(config, args.nproc, mode="eval")


def cmd_generate(args: argparse.Namespace) -> None:
    from loom.data_tools.jsonl import InputError
    from loom.tools.generate import generate, generate_parallel, load_model

    if args.nproc != args.tp * args.pp:
        raise InputError(f"--nproc {args.nproc} must equal --parallel.tp x --parallel.pp = {args.tp} x {args.pp}")
    model, config = load_model(Path(args.checkpoint))
    tokenizer_path = args.tokenizer or config.data.tokenizer
    processor = None
    if tokenizer_path:
        import sentencepiece

        if not Path(tokenizer_path).is_file():
            raise InputError(f"tokenizer {tokenizer_path} does not exist; pass --tokenizer T.model")
        processor = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))
    if args.prompt_ids is not None:
        prompt = [int(x) for x in args.prompt_ids.split()]
    elif processor is not None:
        prompt = ([processor.bos_id()] if processor.bos_id() >= 0 else []) + processor.encode(args.prompt)
    else:
        raise InputError("no tokenizer: pass --tokenizer T.model, or the prompt as --prompt-ids '1 2 3'")
    if not prompt or max(prompt) >= config.model.vocab_size or min(prompt) < 0:
        raise InputError(f"the prompt's token ids must lie in [0, {config.model.vocab_size}); got {prompt[:8]}")
    stops = (processor.eos_id(),) if processor is not None and processor.eos_id() >= 0 else ()
    job = dict(
        prompt=prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop_ids=stops,
    )
    if args.nproc > 1:
        del model
        produced = generate_parallel(Path(args.checkpoint), args.tp, args.pp, **job)
    else:
        produced = generate(model, **job)
    if processor is not None:
        print(processor.decode(prompt + produced))
    else:
        print(" ".join(str(t) for t in prompt + produced))


def add_parsers(commands) -> None:
    ckpt = commands.add_parser("ckpt", help="checkpoint tools: inspect, reshard, export-hf, import-hf, merge-lora")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    p = sub.add_parser("inspect", help="layout, step, tokens and the tensor table of a checkpoint")
    p.add_argument("directory", help="an iter_N directory or a checkpoints/ folder (its newest intact one)")
    p.set_defaults(handler=_inspect)
    p = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint for another tp/pp/vp layout, offline, streaming",
        description="Any layout already loads any checkpoint; resharding writes the pieces a "
        "target layout reads, one file per rank. DP needs no reshard.",
    )
    p.add_argument("--input", required=True, help="a checkpoint: iter_N, checkpoints/ or a run directory")
    p.add_argument("--output", required=True, help="a checkpoints/ folder to write iter_N and latest into")
    p.add_argument("--tp", type=positive_int, required=True, help="target tensor-parallel size")
    p.add_argument("--pp", type=positive_int, required=True, help="target pipeline stages")
    p.add_argument("--vp", type=positive_int, default=1, help="target chunks per stage (default: %(default)s)")
    p.set_defaults(handler=_reshard)
    p = sub.add_parser("export-hf", help="write a Llama-format Hugging Face model (safetensors + config.json)")
    p.add_argument("--input", required=True, help="a checkpoint: iter_N, checkpoints/ or a run directory")
    p.add_argument("--output", required=True, help="directory for model.safetensors and config.json")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write only its adapters as a PEFT adapter directory (without it: the merged model)",
    )
    p.set_defaults(handler=_export_hf)
    p = sub.add_parser(
        "merge-lora",
        help="fold a LoRA run's adapters into its base: a full checkpoint",
        description="Reads the adapters and the base model they point to (checked by sha256) and writes "
        "W + (alpha/r) B A for every adapted layer as a weights-only checkpoint (step 0, any layout loads it).",
    )
    p.add_argument("--input", required=True, help="the LoRA run's checkpoint (iter_N, checkpoints/ or the run dir)")
    p.add_argument("--output", required=True, help="a checkpoints/ folder to write iter_0000000 and latest into")
    p.set_defaults(handler=_merge_lora)
    p = sub.add_parser("import-hf", help="turn a Hugging Face Llama model directory into a loom checkpoint")
    p.add_argument("--input", required=True, help="directory with config.json and *.safetensors")
    p.add_argument("--output", required=True, help="a checkpoints/ folder to write iter_0000000 and latest into")
    p.set_defaults(handler=_import_hf)

    p = commands.add_parser(
        "eval",
        help="validation loss and perplexity of a checkpoint on a dataset, any layout",
        epilog="Layout and other fields: --parallel.tp 2 --nproc 2, --train.micro_batch_size 4, ...",
    )
    p.add_argument("--checkpoint", required=True, help="an iter_N directory or a checkpoints/ folder")
    p.add_argument("--data", required=True, help=".bin/.idx prefix")
    p.add_argument(
        "--split",
        default="0,100,0",
        help="train,valid,test weights; the valid part is evaluated (default: the whole dataset)",
    )
    p.add_argument("--iters", type=positive_int, default=4, help="global batches to evaluate (default: %(default)s)")
    p.add_argument("--nproc", type=positive_int, default=1, help="local ranks (default: %(default)s)")
    p.set_defaults(handler=cmd_eval, takes_overrides=True)

    p = commands.add_parser(
        "generate",
        help="continue a prompt with a checkpoint's model (KV-cached; greedy or sampled)",
        description="Runs on one process, or split over --nproc = tp x pp local ranks as training splits it; "
        "a checkpoint of any layout loads (a LoRA run's adapters folded in). Greedy output equals "
        "transformers' greedy generate on the exported model, under every layout.",
    )
    p.add_argument("--checkpoint", required=True, help="an iter_N directory or a checkpoints/ folder")
    p.add_argument("--tokenizer", help="SentencePiece model (default: the checkpoint config's data.tokenizer)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--prompt-ids", help="the prompt as token ids, e.g. '1 2 3' (no tokenizer needed)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to add (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    p.add_argument("--nproc", type=positive_int, default=1, help="local ranks, tp x pp (default: %(default)s)")
    p.add_argument("--parallel.tp", dest="tp", type=positive_int, default=1, help="tensor-parallel ranks")
    p.add_argument("--parallel.pp", dest="pp", type=positive_int, default=1, help="pipeline stages (correct, not fast)")
    p.set_defaults(handler=cmd_generate)

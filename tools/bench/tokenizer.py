"""Training a tokenizer: `loom data tokenizer` against SentencePiece's own trainer on the same lines, same run.

loom reads JSONL documents, keeps every 100th document out to measure the result, samples lines
(seeded reservoir) and hands them to SentencePiece; the baseline is SentencePiece alone, given those
same lines as a plain text file (what a user of the library would prepare first; its preparation is
not timed) with the same trainer options. Both train a BPE model on the embedded corpus. Prints
each time, loom's overhead over the library's own time (the target: at most 10%) and whether the two
models hold the same pieces.

    python tools/bench/tokenizer.py [--vocab-size 32000 --max-docs N --repeat 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import sentencepiece

from loom.data_tools.corpus import build_stdlib_corpus
from loom.data_tools.jsonl import JsonlStats
from loom.data_tools.tokenizer import HELD_OUT_EVERY, iter_lines, sample_lines, train_tokenizer, trainer_options


def library_alone(lines_file: Path, prefix: Path, options: dict) -> float:
    start = time.perf_counter()
    sentencepiece.set_random_generator_seed(0)
    sentencepiece.SentencePieceTrainer.train(input=str(lines_file), model_prefix=str(prefix), **options)
    return time.perf_counter() - start


def loom_tokenizer(corpus: Path, prefix: Path, vocab_size: int, sentences: int) -> float:
    start = time.perf_counter()
    train_tokenizer([corpus], prefix, vocab_size=vocab_size, input_sentence_size=sentences, progress=False)
    return time.perf_counter() - start


def pieces(model: Path) -> list[str]:
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-docs", type=int, help="corpus documents (default: the whole embedded corpus)")
    parser.add_argument("--sentences", type=int, default=2_000_000, help="lines sampled for training")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, alternated; the best is reported")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        counts = build_stdlib_corpus(corpus, max_docs=args.max_docs, progress=False)
        lines = sample_lines(
            iter_lines([corpus], "text", JsonlStats(), HELD_OUT_EVERY, held_out=[]), args.sentences, seed=0
        )
        lines_file = tmp / "lines.txt"
        lines_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
        options = trainer_options(
            args.vocab_size,
            "bpe",
            args.sentences,
            byte_fallback=True,
            user_defined_symbols=(),
            num_threads=os.cpu_count() or 1,
        )
        times: dict[str, list[float]] = {"SentencePiece alone": [], "loom data tokenizer": []}
        for _ in range(args.repeat):
            times["SentencePiece alone"].append(library_alone(lines_file, tmp / "alone", options))
            times["loom data tokenizer"].append(loom_tokenizer(corpus, tmp / "loom", args.vocab_size, args.sentences))
        same = pieces(tmp / "alone.model") == pieces(tmp / "loom.model")
        print(
            f"corpus: {counts['documents']:,} documents, {corpus.stat().st_size / 1e6:.1f} MB JSONL; {len(lines):,} "
            f"training lines; BPE vocab {args.vocab_size:,}; {options['num_threads']} threads; best of {args.repeat}"
        )
        best = {name: min(values) for name, values in times.items()}
        for name, seconds in best.items():
            print(f"{name:22} {seconds:7.2f} s")
        overhead = best["loom data tokenizer"] / best["SentencePiece alone"] - 1
        print(f"loom's overhead over the library's own time: {100 * overhead:+.1f}% (target <= +10%)")
        print(f"same pieces: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()

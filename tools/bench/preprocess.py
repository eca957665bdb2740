"""Tokenizing JSONL into .bin/.idx: loom's build against Megatron-LM's preprocess_data.py approach, same run.

Both get the embedded corpus (data_tools/corpus.py), the same SentencePiece model and the same
number of worker processes, and append the end-of-document id. The baseline is written here after
the structure of Megatron-LM's tools/preprocess_data.py: a multiprocessing.Pool whose workers each
load the tokenizer in an initializer and encode one JSON line at a time (json.loads, then
encode to a Python list, then append eod), fed through pool.imap with chunksize 32, and a single
writer in the parent that appends document by document (Megatron's IndexedDatasetBuilder.add_document;
here loom's writer, the one code allowed to write the format, called the same way). Both outputs
are checked to hold the same tokens. Prints tokens/s for each and the ratio.

    python tools/bench/preprocess.py [--max-docs 600 --vocab-size 8000 --workers 2 --repeat 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece

from loom.data_tools.build import build_indexed_dataset
from loom.data_tools.corpus import build_stdlib_corpus
from loom.data_tools.tokenizer import train_tokenizer
from loom.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab

MEGATRON_IMAP_CHUNKSIZE = 32  # preprocess_data.py's pool.imap(encoder.encode, fin, 32)


class MegatronStyleEncoder:
    """Per-document encoding as Megatron's Encoder does it: one JSON line in, one list of ids out."""

    def __init__(self, model_path: str, text_key: str, append_eod: bool):
        self.model_path, self.text_key, self.append_eod = model_path, text_key, append_eod

    def initializer(self) -> None:
        # Megatron keeps the tokenizer in a class attribute set by the pool initializer.
        MegatronStyleEncoder.processor = sentencepiece.SentencePieceProcessor(model_file=self.model_path)

    def encode(self, json_line: str) -> tuple[list[int], int]:
        text = json.loads(json_line)[self.text_key]
        ids = MegatronStyleEncoder.processor.encode_as_ids(text)
        # Megatron keeps no sentence of zero tokens: an empty document gets no end-of-document id either.
        if self.append_eod and ids:
            ids.append(MegatronStyleEncoder.processor.eos_id())
        return ids, len(json_line)


def megatron_style_build(corpus: Path, model_path: Path, prefix: Path, workers: int, text_key: str = "text") -> dict:
    start = time.perf_counter()
    encoder = MegatronStyleEncoder(str(model_path), text_key, append_eod=True)
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(model_path)).vocab_size()
    tokens = documents = 0
    with (
        open(corpus, encoding="utf-8") as lines,
        multiprocessing.Pool(workers, initializer=encoder.initializer) as pool,
        IndexedDatasetWriter(prefix, dtype_for_vocab(vocab)) as builder,
    ):
        for ids, _ in pool.imap(encoder.encode, lines, MEGATRON_IMAP_CHUNKSIZE):
            if not ids:  # a document without sequences in Megatron's index; loom writes none
                continue
            builder.add_document(ids)
            tokens += len(ids)
            documents += 1
    return {"documents": documents, "tokens": tokens, "seconds": time.perf_counter() - start}


def loom_build(corpus: Path, model_path: Path, prefix: Path, workers: int) -> dict:
    start = time.perf_counter()
    result = build_indexed_dataset([corpus], model_path, prefix, workers=workers, append_eod=True, progress=False)
    return {"documents": result["documents"], "tokens": result["tokens"], "seconds": time.perf_counter() - start}


def same_tokens(a: Path, b: Path) -> bool:
    x, y = IndexedDataset(a), IndexedDataset(b)
    return np.array_equal(x.sequence_lengths, y.sequence_lengths) and np.array_equal(
        np.fromfile(x.bin_path, x.dtype), np.fromfile(y.bin_path, y.dtype)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-docs", type=int, help="corpus documents (default: the whole embedded corpus)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the best is reported")
    parser.add_argument("--tokenizer", help="an existing SentencePiece .model (skips training)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        counts = build_stdlib_corpus(corpus, max_docs=args.max_docs, progress=False)
        model = Path(args.tokenizer) if args.tokenizer else tmp / "tok.model"
        if not args.tokenizer:
            train_tokenizer([corpus], tmp / "tok", vocab_size=args.vocab_size, input_sentence_size=300_000)
        runs = {"loom build": [], "Megatron-style pool": []}
        for _ in range(args.repeat):
            runs["Megatron-style pool"].append(megatron_style_build(corpus, model, tmp / "megatron", args.workers))
            runs["loom build"].append(loom_build(corpus, model, tmp / "loom", args.workers))
        if not same_tokens(tmp / "loom", tmp / "megatron"):
            raise SystemExit("the two builds hold different tokens")
        vocab = sentencepiece.SentencePieceProcessor(model_file=str(model)).vocab_size()
        print(
            f"corpus: {counts['documents']:,} documents, {corpus.stat().st_size / 1e6:.1f} MB JSONL; "
            f"SentencePiece BPE vocab {vocab:,}; {args.workers} workers; --append-eod; best of {args.repeat}"
        )
        best = {name: min(r, key=lambda run: run["seconds"]) for name, r in runs.items()}
        for name, run in best.items():
            print(
                f"{name:22} {run['tokens'] / run['seconds'] / 1e6:7.3f} M tokens/s  {run['seconds']:6.2f} s  "
                f"{run['tokens']:,} tokens  {corpus.stat().st_size / 1e6 / run['seconds']:5.1f} MB/s"
            )
        ratio = best["Megatron-style pool"]["seconds"] / best["loom build"]["seconds"]
        print(f"ratio loom / Megatron-style: {ratio:.2f}x (target >= 2.5x)")


if __name__ == "__main__":
    main()

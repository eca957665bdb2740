"""Tokenize JSONL documents into a Megatron .bin/.idx dataset with a pool of encoder processes.

The parent streams the input in batches of documents; workers encode each batch with
SentencePiece and return numpy arrays; the parent writes them in input order, so memory stays
flat in corpus size and the output is identical for any worker count. The output appears only
when complete (IndexedDatasetWriter renames it into place).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from data_tools.jsonl import ReadStats, iter_documents
from engine.data.indexed import IndexedDatasetWriter, dtype_for_vocab

BATCH_DOCUMENTS = 64

_processor: spm.SentencePieceProcessor | None = None
_eod: int | None = None


def _init_worker(model_file: str, eod: int | None) -> None:
    global _processor, _eod
    _processor = spm.SentencePieceProcessor(model_file=model_file)
    _eod = eod


def _encode_batch(texts: list[str]) -> list[np.ndarray]:
    encoded = _processor.encode(texts)
    tail = [_eod] if _eod is not None else []
    return [np.asarray(ids + tail, dtype=np.int32) for ids in encoded]


def _batches(paths: Iterable[str | Path], text_key: str, stats: ReadStats) -> Iterator[list[str]]:
    documents = (record[text_key] for record in iter_documents(paths, text_key, stats))
    while batch := list(itertools.islice(documents, BATCH_DOCUMENTS)):
        yield batch


def build_indexed_dataset(inputs: Iterable[str | Path], tokenizer_model: str | Path, output_prefix: str | Path,
                          workers: int = 1, text_key: str = "text", append_eod: bool = True) -> dict:
    """Write output_prefix.bin/.idx; returns counts (documents, tokens, bad lines, seconds)."""
    if not Path(tokenizer_model).is_file():
        raise FileNotFoundError(f"tokenizer {tokenizer_model} does not exist; train one with `loom data tokenizer`")
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    eod = processor.eos_id() if append_eod else None
    if append_eod and eod < 0:
        raise ValueError(f"tokenizer {tokenizer_model} has no end-of-sequence piece; use --no-append-eod")
    stats, start, tokens = ReadStats(), time.perf_counter(), 0
    batches = _batches(list(inputs), text_key, stats)
    progress = tqdm(desc="build", unit="doc", mininterval=1.0)
    with IndexedDatasetWriter(output_prefix, dtype_for_vocab(processor.vocab_size())) as writer:
        if workers > 1:
            with mp.get_context("spawn").Pool(workers, _init_worker, (str(tokenizer_model), eod)) as pool:
                tokens = _write_all(pool.imap(_encode_batch, batches, chunksize=1), writer, progress)
        else:
            _init_worker(str(tokenizer_model), eod)
            tokens = _write_all(map(_encode_batch, batches), writer, progress)
    progress.close()
    if stats.truncated_files:
        print(f"warning: truncated input, read up to the damage: {'; '.join(stats.truncated_files)}")
    seconds = time.perf_counter() - start
    return {**stats.as_dict(), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds) if seconds else None}


def _write_all(encoded_batches: Iterable[list[np.ndarray]], writer: IndexedDatasetWriter, progress: tqdm) -> int:
    tokens = 0
    for batch in encoded_batches:
        for ids in batch:
            writer.add_document(ids)
            tokens += ids.size
        progress.update(len(batch))
    return tokens

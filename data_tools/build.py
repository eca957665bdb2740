"""Tokenize JSONL documents into a Megatron-format indexed dataset (P.bin + P.idx).

The parent process reads documents and groups them into batches; encoding runs either in-process
(workers=1, SentencePiece's own threads) or in a spawn-safe process pool where each worker encodes
whole batches and returns flat numpy arrays. Where the model allows it (loom's own tokenizers do),
batches go through a per-process word cache (data_tools/word_cache.py): identical tokens, each
distinct word encoded once, about 3x Megatron's per-document pool. Results are written in input order through
IndexedDatasetWriter (the only code that knows the byte format), with a bounded number of batches
in flight so memory stays flat in the size of the corpus. Every document becomes one document in
the dataset, except one that encodes to no tokens (an empty or whitespace-only text): as Megatron's
preprocess_data.py, it is skipped (no end-of-document-only sequence) and counted (empty_documents). Input lines that
are not documents go to P.rejected/bad_lines.jsonl (file, line, reason, raw line). This module
must not import torch or any engine module other than engine.data.indexed.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import numpy as np
import sentencepiece
from tqdm import tqdm

from loom.data_tools.failures import reported_failures
from loom.data_tools.jsonl import (
    BAD_LINES_NAME,
    BadLinesFile,
    InputError,
    JsonlStats,
    check_inputs,
    estimated_input_bytes,
    iter_jsonl,
    no_documents,
)
from loom.data_tools.manifest import remove_dataset, tokenizer_settings, write_manifest
from loom.data_tools.parallel import chunked, imap_ordered
from loom.data_tools.tokenizer import Tokenizer, load_tokenizer
from loom.data_tools.word_cache import WordCache, word_split
from loom.engine.data.indexed import IndexedDatasetWriter, dtype_for_vocab, index_paths

BATCH_DOCUMENTS = 512
BATCH_CHARACTERS = 1 << 20
# Batches queued per worker: enough to keep it busy while the parent writes, few enough to bound memory.
IN_FLIGHT_PER_WORKER = 3
# The disk-space estimate of a full-disk message before any batch is written: BPE averages 3-4 bytes per token.
BYTES_PER_TOKEN = 3


class TokenizerVersion(NamedTuple):
    """A tokenizer's path and its files as a build found them when it began (the model's and its settings file's
    mtime, size and inode). Each process keys its processor and word cache by it: every batch of a build is encoded
    with the tokenizer the build began with, and a later build in the same process (the tokenizer retrained at the
    same path, its eos setting edited) loads it again."""

    path: str
    on_disk: tuple | None


def tokenizer_version(model_path: str) -> TokenizerVersion:
    try:
        files = [model_path, *tokenizer_settings(model_path)]
        return TokenizerVersion(model_path, tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, files)))
    except OSError:  # gone: load_tokenizer says so in one line
        return TokenizerVersion(model_path, None)


@functools.lru_cache(maxsize=4)
def load_processor(tokenizer: TokenizerVersion) -> Tokenizer:
    """One processor per tokenizer version and process (workers load it on their first batch)."""
    return load_tokenizer(tokenizer.path)


def _encode_arrays(processor: Tokenizer, texts: list[str], threads: int) -> list[np.ndarray]:
    try:
        return processor.encode(texts, out_type="numpy", num_threads=threads)
    except (ValueError, TypeError):
        # SentencePiece before numpy output: go through Python lists.
        return [np.asarray(ids, dtype=np.int32) for ids in processor.encode(texts, num_threads=threads)]


@functools.lru_cache(maxsize=4)
def word_cache(tokenizer: TokenizerVersion) -> WordCache | None:
    """This process's word cache for a tokenizer, or None where word-by-word encoding would change tokens."""
    processor = load_processor(tokenizer)
    if not isinstance(processor, sentencepiece.SentencePieceProcessor):
        return None  # a Hugging Face tokenizer's words are not SentencePiece's: it encodes whole texts
    split = word_split(processor)
    return WordCache(processor, split) if split else None


def encode_batch(
    tokenizer: TokenizerVersion,
    texts: list[str],
    eod: int | None,
    dtype: str,
    threads: int = 1,
    use_word_cache: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens back to back, tokens per document) for a batch of texts, each followed by `eod` if given; texts that
    encode to no tokens are left out (the caller counts them: len(texts) - len(lengths))."""
    cache = word_cache(tokenizer) if use_word_cache else None
    if cache is not None:
        flat, lengths = cache.encode(texts, threads)
    else:
        encoded = _encode_arrays(load_processor(tokenizer), texts, threads)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        flat = np.concatenate(encoded) if encoded else np.zeros(0, np.int32)
    lengths = lengths[lengths > 0]
    if eod is None:
        return flat.astype(dtype, copy=False), lengths
    lengths += 1
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths) - 1
    tokens[ends] = eod
    is_text = np.ones(tokens.size, dtype=bool)
    is_text[ends] = False
    tokens[is_text] = flat
    return tokens, lengths


def iter_batches(records: Iterable[dict], text_key: str) -> Iterator[list[str]]:
    """Texts grouped into batches of at most BATCH_DOCUMENTS documents or about BATCH_CHARACTERS characters."""
    return chunked((record[text_key] for record in records), BATCH_DOCUMENTS, BATCH_CHARACTERS)


def _encoded_in_order(
    batches: Iterable[list[str]],
    tokenizer: TokenizerVersion,
    eod: int | None,
    dtype: str,
    workers: int,
    use_word_cache: bool,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded batches in input order; with workers > 1 from a spawn pool with bounded look-ahead."""
    # One worker encodes in this process with SentencePiece's threads; several each use one thread.
    threads = (os.cpu_count() or 1) if workers <= 1 else 1
    tasks = ((tokenizer, batch, eod, dtype, threads, use_word_cache) for batch in batches)
    yield from imap_ordered(encode_batch, tasks, workers, IN_FLIGHT_PER_WORKER)


def _tokenizer_facts(tokenizer_model: str | Path, append_eod: bool) -> tuple[TokenizerVersion, int, int | None]:
    model_path = Path(tokenizer_model)
    if not model_path.is_file():
        raise FileNotFoundError(f"tokenizer {model_path} does not exist; train one with `loom data tokenizer`")
    tokenizer = tokenizer_version(str(model_path))
    processor = load_processor(tokenizer)
    eod = processor.eos_id() if append_eod else None
    if append_eod and eod < 0:
        raise InputError(
            f"tokenizer {model_path} has no end-of-document (eos) piece; build without --append-eod "
            f"or retrain it with `loom data tokenizer`"
        )
    return tokenizer, processor.vocab_size(), eod


@dataclass
class _Written:
    """What reached P.bin so far, and the characters of every batch handed out (for the tokens-per-byte rate)."""

    batch_characters: list[int] = field(default_factory=list)
    batch_documents: list[int] = field(default_factory=list)
    characters: int = 0
    documents: int = 0
    empty_documents: int = 0
    tokens: int = 0

    def measured(self, batches: Iterable[list[str]]) -> Iterator[list[str]]:
        for batch in batches:
            self.batch_characters.append(sum(map(len, batch)))
            self.batch_documents.append(len(batch))
            yield batch

    def needed_bytes(self, input_bytes: int, dtype: np.dtype) -> int:
        """About what P.bin + P.idx take for the whole input, at the rate measured so far."""
        tokens_per_byte = self.tokens / self.characters if self.characters else 1 / BYTES_PER_TOKEN
        return int(input_bytes * tokens_per_byte) * dtype.itemsize + input_bytes // 100


def _write_dataset(
    encoded: Iterable[tuple[np.ndarray, np.ndarray]],
    output_prefix: str | Path,
    dtype: np.dtype,
    written: _Written,
    progress: bool,
) -> None:
    """Write the encoded batches to output_prefix.bin/.idx, counting them in `written` (nothing if no document came)."""
    bar = tqdm(desc="tokenize", unit="doc", file=sys.stderr, disable=not progress, mininterval=1.0)
    with bar, IndexedDatasetWriter(output_prefix, dtype) as writer:
        for position, (batch_tokens, lengths) in enumerate(encoded):
            writer.add_documents(batch_tokens, lengths)
            written.characters += written.batch_characters[position]
            written.documents += len(lengths)
            written.empty_documents += written.batch_documents[position] - len(lengths)
            written.tokens += batch_tokens.size
            bar.update(len(lengths))
            bar.set_postfix(tokens=f"{written.tokens / 1e6:.1f}M", refresh=False)
        if written.documents == 0:
            writer.abort()
    if written.empty_documents and progress:
        print(f"skipped {written.empty_documents:,} empty documents (no tokens), as Megatron does", file=sys.stderr)


def bad_lines_path(output_prefix: str | Path) -> Path:
    """Where build keeps the input lines that are not documents: P.rejected/bad_lines.jsonl."""
    return Path(f"{os.fspath(output_prefix)}.rejected") / BAD_LINES_NAME


def _remove_bad_lines(bad_lines: BadLinesFile) -> None:
    """Remove a failed run's bad-line file (and its folder when empty); never raises."""
    try:
        bad_lines.close()
    except OSError:
        pass  # a full disk fails the flush again; the file is removed anyway
    bad_lines.path.unlink(missing_ok=True)
    try:
        bad_lines.path.parent.rmdir()
    except OSError:
        pass  # holds other files, or was never created


def build_indexed_dataset(
    inputs: Iterable[str | Path],
    tokenizer_model: str | Path,
    output_prefix: str | Path,
    workers: int = 1,
    text_key: str = "text",
    append_eod: bool = True,
    *,
    progress: bool = True,
    manifest: bool = True,
    use_word_cache: bool = True,
) -> dict:
    """Tokenize every document of `inputs` into output_prefix.bin/.idx (+ .manifest.json); returns counts and speed."""
    started = time.time()
    paths = check_inputs(inputs)
    tokenizer, vocab_size, eod = _tokenizer_facts(tokenizer_model, append_eod)
    dtype = dtype_for_vocab(vocab_size)
    stats = JsonlStats()
    start = time.perf_counter()
    bin_path = index_paths(output_prefix)[0]
    written, input_bytes = _Written(), estimated_input_bytes(paths)
    bad_lines = BadLinesFile(bad_lines_path(output_prefix))
    bad_lines.path.unlink(missing_ok=True)  # a previous run's
    with reported_failures(bin_path, lambda: written.needed_bytes(input_bytes, dtype)):
        try:
            records = iter_jsonl(paths, text_key=text_key, stats=stats, on_bad_line=bad_lines)
            batches = written.measured(iter_batches(records, text_key))
            with closing(_encoded_in_order(batches, tokenizer, eod, dtype.name, workers, use_word_cache)) as encoded:
                _write_dataset(encoded, output_prefix, dtype, written, progress)
            if written.documents == 0:
                empty = f" ({written.empty_documents:,} empty ones skipped)" if written.empty_documents else ""
                raise InputError(f"{no_documents(text_key, paths)}{empty}; nothing written")
        except BaseException:
            _remove_bad_lines(bad_lines)
            raise
        bad_lines.close()
        documents, tokens = written.documents, written.tokens
        seconds = time.perf_counter() - start
        result = {
            "output_prefix": str(output_prefix),
            "documents": documents,
            "empty_documents": written.empty_documents,
            "tokens": tokens,
            "bad_lines": stats.bad_lines,
            **({"bad_lines_file": str(bad_lines.path)} if bad_lines.count else {}),
            "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds),
            "docs_per_s": round(documents / seconds),
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "input": stats.as_dict(),
        }
        if manifest:
            parameters = {"text_key": text_key, "append_eod": append_eod, "workers": workers}
            if eod is not None:
                parameters["eod_id"] = eod
            _write_build_manifest(output_prefix, paths, tokenizer.path, parameters, result, bad_lines, started)
    return result


def _write_build_manifest(
    output_prefix: str | Path,
    paths: list[Path],
    model_path: str,
    parameters: dict,
    result: dict,
    bad_lines: BadLinesFile,
    started: float,
) -> None:
    """PREFIX.manifest.json, written last: a dataset without its manifest (or beside an older one) would look
    finished, so a failure here removes the dataset too."""
    bin_path, idx_path = index_paths(output_prefix)
    try:
        write_manifest(
            output_prefix,
            command="loom data build",
            inputs=[*paths, model_path, *tokenizer_settings(model_path)],
            outputs=[bin_path, idx_path, *([bad_lines.path] * bool(bad_lines.count))],
            parameters={"tokenizer": model_path, **parameters, "dtype": result["dtype"]},
            counts={key: result[key] for key in ("documents", "empty_documents", "tokens", "bad_lines")},
            started=started,
            is_folder=False,
        )
    except BaseException:
        remove_dataset(output_prefix)
        _remove_bad_lines(bad_lines)
        raise

"""SentencePiece tokenizer training (BPE or unigram) with LLaMA-style settings, written atomically.

Documents are fed line by line through a sentence iterator; SentencePiece samples
`input_sentence_size` of them (shuffled) on large corpora. Identity normalisation, kept
whitespace and byte fallback mean any text, code included, round-trips exactly.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from data_tools.jsonl import ReadStats, iter_documents

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
# Lines longer than this are cut by SentencePiece's trainer; generous for minified code.
MAX_SENTENCE_LENGTH = 16384


def _lines(paths: Iterable[str | Path], text_key: str, stats: ReadStats) -> Iterator[str]:
    for record in iter_documents(paths, text_key, stats):
        for line in record[text_key].splitlines():
            if line.strip():
                yield line


def train_tokenizer(inputs: Iterable[str | Path], output_prefix: str | Path, vocab_size: int,
                    model_type: str = "bpe", text_key: str = "text", input_sentence_size: int = 2_000_000,
                    byte_fallback: bool = True, user_defined_symbols: tuple[str, ...] = ()) -> dict:
    """Train and write PREFIX.model / PREFIX.vocab; returns the input statistics."""
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model type {model_type!r} is not bpe or unigram")
    stats = ReadStats()
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_lines(list(inputs), text_key, stats), model_writer=model,
        vocab_size=vocab_size, model_type=model_type, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True, byte_fallback=byte_fallback, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        character_coverage=0.9999, max_sentence_length=MAX_SENTENCE_LENGTH, hard_vocab_limit=False,
        user_defined_symbols=list(user_defined_symbols), num_threads=os.cpu_count() or 1,
        minloglevel=2, **SPECIAL_IDS)
    if stats.documents == 0:
        raise ValueError(f"no usable documents in the tokenizer input ({stats.bad_lines} bad lines)")
    _write_atomic(Path(f"{output_prefix}.model"), model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i)}\n"
                    for i in range(processor.vocab_size()))
    _write_atomic(Path(f"{output_prefix}.vocab"), vocab.encode("utf-8"))
    return stats.as_dict()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)

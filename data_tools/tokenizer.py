"""Train a SentencePiece tokenizer (BPE or unigram) on JSONL documents, with LLaMA-style settings.

Byte fallback (no unknown characters), split digits, identity normalisation and whitespace kept
as it is (remove_extra_whitespaces off, whitespace-only pieces allowed) so code indentation
survives a round trip. Documents are fed line by line through a sentence iterator; SentencePiece
samples `input_sentence_size` of those lines (reservoir sampling seeded by `seed`: SentencePiece's
own sampler ignores its seed, so two runs would differ). The outputs PREFIX.model / PREFIX.vocab
appear only when training succeeded. This module must not encode datasets (see build.py).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Iterable, Iterator

import sentencepiece

from loom.data_tools.atomic import temporary_sibling
from loom.data_tools.jsonl import InputError, JsonlStats, check_inputs, iter_jsonl
from loom.data_tools.manifest import write_manifest

MODEL_TYPES = ("bpe", "unigram")
# SentencePiece drops longer lines; long enough for minified code and data tables.
MAX_SENTENCE_BYTES = 1 << 16
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


HELD_OUT_MAX_CHARACTERS = 4 << 20


def iter_lines(
    inputs: Iterable[str | Path],
    text_key: str,
    stats: JsonlStats,
    held_out_every: int = 0,
    held_out: list[str] | None = None,
) -> Iterator[str]:
    """The non-empty lines of every document, in order (newlines are boundaries, never pieces).

    With held_out_every = N, every Nth document goes to `held_out` (up to HELD_OUT_MAX_CHARACTERS)
    instead of training, to measure the tokenizer on text it has not seen.
    """
    held_characters = 0
    for position, record in enumerate(iter_jsonl(inputs, text_key=text_key, stats=stats)):
        text = record[text_key]
        if (
            held_out_every
            and position % held_out_every == held_out_every - 1
            and held_out is not None
            and held_characters < HELD_OUT_MAX_CHARACTERS
        ):
            held_out.append(text)
            held_characters += len(text)
            continue
        for line in text.split("\n"):
            if line:
                yield line


def sample_lines(lines: Iterable[str], size: int, seed: int) -> list[str]:
    """A uniform sample of `size` lines (all of them if fewer), in input order, the same for the same seed."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for position, line in enumerate(lines):
        if position < size:
            reservoir.append((position, line))
        else:
            slot = rng.randrange(position + 1)
            if slot < size:
                reservoir[slot] = (position, line)
    return [line for _, line in sorted(reservoir)]


def held_out_metrics(processor: sentencepiece.SentencePieceProcessor, texts: list[str]) -> dict:
    """Fertility (tokens per whitespace-separated word) and the share of tokens that are byte fallbacks.

    Newlines are not counted as fallbacks: loom trains on lines, so a newline is always the byte
    piece <0x0A> by design, one token as any piece would be.
    """
    encoded = processor.encode(texts)
    tokens = sum(map(len, encoded))
    words = sum(len(text.split()) for text in texts)
    newline = processor.piece_to_id("<0x0A>")
    byte_tokens = sum(processor.is_byte(i) and i != newline for ids in encoded for i in ids)
    return {
        "held_out_documents": len(texts),
        "held_out_words": words,
        "fertility": round(tokens / words, 4) if words else None,
        "byte_fallback_rate": round(byte_tokens / tokens, 6) if tokens else None,
    }


def _pin_model_prefix(model_file: str, prefix: Path) -> None:
    """Record the final prefix instead of the temporary one, so equal training gives byte-identical models."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # without protobuf the model stays valid, only not byte-reproducible
        return
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    proto.trainer_spec.model_prefix = prefix.name
    Path(model_file).write_bytes(proto.SerializeToString())


class _GuardedIterator:
    """Keeps an input error for re-raising: SentencePiece would turn it into a bare RuntimeError."""

    def __init__(self, items: Iterator[str]):
        self._items, self._error = items, None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._items
        except Exception as error:  # noqa: BLE001 - re-raised unchanged after training stops
            self._error = error

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def trainer_options(
    vocab_size: int,
    model_type: str,
    input_sentence_size: int,
    byte_fallback: bool,
    user_defined_symbols: Iterable[str],
    num_threads: int,
) -> dict:
    """The SentencePieceTrainer keyword arguments loom uses (LLaMA-style, code-friendly)."""
    if model_type not in MODEL_TYPES:
        raise InputError(f"model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
    if vocab_size < 8:
        raise InputError(f"vocab_size = {vocab_size} is too small for a tokenizer")
    return dict(
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=byte_fallback,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_by_whitespace=True,
        character_coverage=0.9999,
        # A small corpus may not support vocab_size pieces; a smaller vocabulary beats a failed demo.
        hard_vocab_limit=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=False,
        user_defined_symbols=list(user_defined_symbols),
        num_threads=num_threads,
        minloglevel=1,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        pad_piece="<pad>",
    )


def train_tokenizer(
    inputs: Iterable[str | Path],
    output_prefix: str | Path,
    vocab_size: int,
    model_type: str = "bpe",
    text_key: str = "text",
    input_sentence_size: int = 2_000_000,
    byte_fallback: bool = True,
    user_defined_symbols: Iterable[str] = (),
    num_threads: int | None = None,
    seed: int = 0,
    held_out_every: int = 100,
) -> dict:
    """Train on the documents of `inputs`; writes PREFIX.model and PREFIX.vocab; returns what was seen.

    Every `held_out_every`th document (0: none) is kept out of training and measured instead.
    """
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    options = trainer_options(
        vocab_size,
        model_type,
        input_sentence_size,
        byte_fallback,
        user_defined_symbols,
        num_threads or os.cpu_count() or 1,
    )
    inputs = check_inputs(inputs)
    stats = JsonlStats()
    held_out: list[str] = []
    feed = _GuardedIterator(iter_lines(inputs, text_key, stats, held_out_every, held_out))
    tmp_prefix = temporary_sibling(output_prefix)
    start, started = time.perf_counter(), time.time()
    sentencepiece.set_random_generator_seed(seed)
    try:
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(sample_lines(feed, input_sentence_size, seed)),
                model_prefix=str(tmp_prefix),
                **options,
            )
        except RuntimeError as error:
            feed.raise_if_failed()
            if stats.documents == 0:
                raise InputError(
                    f"no documents with a string {text_key!r} field in {', '.join(map(str, inputs))}"
                ) from None
            raise InputError(f"SentencePiece training failed: {str(error).strip().splitlines()[-1]}") from None
        feed.raise_if_failed()
        _pin_model_prefix(f"{tmp_prefix}.model", output_prefix)
        # .model is what users point at, so it is renamed last.
        for suffix in (".vocab", ".model"):
            os.replace(f"{tmp_prefix}{suffix}", f"{output_prefix}{suffix}")
    finally:
        for suffix in (".vocab", ".model"):
            Path(f"{tmp_prefix}{suffix}").unlink(missing_ok=True)
    processor = sentencepiece.SentencePieceProcessor(model_file=f"{output_prefix}.model")
    trained = processor.vocab_size()
    result = {
        "model": f"{output_prefix}.model",
        "vocab_size": trained,
        "model_type": model_type,
        "seconds": round(time.perf_counter() - start, 2),
        **held_out_metrics(processor, held_out),
        **stats.as_dict(),
    }
    write_manifest(
        output_prefix,
        command="loom data tokenizer",
        inputs=inputs,
        outputs=[f"{output_prefix}.model", f"{output_prefix}.vocab"],
        parameters={"text_key": text_key, "seed": seed, "held_out_every": held_out_every, **options},
        counts={k: v for k, v in result.items() if k not in ("model", "model_type", "seconds")},
        started=started,
        is_folder=False,
    )
    return result

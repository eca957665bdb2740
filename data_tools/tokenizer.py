"""Train a SentencePiece tokenizer (BPE or unigram) on JSONL documents, with LLaMA-style settings.

Byte fallback (no unknown characters), split digits, identity normalisation and whitespace kept
as it is (remove_extra_whitespaces off, whitespace-only pieces allowed) so code indentation
survives a round trip. Documents are fed line by line through a sentence iterator; SentencePiece
samples `input_sentence_size` of those lines (reservoir sampling seeded by `seed`: SentencePiece's
own sampler ignores its seed, so two runs would differ). The outputs PREFIX.model / PREFIX.vocab
appear only when training succeeded. This module must not encode datasets (see build.py).
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import sentencepiece

from loom.data_tools.atomic import NAME_MAX, remove_stale_temporaries, temporary_sibling
from loom.data_tools.failures import reported_failures
from loom.data_tools.jsonl import InputError, JsonlStats, check_inputs, count_lines, iter_jsonl, no_documents
from loom.data_tools.manifest import manifest_path, write_manifest
from loom.data_tools.progress import Elapsed, Progress
from loom.engine.data.tokenizer_json import HuggingFaceTokenizer, TokenizerError, open_tokenizer

Tokenizer = sentencepiece.SentencePieceProcessor | HuggingFaceTokenizer
"""What load_tokenizer returns: a SentencePiece model, or a Hugging Face tokenizer.json behind the same methods."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A SentencePiece model file or a Hugging Face tokenizer.json, or one line saying why the file is neither."""
    path = Path(path)
    if path.is_dir():
        inside = "tokenizer.json" if (path / "tokenizer.json").is_file() else "its .model file"
        raise InputError(f"tokenizer {path} is a directory; give {inside}")
    if not path.is_file():
        raise InputError(f"tokenizer {path} does not exist; train one with `loom data tokenizer`")
    try:
        return open_tokenizer(path)
    except TokenizerError as error:
        raise InputError(str(error)) from None


def decode_ids(processor: Tokenizer, ids: list[int], path: str | Path) -> str:
    """The text of token `ids`, or one line saying they are not all of tokenizer `path`'s vocabulary."""
    pieces = processor.get_piece_size()
    largest = max(ids, default=-1)
    if largest >= pieces:
        raise InputError(
            f"token id {largest} is beyond tokenizer {path}'s {pieces} pieces: the data was built with another "
            "tokenizer; give that one (the dataset's manifest.json names it)"
        )
    return processor.decode(ids)


MODEL_TYPES = ("bpe", "unigram")
# SentencePiece drops longer lines; long enough for minified code and data tables.
MAX_SENTENCE_BYTES = 1 << 16
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
CONTROL_PIECES = ("<unk>", "<s>", "</s>", "<pad>")
"""The pieces of UNK_ID .. PAD_ID: a user-defined piece of the same text would take their place."""


def _check_special_tokens(tokens: list[str]) -> None:
    """Refuse what SentencePiece would accept and get wrong: a control piece's text (text "<s>" then encoded as
    the bos id), a piece with whitespace (text is split at whitespace first, so it never matches), a repeat."""
    for token in tokens:
        if token in CONTROL_PIECES:
            piece_id = CONTROL_PIECES.index(token)
            raise InputError(
                f"--special-tokens {token}: that is the tokenizer's own {token} piece (id {piece_id}); choose another "
                "text, e.g. <|im_start|>"
            )
        if any(character.isspace() for character in token):
            raise InputError(f"--special-tokens {token!r} holds whitespace, where text is split: it would never match")
    repeated = sorted({token for token in tokens if tokens.count(token) > 1})
    if repeated:
        raise InputError(f"--special-tokens gives {', '.join(repeated)} more than once; give each once")


HELD_OUT_EVERY = 100
"""loom data tokenizer's default: every 100th document is kept out of training and measured instead."""
HELD_OUT_MAX_CHARACTERS = 4 << 20
PROGRESS_EVERY = 256
# Only for the size in a full-disk message: a .model and .vocab take well under this per piece.
BYTES_PER_PIECE = 64


def _shown(records: Iterable[dict], text_key: str, bar: Progress | None) -> Iterator[dict]:
    """The records, counted on the progress bar every PROGRESS_EVERY documents."""
    documents = nbytes = 0
    for record in records:
        documents += 1
        nbytes += len(record[text_key])  # characters: encoding every text only for the MB/s figure costs too much
        if bar is not None and documents == PROGRESS_EVERY:
            bar.update(documents, nbytes)
            documents = nbytes = 0
        yield record
    if bar is not None:
        bar.update(documents, nbytes)


def iter_lines(
    inputs: Iterable[str | Path],
    text_key: str,
    stats: JsonlStats,
    held_out_every: int = 0,
    held_out: list[str] | None = None,
    bar: Progress | None = None,
    counts: Counter | None = None,
) -> Iterator[str]:
    """The non-empty lines of every document, in order (newlines are boundaries, never pieces); a line longer
    than SentencePiece's MAX_SENTENCE_BYTES is cut at spaces and counted in `counts["long_lines_cut"]`.

    With held_out_every = N, every Nth document goes to `held_out` (up to HELD_OUT_MAX_CHARACTERS)
    instead of training, to measure the tokenizer on text it has not seen. Documents are counted on `bar`.
    """
    held_characters = 0
    counts = Counter() if counts is None else counts
    for position, record in enumerate(_shown(iter_jsonl(inputs, text_key=text_key, stats=stats), text_key, bar)):
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
            if len(line) * 4 > MAX_SENTENCE_BYTES and len(line.encode()) > MAX_SENTENCE_BYTES:
                counts["long_lines_cut"] += 1
                yield from _cut_at_spaces(line, MAX_SENTENCE_BYTES)
            elif line:
                yield line


def _cut_at_spaces(line: str, max_bytes: int) -> Iterator[str]:
    """`line` in pieces of at most `max_bytes` UTF-8 bytes, cut before a space where one is near: SentencePiece's
    trainer skips a longer sentence without a word, which left a long document out of training entirely."""
    start = 0
    while start < len(line):
        end = start + max_bytes // 4  # at most 4 bytes a character: this many always fit
        while end < len(line) and len(line[start : end + max_bytes // 8].encode()) <= max_bytes:
            end += max_bytes // 8
        end = min(end, len(line))
        if end < len(line):
            space = line.rfind(" ", start + 1, end)
            end = space if space > start else end
        yield line[start:end]
        start = end


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


def _drop_where_it_was_trained(model_file: str) -> None:
    """Clear the output prefix and thread count SentencePiece records in the model: equal training then gives
    byte-identical models wherever and on however many threads it ran, so the sha256 that datasets record names
    the tokenizer itself (the manifest keeps both facts)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # without protobuf the model stays valid, only not byte-reproducible
        return
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    proto.trainer_spec.ClearField("model_prefix")
    proto.trainer_spec.ClearField("num_threads")
    Path(model_file).write_bytes(proto.SerializeToString())


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
    user_defined_symbols = list(user_defined_symbols)
    _check_special_tokens(user_defined_symbols)
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


def _read_sample(
    inputs: list[Path],
    text_key: str,
    stats: JsonlStats,
    held_out_every: int,
    held_out: list[str],
    input_sentence_size: int,
    seed: int,
    progress: bool,
) -> tuple[list[str], int]:
    """The training lines sampled from the inputs (held-out documents go to `held_out`), with a progress bar, and
    how many over-long lines were cut."""
    counts: Counter = Counter()
    with Progress("tokenizer: reading", progress, total=count_lines(inputs)) as bar:
        lines = iter_lines(inputs, text_key, stats, held_out_every, held_out, bar, counts)
        return sample_lines(lines, input_sentence_size, seed), counts["long_lines_cut"]


def _train_into(lines: list[str], output_prefix: Path, options: dict, seed: int, empty_input: str | None) -> None:
    """Train SentencePiece on `lines` and move PREFIX.model/.vocab into place (.model last) only if it succeeds.

    empty_input: the error to report when training fails because the input held no documents."""
    # A killed training's files stayed: the .tmp files' cleanup did not see SentencePiece's suffixes
    remove_stale_temporaries(output_prefix, suffixes=(".tmp.model", ".tmp.vocab"), reserve=len(".model"))
    tmp_prefix = temporary_sibling(output_prefix, reserve=len(".model"))
    sentencepiece.set_random_generator_seed(seed)
    try:
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(lines), model_prefix=str(tmp_prefix), **options
            )
        except RuntimeError as error:
            if empty_input is not None:
                raise InputError(empty_input) from None
            reason = str(error).strip().splitlines()[-1]
            chars = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", reason)
            if chars:  # SentencePiece names its own --character_coverage option, which loom does not expose
                raise InputError(
                    f"--vocab-size {chars[1]} is smaller than the {chars[2]} pieces the text's characters and the "
                    f"special pieces need; give a larger --vocab-size"
                ) from None
            if "output->Write" in reason and shutil.disk_usage(tmp_prefix.parent).free < 1 << 20:
                # SentencePiece's writer failed on a full disk, and says only INTERNAL: say it as the OSError
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_prefix)) from None
            raise InputError(f"SentencePiece training failed: {reason}") from None
        _drop_where_it_was_trained(f"{tmp_prefix}.model")
        # .model is what users point at, so it is renamed last.
        for suffix in (".vocab", ".model"):
            os.replace(f"{tmp_prefix}{suffix}", f"{output_prefix}{suffix}")
    finally:
        for suffix in (".vocab", ".model"):
            Path(f"{tmp_prefix}{suffix}").unlink(missing_ok=True)


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
    held_out_every: int = HELD_OUT_EVERY,
    *,
    progress: bool = True,
) -> dict:
    """Train on the documents of `inputs`; writes PREFIX.model and PREFIX.vocab; returns what was seen.

    Every `held_out_every`th document (0: none) is kept out of training and measured instead.
    """
    output_prefix = Path(output_prefix)
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
    start, started = time.perf_counter(), time.time()
    with reported_failures(output_prefix, vocab_size * BYTES_PER_PIECE):
        output_prefix.parent.mkdir(parents=True, exist_ok=True)
        # A read-only or forbidden output fails now, not after an hour of training.
        probe = temporary_sibling(output_prefix, reserve=len(".model"))
        probe.touch()
        probe.unlink()
        for written in (output_prefix.with_name(output_prefix.name + ".model"), manifest_path(output_prefix, False)):
            if len(written.name.encode()) > NAME_MAX:  # else refused after the training, at its rename
                raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), str(written))
        lines, long_lines_cut = _read_sample(
            inputs, text_key, stats, held_out_every, held_out, input_sentence_size, seed, progress
        )
        if long_lines_cut and progress:
            print(
                f"tokenizer: {long_lines_cut:,} line(s) longer than SentencePiece's {MAX_SENTENCE_BYTES:,} bytes were "
                "cut at spaces (whole, the trainer would skip them)",
                file=sys.stderr,
            )
        empty_input = None
        if stats.documents == 0:
            empty_input = no_documents(text_key, inputs)
        with Elapsed(f"tokenizer: training {vocab_size} {model_type} pieces on {len(lines):,} lines", progress):
            _train_into(lines, output_prefix, options, seed, empty_input)
        try:
            processor = sentencepiece.SentencePieceProcessor(model_file=f"{output_prefix}.model")
            result = {
                "model": f"{output_prefix}.model",
                "vocab_size": processor.vocab_size(),
                "model_type": model_type,
                "seconds": round(time.perf_counter() - start, 2),
                **held_out_metrics(processor, held_out),
                **stats.as_dict(),
                "long_lines_cut": long_lines_cut,
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
        except BaseException:
            # A model without its manifest (or beside an older one) would look finished.
            for path in (f"{output_prefix}.model", f"{output_prefix}.vocab", manifest_path(output_prefix, False)):
                Path(path).unlink(missing_ok=True)
            raise
    return result

"""Encode text word by word with a cache: the same tokens as SentencePiece's whole-text encode, much faster.

Words repeat (Zipf), and SentencePiece spends most of its time re-merging the same words. A
SentencePiece model trained with split_by_whitespace has no piece that spans a word boundary (a
space that follows a non-space), and a model trained line by line, as loom's are, has no piece
containing a newline. BPE encoding then never merges across those boundaries, and the order of
merges inside a word (by score, then leftmost) does not depend on where the word sits, so the
tokens of a text are the tokens of its words, one after the other. Unigram models are not
cached: their best path is split the same way, but ties between equal-score paths (runs of
spaces) are broken differently in context. The cache keeps each word's tokens in one flat array;
a batch costs one regex split, one set difference, one SentencePiece call for the new words
and a numpy gather. `word_splittable` checks the model's settings and every piece, and the
cache is used only where it holds; tests compare it with SentencePiece on tricky text. This
module must not read or write files.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import sentencepiece

# A newline alone, or a run of spaces with the non-space characters after it, or trailing spaces.
_WORD = re.compile(r"\n| *[^ \n]+| +")
# A piece that could span a boundary: a space (▁) after another character, or a newline.
_SPANNING_PIECE = re.compile("[^\u2581]\u2581|\n")
_BPE = 2


def word_splittable(processor: sentencepiece.SentencePieceProcessor) -> bool:
    """True when encoding a text word by word is guaranteed to give the tokens of encoding it whole."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing: no way to read the settings, so no cache
        return False
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(processor.serialized_model_proto())
    normalizer, trainer = proto.normalizer_spec, proto.trainer_spec
    # Any normaliser other than identity, a dummy prefix or whitespace folding depends on context.
    if (
        normalizer.name != "identity"
        or normalizer.precompiled_charsmap
        or normalizer.add_dummy_prefix
        or normalizer.remove_extra_whitespaces
        or not normalizer.escape_whitespaces
    ):
        return False
    if trainer.model_type != _BPE or trainer.treat_whitespace_as_suffix:
        return False
    return not any(_SPANNING_PIECE.search(piece.piece) for piece in proto.pieces)


class WordCache:
    """Tokens of every word seen, back to back in `tokens`; a word's slice is starts[id]:starts[id]+lengths[id]."""

    def __init__(self, processor: sentencepiece.SentencePieceProcessor, max_tokens: int = 1 << 25):
        self.processor = processor
        self.max_tokens = max_tokens
        self._clear()

    def _clear(self) -> None:
        self.index: dict[str, int] = {}
        self.starts = np.zeros(1 << 16, np.int64)
        self.lengths = np.zeros(1 << 16, np.int64)
        self.tokens = np.zeros(1 << 20, np.int32)
        self.used = 0

    def _add(self, words: list[str], encoded: list[list[int]]) -> None:
        lengths = np.fromiter(map(len, encoded), np.int64, count=len(encoded))
        size, first, count = int(lengths.sum()), len(self.index), len(words)
        self.starts = _fit(self.starts, first + count)
        self.lengths = _fit(self.lengths, first + count)
        self.tokens = _fit(self.tokens, self.used + size)
        self.starts[first : first + count] = self.used + np.cumsum(lengths) - lengths
        self.lengths[first : first + count] = lengths
        self.tokens[self.used : self.used + size] = np.fromiter(
            itertools.chain.from_iterable(encoded), np.int32, count=size
        )
        self.used += size
        self.index.update(zip(words, range(first, first + count)))

    def encode(self, texts: list[str], threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(tokens of every text back to back, tokens per text), as SentencePiece would encode them."""
        words_per_text = [_WORD.findall(text) for text in texts]
        words = list(itertools.chain.from_iterable(words_per_text))
        new = list(set(words).difference(self.index))
        if new:
            encoded = self.processor.encode(new, num_threads=threads)
            if self.used + sum(map(len, encoded)) > self.max_tokens:
                # Bounded memory: start over with this batch's words rather than grow forever.
                self._clear()
                rest = list(set(words).difference(new))
                new, encoded = new + rest, encoded + self.processor.encode(rest, num_threads=threads)
            self._add(new, encoded)
        ids = np.fromiter(map(self.index.__getitem__, words), np.int64, count=len(words))
        lengths, starts = self.lengths[ids], self.starts[ids]
        ends = np.cumsum(lengths)
        # Token t of the output comes from tokens[start of its word + its offset inside the word].
        gather = np.arange(int(ends[-1]) if ends.size else 0) + np.repeat(starts - (ends - lengths), lengths)
        word_counts = np.fromiter(map(len, words_per_text), np.int64, count=len(texts))
        word_ends = np.cumsum(word_counts)
        token_ends = np.concatenate([[0], ends])
        per_text = token_ends[word_ends] - token_ends[word_ends - word_counts]
        return self.tokens[gather], per_text


def _fit(array: np.ndarray, size: int) -> np.ndarray:
    """array, grown by doubling when it holds fewer than `size` items."""
    if size <= array.size:
        return array
    grown = np.zeros(max(size, 2 * array.size), array.dtype)
    grown[: array.size] = array
    return grown

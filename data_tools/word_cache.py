"""Encode text word by word with a cache: the same tokens as SentencePiece's whole-text encode, much faster.

Words repeat (Zipf), and SentencePiece spends most of its time re-merging the same words. SentencePiece's
BPE merges two neighbouring symbols only into a piece of the vocabulary, by score and then leftmost. So if no
piece holds two neighbouring characters that a rule calls a boundary, no merge crosses such a boundary, and
merges on one side never change the candidates on the other: the tokens of a text are the tokens of its words,
one after the other, for words cut at those boundaries. Two rules are checked against every piece of the model:

- coarse: before a space that follows a non-space, and around a newline (a model trained with
  split_by_whitespace, line by line, as loom's are). SentencePiece reads a literal ▁ (U+2581) as a space.
- fine: the coarse boundaries, and where a run of ASCII letters, of digits or of other ASCII characters meets
  another (split_by_unicode_script and split_by_number keep a piece inside one such run); a non-ASCII character
  is never cut from its neighbours. On code, 4x fewer distinct words than the coarse rule (the embedded corpus:
  130,457 instead of 522,175).

The finest rule that holds is used. Two more conditions: byte fallback (without it SentencePiece merges
neighbouring unknown characters into one unknown token, across any boundary), and a user-defined piece (a
special token such as <|im_start|>, matched before any merge) must not hold a coarse boundary; a text that
holds one with a fine boundary inside is cut by the coarse rule, which such pieces never cross. Unigram models
are not cached: their best path is split the same way, but ties between equal-score paths (runs of spaces) are
broken differently in context.

A batch is worked on as one array of code points, without a Python object per word: boundaries, a polynomial
hash of each word, one sort to find the batch's distinct words, a dict from hash to word for those, and a gather
of the cached tokens. Every word is compared character by character with the word its hash names (one of the
batch's, and the cached one), so a hash collision cannot change a token: a batch that holds one is encoded
whole by SentencePiece instead (slower, never wrong; the hash repeats its powers every 4,096 characters, so
crafted long words can collide). A part of a text with no boundary in 2M characters (a minified file, say) is
encoded by SentencePiece alone, outside the arrays and the cache. Tests compare the cache with SentencePiece on
tricky text and force collisions. This module must not read or write files.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import sentencepiece

_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6
_BPE = 2

# Character classes of the boundary rules, by code point.
_LETTER, _DIGIT, _OTHER_ASCII, _NON_ASCII, _SPACE, _NEWLINE = range(6)
_ASCII_CLASS = np.full(128, _OTHER_ASCII, np.uint8)
_ASCII_CLASS[ord("A") : ord("Z") + 1] = _ASCII_CLASS[ord("a") : ord("z") + 1] = _LETTER
_ASCII_CLASS[ord("0") : ord("9") + 1] = _DIGIT
_ASCII_CLASS[ord(" ")], _ASCII_CLASS[ord("\n")] = _SPACE, _NEWLINE
SPACE_SYMBOL = "\u2581"  # SentencePiece's ▁ (LOWER ONE EIGHTH BLOCK), which it reads as a space

# The word hash: sum of code point * BASE**(offset in word mod HASH_PERIOD), modulo 2**64, mixed with the length.
_HASH_BASE = 0x9E3779B97F4A7C15  # odd, so a power of it is never 0 modulo 2**64
_HASH_PERIOD = 1 << 12
_HASH_POWERS = np.cumprod(np.r_[np.uint64(1), np.full(_HASH_PERIOD - 1, _HASH_BASE, np.uint64)], dtype=np.uint64)
_LENGTH_MIX = np.uint64(0xD6E8FEB86659FD93)
_MAX_BATCH_POINTS = 1 << 21  # a batch takes ~60 bytes a character: ~130 MB


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


def _cuts(points: np.ndarray, fine: bool | np.ndarray) -> np.ndarray:
    """cuts[i]: a word boundary between points[i] and points[i + 1] (the coarse rule, and the fine one where `fine`,
    a bool or one per point)."""
    classes = np.where(points < 128, _ASCII_CLASS[np.minimum(points, 127)], np.uint8(_NON_ASCII))
    classes[points == ord(SPACE_SYMBOL)] = _SPACE
    left, right = classes[:-1], classes[1:]
    cuts = (left == _NEWLINE) | (right == _NEWLINE) | ((right == _SPACE) & (left != _SPACE))
    if isinstance(fine, np.ndarray) or fine:
        between_runs = (left < _NON_ASCII) & (right < _NON_ASCII) & (left != right)
        cuts |= between_runs & fine[1:] if isinstance(fine, np.ndarray) else between_runs
    return cuts


def _spanning(pieces: list[str], fine: bool) -> np.ndarray:
    """Per piece, whether a word boundary falls inside it."""
    if not pieces:
        return np.zeros(0, bool)
    lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
    starts = np.cumsum(lengths) - lengths
    inside = np.concatenate([[False], _cuts(_code_points("".join(pieces)), fine)])
    inside[starts] = False  # a piece's start is not inside it
    return np.logical_or.reduceat(inside, starts)


@dataclass(frozen=True)
class WordSplit:
    """Which rule cuts a model's texts into words: the fine one if `fine`, else the coarse one. A text that holds
    a user-defined piece matched by `special` (one the fine rule could cut) is cut by the coarse rule."""

    fine: bool
    special: re.Pattern[str] | None = None


def word_split(processor: sentencepiece.SentencePieceProcessor) -> WordSplit | None:
    """The finest word split whose words encode to the tokens of the whole text, or None when there is none."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing: no way to read the settings, so no cache
        return None
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
        return None
    if trainer.model_type != _BPE or trainer.treat_whitespace_as_suffix or not trainer.byte_fallback:
        return None
    # Unknown, control and byte pieces are never matched in a text.
    matched = [piece for piece in proto.pieces if piece.type not in (_UNKNOWN, _CONTROL, _BYTE)]
    pieces = [piece.piece for piece in matched]
    user_defined = np.array([piece.type == _USER_DEFINED for piece in matched], bool)
    if _spanning(pieces, fine=False).any():
        return None
    spanning = _spanning(pieces, fine=True)
    if (spanning & ~user_defined).any():
        return WordSplit(fine=False)
    special = list(itertools.compress(pieces, spanning & user_defined))
    return WordSplit(fine=True, special=re.compile("|".join(map(re.escape, special))) if special else None)


@dataclass
class _Words:
    """A batch's words: where each starts in the batch's code points, how long it is, its hash; and for each code
    point, its word and its offset in it."""

    starts: np.ndarray
    lengths: np.ndarray
    hashes: np.ndarray
    point_word: np.ndarray
    point_offset: np.ndarray


class WordCache:
    """SentencePiece's tokens for texts, from a cache of the tokens (and characters) of every word seen. The
    processor must encode with its default options (no add_bos/add_eos/sampling), as load_tokenizer's does.

    Word i's tokens are tokens[token_starts[i]:][:token_lengths[i]], its code points
    chars[char_starts[i]:][:char_lengths[i]]; `index` maps a word's hash to i. The cache starts over rather than
    hold more than `max_tokens` tokens, twice as many code points or an eighth as many words: about 250 MB at
    most at the default (a dict entry takes ~100 bytes), which holds the words of most occurrences in any corpus."""

    def __init__(
        self,
        processor: sentencepiece.SentencePieceProcessor,
        split: WordSplit | None = None,
        max_tokens: int = 1 << 23,
    ) -> None:
        split = split or word_split(processor)
        if split is None:
            raise ValueError("this SentencePiece model's tokens depend on context; encode whole texts instead")
        self.processor, self.split, self.max_tokens = processor, split, max_tokens
        self.collisions = 0  # batches encoded whole because two different words shared a hash
        self._clear()

    def _clear(self) -> None:
        self.index: dict[int, int] = {}
        self.token_starts = np.zeros(1 << 16, np.int64)
        self.token_lengths = np.zeros(1 << 16, np.int64)
        self.char_starts = np.zeros(1 << 16, np.int64)
        self.char_lengths = np.zeros(1 << 16, np.int64)
        self.tokens = np.zeros(1 << 20, np.int32)
        self.chars = np.zeros(1 << 20, np.uint32)
        self.tokens_used = self.chars_used = 0

    def encode(self, texts: list[str], threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(tokens of every text back to back, tokens per text), as SentencePiece would encode them."""
        if sum(map(len, texts)) <= _MAX_BATCH_POINTS:
            return self._encode(texts, threads)
        # A batch's arrays take tens of bytes a character: cut long texts at word boundaries, encode in groups.
        parts, owners = [], []
        for owner, text in enumerate(texts):
            for part in _parts(text, _MAX_BATCH_POINTS):
                parts.append(part)
                owners.append(owner)
        tokens, part_lengths = [], []
        for group in _groups(parts, _MAX_BATCH_POINTS):
            # A part still longer has no boundary to cut at: a word that long is not worth arrays or a cache entry.
            encode = self._whole if len(group[0]) > _MAX_BATCH_POINTS else self._encode
            group_tokens, group_lengths = encode(group, threads)
            tokens.append(group_tokens)
            part_lengths.append(group_lengths)
        per_text = np.bincount(owners, weights=np.concatenate(part_lengths), minlength=len(texts))
        return np.concatenate(tokens), per_text.astype(np.int64)

    def _encode(self, texts: list[str], threads: int) -> tuple[np.ndarray, np.ndarray]:
        text_lengths = np.fromiter(map(len, texts), np.int64, len(texts))
        joined = "".join(texts)
        if not joined:
            return np.zeros(0, np.int32), np.zeros(len(texts), np.int64)
        points = _code_points(joined)
        words = self._words(texts, points, text_lengths)
        distinct, representative, inverse = _unique(words.hashes)
        ids = np.fromiter(map(self.index.get, distinct.tolist(), itertools.repeat(-1)), np.int64, distinct.size)
        same = self._same_as_representative(points, words, representative[inverse])
        if not (same and self._same_as_cached(points, words, representative, ids)):
            self.collisions += 1
            return self._whole(texts, threads)
        unseen = np.flatnonzero(ids < 0)
        if unseen.size:
            starts, lengths = words.starts[representative[unseen]], words.lengths[representative[unseen]]
            new_words = [joined[start : start + length] for start, length in zip(starts.tolist(), lengths.tolist())]
            tokens, token_lengths = self._whole(new_words, threads)
            if self._full_after(tokens.size, int(lengths.sum()), unseen.size):
                # Bounded memory: start over with this batch's words rather than grow forever.
                seen = np.flatnonzero(ids >= 0)
                seen_tokens, seen_lengths = self._tokens_of(ids[seen])
                self._clear()
                ids[seen] = self._add(distinct[seen], seen_tokens, seen_lengths, points, words, representative[seen])
            ids[unseen] = self._add(distinct[unseen], tokens, token_lengths, points, words, representative[unseen])
        return self._gather(ids[inverse], words, text_lengths)

    def _full_after(self, tokens: int, points: int, words: int) -> bool:
        return (
            self.tokens_used + tokens > self.max_tokens
            or self.chars_used + points > 2 * self.max_tokens
            or len(self.index) + words > self.max_tokens // 8
        )

    def _words(self, texts: list[str], points: np.ndarray, text_lengths: np.ndarray) -> _Words:
        fine: bool | np.ndarray = self.split.fine
        if fine and self.split.special is not None:
            # SentencePiece matches special tokens after turning spaces into ▁, so "▁<|im_end|>" matches " <|im_end|>".
            escaped = (text.replace(" ", SPACE_SYMBOL) for text in texts)
            fine = np.repeat(
                np.array([self.split.special.search(text) is None for text in escaped], bool), text_lengths
            )
        boundary = np.concatenate([[True], _cuts(points, fine)])
        boundary[(np.cumsum(text_lengths) - text_lengths)[text_lengths > 0]] = True  # texts start words
        starts = np.flatnonzero(boundary)
        point_word = np.cumsum(boundary, dtype=np.int64) - 1
        point_offset = np.arange(points.size) - starts[point_word]
        powers = _HASH_POWERS[point_offset & (_HASH_PERIOD - 1)]
        hashes = np.add.reduceat(points.astype(np.uint64) * powers, starts)
        lengths = np.diff(starts, append=points.size)
        return _Words(starts, lengths, hashes ^ lengths.astype(np.uint64) * _LENGTH_MIX, point_word, point_offset)

    def _same_as_representative(self, points: np.ndarray, words: _Words, representative: np.ndarray) -> bool:
        """Whether every word equals the word chosen to represent its hash in the batch."""
        if not np.array_equal(words.lengths[representative], words.lengths):
            return False
        positions = words.starts[representative][words.point_word] + words.point_offset
        return np.array_equal(points[positions], points)

    def _same_as_cached(self, points: np.ndarray, words: _Words, representative: np.ndarray, ids: np.ndarray) -> bool:
        """Whether every distinct word of the batch found in the cache equals the cached word of its hash."""
        found = np.flatnonzero(ids >= 0)
        cached, batch = ids[found], representative[found]
        lengths = words.lengths[batch]
        if not np.array_equal(self.char_lengths[cached], lengths):
            return False
        in_batch, in_cache = _positions(words.starts[batch], lengths), _positions(self.char_starts[cached], lengths)
        return np.array_equal(points[in_batch], self.chars[in_cache])

    def _add(
        self,
        hashes: np.ndarray,
        tokens: np.ndarray,
        token_lengths: np.ndarray,
        points: np.ndarray,
        words: _Words,
        which: np.ndarray,
    ) -> np.ndarray:
        """Cache the words `which` of the batch under `hashes`; returns their ids."""
        first, count = len(self.index), hashes.size
        char_lengths = words.lengths[which]
        for name in ("token_starts", "token_lengths", "char_starts", "char_lengths"):
            setattr(self, name, _fit(getattr(self, name), first + count))
        self.tokens = _fit(self.tokens, self.tokens_used + tokens.size)
        self.chars = _fit(self.chars, self.chars_used + int(char_lengths.sum()))
        new = slice(first, first + count)
        self.token_starts[new] = self.tokens_used + np.cumsum(token_lengths) - token_lengths
        self.token_lengths[new] = token_lengths
        self.tokens[self.tokens_used : self.tokens_used + tokens.size] = tokens
        self.tokens_used += tokens.size
        chars = points[_positions(words.starts[which], char_lengths)]
        self.char_starts[new] = self.chars_used + np.cumsum(char_lengths) - char_lengths
        self.char_lengths[new] = char_lengths
        self.chars[self.chars_used : self.chars_used + chars.size] = chars
        self.chars_used += chars.size
        self.index.update(zip(hashes.tolist(), range(first, first + count)))
        return np.arange(first, first + count)

    def _tokens_of(self, word_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the cached tokens of words `word_ids` back to back, tokens per word)."""
        lengths = self.token_lengths[word_ids]
        return self.tokens[_positions(self.token_starts[word_ids], lengths)], lengths

    def _gather(self, word_ids: np.ndarray, words: _Words, text_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tokens, lengths = self._tokens_of(word_ids)
        token_ends = np.concatenate([[0], np.cumsum(lengths)])
        text_starts = np.cumsum(text_lengths) - text_lengths
        first_word = np.searchsorted(words.starts, text_starts)
        end_word = np.searchsorted(words.starts, text_starts + text_lengths)
        return tokens, token_ends[end_word] - token_ends[first_word]

    def _whole(self, texts: list[str], threads: int) -> tuple[np.ndarray, np.ndarray]:
        """SentencePiece's (tokens back to back, tokens per text). Through Python lists, not SentencePiece's numpy
        output (build's whole-document path): for many short texts, the new words, an array each is 1.7x slower."""
        encoded = self.processor.encode(texts, num_threads=threads)
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        return np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum())), lengths


def _parts(text: str, size: int) -> Iterator[str]:
    """`text` in consecutive parts of about `size` characters or fewer, each cut before a newline or before a space
    that follows a non-space (a boundary under both rules); a part grows past `size` only where no such cut is."""
    start = 0
    while len(text) - start > size:
        window = size
        while True:
            end = start + window
            cut = text.rfind("\n", start + 1, end)
            if cut < 0:
                cut = text.rfind(" ", start + 1, end)
                while cut > start and text[cut - 1] in (" ", SPACE_SYMBOL):
                    cut -= 1
            if cut > start or end >= len(text):
                break
            window *= 2
        if cut <= start:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _groups(parts: list[str], size: int) -> Iterator[list[str]]:
    """Consecutive parts in groups of at most `size` characters (a longer part alone)."""
    group: list[str] = []
    characters = 0
    for part in parts:
        if group and characters + len(part) > size:
            yield group
            group, characters = [], 0
        group.append(part)
        characters += len(part)
    if group:
        yield group


def _unique(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct values in order, where one of each is, each value's place among the distinct): np.unique's
    answer with any occurrence, not the first, which an unstable sort gives 3x faster."""
    order = np.argsort(values)
    ordered = values[order]
    starts_group = np.concatenate([[True], ordered[1:] != ordered[:-1]])
    inverse = np.empty(values.size, np.int64)
    inverse[order] = np.cumsum(starts_group) - 1
    group_starts = np.flatnonzero(starts_group)
    return ordered[group_starts], order[group_starts], inverse


def _positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """starts[0], ..., starts[0] + lengths[0] - 1, starts[1], ...: the positions of runs, back to back."""
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]) if ends.size else 0) + np.repeat(starts - (ends - lengths), lengths)


def _fit(array: np.ndarray, size: int) -> np.ndarray:
    """array, grown by doubling when it holds fewer than `size` items."""
    if size <= array.size:
        return array
    grown = np.zeros(max(size, 2 * array.size), array.dtype)
    grown[: array.size] = array
    return grown

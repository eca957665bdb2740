"""Gopher's document quality and repetition filters (Rae et al. 2021, "Scaling Language Models", appendix A).

Words are whitespace-separated tokens; a token without a letter or digit (`-`, `|`, `#`) is a
symbol, not a word. Lines are the non-blank lines; paragraphs are separated by blank lines.
Character fractions of repetition are measured over the characters of the words (spaces do not
count), and only repeats count as duplicates: the first occurrence of a line, paragraph or
n-gram is not. N-grams are compared exactly (word ids), with numpy, so a 100,000-word document
costs milliseconds. Each threshold is a dataclass field with the paper's value as its default.
This module must not change text; it only measures and rejects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from loom.data_tools.document import Document, Rejected, above, below, first_rejection

BULLETS = ("•", "‣", "◦", "○", "●", "▪", "▫", "■", "□", "-", "*", "–", "—", "·")
ELLIPSES = ("...", "…")
# Gopher's list: a document with fewer than two of these words is rarely natural English prose.
GOPHER_STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_EDGE_PUNCTUATION = "\"'“”‘’()[]{}<>.,;:!?"


def is_word(token: str) -> bool:
    return any(c.isalnum() for c in token)


def non_blank_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.strip()]


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()]


def duplicate_counts(items: list[str]) -> tuple[int, int]:
    """(items that repeat an earlier item, characters in those repeats)."""
    seen: set[str] = set()
    repeats = characters = 0
    for item in items:
        if item in seen:
            repeats += 1
            characters += len(item)
        else:
            seen.add(item)
    return repeats, characters


def _word_ids(words: list[str]) -> np.ndarray:
    vocabulary: dict[str, int] = {}
    return np.fromiter((vocabulary.setdefault(w, len(vocabulary)) for w in words), dtype=np.int64, count=len(words))


def _ngram_table(ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the n-grams starting at each position: (first position of the same n-gram, unique id, count per id)."""
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)
    _, first, inverse, counts = np.unique(windows, axis=0, return_index=True, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    return first[inverse], inverse, counts


def top_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters in all occurrences of the most frequent n-gram (if it repeats) over all word characters.

    Ties between equally frequent n-grams go to the one with more characters.
    """
    total = sum(map(len, words))
    if len(words) < n or total == 0:
        return 0.0
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    first, inverse, counts = _ngram_table(_word_ids(words), n)
    best = counts.max()
    if best < 2:
        return 0.0
    chars = np.lib.stride_tricks.sliding_window_view(lengths, n).sum(axis=1)
    top_chars = chars[counts[inverse] == best].max()
    return float(best * top_chars / total)


def duplicate_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters of the words covered by repeated occurrences of any n-gram over all word characters."""
    total = sum(map(len, words))
    if len(words) < n or total == 0:
        return 0.0
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    first, _, _ = _ngram_table(_word_ids(words), n)
    repeat_starts = np.flatnonzero(first != np.arange(first.size))
    if repeat_starts.size == 0:
        return 0.0
    # Mark [start, start + n) for every repeat with a difference array, so overlaps count once.
    edges = np.zeros(len(words) + 1, dtype=np.int64)
    np.add.at(edges, repeat_starts, 1)
    np.add.at(edges, repeat_starts + n, -1)
    covered = np.cumsum(edges[:-1]) > 0
    return float(lengths[covered].sum() / total)


@dataclass
class GopherQuality:
    """Gopher quality filter; defaults from Rae et al. 2021, appendix A.1.1 (as in reference-facts.md)."""

    type_name: ClassVar[str] = "gopher_quality"
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # each of "#" and ellipses ("...", "…") per word
    max_bullet_lines: float = 0.9
    max_ellipsis_lines: float = 0.3
    min_alpha_words: float = 0.8  # tokens with at least one letter, over all tokens
    min_stop_words: int = 2  # distinct words of GOPHER_STOP_WORDS ("at least two of the following words")
    stop_words: tuple = GOPHER_STOP_WORDS

    def __post_init__(self) -> None:
        if self.min_stop_words > len(set(self.stop_words)):  # the rule counted occurrences before 2026-11-28
            raise ValueError(
                f"min_stop_words = {self.min_stop_words} is more than the {len(set(self.stop_words))} stop words "
                "there are: it counts distinct stop words (the paper's 2 by default), so every page would be rejected"
            )

    def __call__(self, doc: Document) -> Rejected | None:
        tokens = doc.text.split()
        words = [t for t in tokens if is_word(t)]
        n_words = len(words)
        rejected = first_rejection(
            below("word_count", n_words, self.min_words), above("word_count", n_words, self.max_words)
        )
        if rejected or n_words == 0:
            return rejected or Rejected("word_count", "no words")
        mean_length = sum(map(len, words)) / n_words
        ellipses = sum(doc.text.count(e) for e in ELLIPSES)
        lines = [line.strip() for line in non_blank_lines(doc.text)] or [""]
        stop_words = set(self.stop_words)
        return first_rejection(
            below("mean_word_length", mean_length, self.min_mean_word_length),
            above("mean_word_length", mean_length, self.max_mean_word_length),
            above("hash_word_ratio", doc.text.count("#") / n_words, self.max_symbol_word_ratio),
            above("ellipsis_word_ratio", ellipses / n_words, self.max_symbol_word_ratio),
            above("bullet_lines", sum(line.startswith(BULLETS) for line in lines) / len(lines), self.max_bullet_lines),
            above(
                "ellipsis_lines", sum(line.endswith(ELLIPSES) for line in lines) / len(lines), self.max_ellipsis_lines
            ),
            below("alpha_words", sum(any(c.isalpha() for c in t) for t in tokens) / len(tokens), self.min_alpha_words),
            below(
                "stop_words",
                len(stop_words & {t.strip(_EDGE_PUNCTUATION).lower() for t in tokens}),
                self.min_stop_words,
            ),
        )


@dataclass
class GopherRepetition:
    """Gopher repetition filter; defaults from Rae et al. 2021, table A1 (as in reference-facts.md)."""

    type_name: ClassVar[str] = "gopher_repetition"
    max_duplicate_lines: float = 0.30
    max_duplicate_paragraphs: float = 0.30
    max_duplicate_line_chars: float = 0.20
    max_duplicate_paragraph_chars: float = 0.20
    # n -> maximum share of characters in the most frequent n-gram
    max_top_ngram_chars: tuple = ((2, 0.20), (3, 0.18), (4, 0.16))
    # n -> maximum share of characters in repeated n-grams
    max_duplicate_ngram_chars: tuple = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))

    def __post_init__(self):
        self.max_top_ngram_chars = tuple((int(n), float(limit)) for n, limit in self.max_top_ngram_chars)
        self.max_duplicate_ngram_chars = tuple((int(n), float(limit)) for n, limit in self.max_duplicate_ngram_chars)

    def __call__(self, doc: Document) -> Rejected | None:
        for kind, items, max_fraction, max_chars in (
            (
                "lines",
                [line.strip() for line in non_blank_lines(doc.text)],
                self.max_duplicate_lines,
                self.max_duplicate_line_chars,
            ),
            ("paragraphs", paragraphs(doc.text), self.max_duplicate_paragraphs, self.max_duplicate_paragraph_chars),
        ):
            if not items:
                continue
            repeats, chars = duplicate_counts(items)
            rejected = first_rejection(
                above(f"duplicate_{kind}", repeats / len(items), max_fraction),
                above(f"duplicate_{kind[:-1]}_chars", chars / max(1, sum(map(len, items))), max_chars),
            )
            if rejected:
                return rejected
        words = doc.text.split()
        for n, limit in self.max_top_ngram_chars:
            rejected = above(f"top_{n}gram_chars", top_ngram_char_fraction(words, n), limit)
            if rejected:
                return rejected
        for n, limit in self.max_duplicate_ngram_chars:
            rejected = above(f"duplicate_{n}gram_chars", duplicate_ngram_char_fraction(words, n), limit)
            if rejected:
                return rejected
        return None


STEPS = (GopherQuality, GopherRepetition)

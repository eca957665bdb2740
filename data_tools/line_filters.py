"""Line-level web filters (C4, FineWeb), code-file filters (Codex / The Stack) and a length filter.

C4 (Raffel et al. 2020, section 2.2) removes boilerplate lines and then judges what is left, so
it is the one filter here that changes text. FineWeb's filter (Penedo et al. 2024) judges the
line structure of a page. Code filters follow Codex (Chen et al. 2021, section 3.1: mean line
length <= 100, longest line <= 1000) and The Stack / StarCoder (alphanumeric fraction >= 0.25).
Each threshold is a dataclass field with the published value as its default. This module must
not repair text (text_repair.py) or judge prose quality (quality_filters.py).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from loom.data_tools.document import Document, Rejected, above, below, first_rejection
from loom.data_tools.quality_filters import duplicate_counts, non_blank_lines

# C4: a line must end in a period, exclamation mark, question mark or closing quotation mark.
C4_TERMINAL_PUNCTUATION = (".", "!", "?", '"', "”", "'", "’")
# The policy boilerplate C4's preprocessing removes line by line.
C4_POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
# FineWeb's "stop characters" for its line-punctuation ratio, as the FineWeb release ran datatrove (its default since
# is a multilingual set without straight quotes).
FINEWEB_TERMINAL_PUNCTUATION = (".", "'", '"', "!", "?")
_SENTENCE_END = re.compile(r"[.!?]+(?:[\"'”’)\]]*)(?=\s|$)")
_BLANK_RUNS = re.compile(r"\n{3,}")
_ALPHANUMERIC_RUN = re.compile(r"[^\W_]+")


def alphanumeric_count(text: str) -> int:
    """Letters and digits in text (runs found by the regex engine: a per-character loop is 10x slower)."""
    return sum(map(len, _ALPHANUMERIC_RUN.findall(text)))


def count_sentences(text: str) -> int:
    """Sentences as runs ending in . ! or ? followed by whitespace or the end (a simple splitter, like C4's)."""
    return len(_SENTENCE_END.findall(text))


def count_sentences_per_line(lines: list[str]) -> int:
    """TF-C4's count (c4_utils.clean_page, and datatrove's C4QualityFilter): each kept line's sentences, summed;
    a non-blank line is at least one sentence, as their sentence splitter makes it."""
    return sum(max(1, sum(bool(piece.strip()) for piece in _SENTENCE_END.split(line))) for line in lines if line)


@dataclass
class C4Lines:
    """C4's clean-up, line by line in the reference's order (TF-C4's `c4_utils.clean_page`, datatrove's
    C4QualityFilter): a line with an over-long word, without terminal punctuation or with too few words is dropped;
    on a line that passes those, "lorem ipsum" rejects the page, "javascript" drops the line, a "{" rejects the
    page and policy boilerplate drops the line; then a page with too few sentences is rejected. So a brace or
    lorem ipsum on a line dropped before that check (a short `{menu}` line) does not reject the page, although the
    paper's words (section 2.2) say "any page".

    FineWeb runs it with require_terminal_punctuation = false and judges punctuation per page instead.
    """

    type_name: ClassVar[str] = "c4"
    require_terminal_punctuation: bool = True
    min_words_per_line: int = 3
    max_word_length: int = 1000
    remove_javascript_lines: bool = True
    remove_policy_lines: bool = True
    reject_lorem_ipsum: bool = True
    reject_curly_braces: bool = True
    min_sentences: int = 5
    sentence_count: str = "per_line"
    """per_line: TF-C4's reference implementation (and datatrove's), each kept line's sentences summed, a line
    being at least one; regex: the paper's words, sentence ends counted over the cleaned page. They differ on
    lines without a sentence end, which only FineWeb's setting (require_terminal_punctuation = false) keeps:
    the reference counts each as a sentence, the regex not at all. The default follows the reference, the code
    every published C4-style dataset was built with."""

    def __post_init__(self) -> None:
        if self.sentence_count not in ("per_line", "regex"):
            raise ValueError(f"sentence_count = {self.sentence_count!r} is not per_line or regex")

    def _judge_line(self, line: str) -> bool | str | Rejected:
        """True to keep a (stripped, non-blank) line, why it is dropped, or the page's rejection."""
        words = line.split()
        if any(len(w) > self.max_word_length for w in words):
            return f"a word over {self.max_word_length} characters"
        if self.require_terminal_punctuation and not line.endswith(C4_TERMINAL_PUNCTUATION):
            return "no terminal punctuation"
        if len(words) < self.min_words_per_line:
            return f"under {self.min_words_per_line} words"
        lowered = line.lower()
        if self.reject_lorem_ipsum and "lorem ipsum" in lowered:
            return Rejected("lorem_ipsum", "a line contains 'lorem ipsum'")
        if self.remove_javascript_lines and "javascript" in lowered:
            return "javascript"
        if self.reject_curly_braces and "{" in line:
            return Rejected("curly_brace", "a line contains '{' (code or templates)")
        return (
            "policy boilerplate" if self.remove_policy_lines and any(p in lowered for p in C4_POLICY_PHRASES) else True
        )

    def __call__(self, doc: Document) -> Rejected | None:
        kept, dropped = [], Counter()
        # splitlines, as the reference: a U+2028, a form feed or a lone \r ends a line there too
        for line in (line.strip() for line in doc.text.splitlines()):
            verdict = self._judge_line(line) if line else True  # blank lines stay: paragraphs for the next steps
            if isinstance(verdict, Rejected):
                return verdict
            if verdict is True:
                kept.append(line)
            else:
                dropped[verdict] += 1
        doc.text = _BLANK_RUNS.sub("\n\n", "\n".join(kept)).strip("\n")
        if not doc.text:  # say which rules: a page written without spaces has lines of one "word"
            why = ", ".join(f"{count} {reason}" for reason, count in dropped.most_common())
            return Rejected("no_lines_left", f"every line was dropped ({why or 'no lines'})")
        sentences = count_sentences(doc.text) if self.sentence_count == "regex" else count_sentences_per_line(kept)
        return below("sentences", sentences, self.min_sentences)


@dataclass
class FineWebQuality:
    """FineWeb's page filter (Penedo et al. 2024; datatrove FineWebQualityFilter defaults)."""

    type_name: ClassVar[str] = "fineweb"
    min_line_punctuation: float = 0.12  # share of lines ending in FINEWEB_TERMINAL_PUNCTUATION
    short_line_length: int = 30  # characters
    max_short_lines: float = 0.67
    max_duplicate_line_chars: float = 0.01  # characters in repeated lines over all non-newline characters
    max_newline_word_ratio: float = 0.3

    def __call__(self, doc: Document) -> Rejected | None:
        lines = non_blank_lines(doc.text)  # unstripped, as datatrove's filter that made FineWeb judges them
        if not lines:
            return Rejected("empty", "no text")
        words = doc.text.split()
        characters = max(1, len(doc.text) - doc.text.count("\n"))
        return first_rejection(
            below(
                "line_punctuation",
                sum(line.endswith(FINEWEB_TERMINAL_PUNCTUATION) for line in lines) / len(lines),
                self.min_line_punctuation,
            ),
            above(
                "short_lines",
                sum(len(line) <= self.short_line_length for line in lines) / len(lines),
                self.max_short_lines,
            ),
            above("duplicate_line_chars", duplicate_counts(lines)[1] / characters, self.max_duplicate_line_chars),
            above("newline_word_ratio", doc.text.count("\n") / max(1, len(words)), self.max_newline_word_ratio),
        )


@dataclass
class CodeQuality:
    """Source-file filter: Codex's line-length limits (likely generated or data files) and The Stack's alphanumerics."""

    type_name: ClassVar[str] = "code"
    max_line_length: int = 1000
    max_mean_line_length: float = 100.0
    min_alphanumeric_fraction: float = 0.25

    def __call__(self, doc: Document) -> Rejected | None:
        lines = doc.text.split("\n")
        lengths = [len(line) for line in lines]
        return first_rejection(
            above("max_line_length", max(lengths), self.max_line_length),
            above("mean_line_length", sum(lengths) / len(lines), self.max_mean_line_length),
            below(
                "alphanumeric_fraction",
                alphanumeric_count(doc.text) / max(1, len(doc.text)),
                self.min_alphanumeric_fraction,
            ),
        )


@dataclass
class Length:
    """Documents outside [min_chars, max_chars] characters (whitespace stripped); max_chars 0 means no limit."""

    type_name: ClassVar[str] = "length"
    min_chars: int = 1
    max_chars: int = 0

    def __call__(self, doc: Document) -> Rejected | None:
        size = len(doc.text.strip())
        if size == 0 and self.min_chars > 0:
            return Rejected("empty", "no text after stripping whitespace")
        return first_rejection(
            below("characters", size, self.min_chars),
            above("characters", size, self.max_chars) if self.max_chars else None,
        )


STEPS = (C4Lines, FineWebQuality, CodeQuality, Length)

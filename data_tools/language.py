"""Language identification step: py3langid's naive Bayes model, which ships inside its PyPI package.

No download at run time: the model (about 4.5 MB) is read from the installed package once per
process. Every document passing this step gets `language` (py3langid's code: ISO 639-1 where the language has one,
else ISO 639-3 such as yue or ary; "und" below min_score)
and `language_score` (the normalised probability) in its output record; documents in languages
outside `languages` are rejected. An empty `languages` keeps every language and only labels, as
`--split-by-language` needs. This module must not write files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from loom.data_tools.document import Document, Rejected
from loom.data_tools.jsonl import InputError

UNDETERMINED = "und"


@functools.lru_cache(maxsize=1)
def identifier():
    """The py3langid identifier with normalised probabilities, loaded once per process."""
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        raise InputError("the language step needs py3langid: `pip install py3langid`") from None
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def identify(text: str, max_chars: int = 10_000) -> tuple[str, float]:
    """(language code, probability) for the first max_chars characters of text."""
    language, score = identifier().classify(text[:max_chars])
    return language, float(score)


def check_language_codes(codes) -> None:
    """Refuse codes py3langid never gives (a typo such as "eng" would keep or judge no document)."""
    known = set(identifier().labels)
    unknown = sorted(set(codes) - known)
    if unknown:
        raise ValueError(
            f"unknown language codes {', '.join(unknown)}; py3langid knows {len(known)} codes, ISO 639-1 where the "
            "language has one (en, de, fr, zh), else ISO 639-3 (yue, ary)"
        )


@dataclass
class LanguageFilter:
    """Keeps documents whose most likely language is in `languages` with probability >= min_score.

    0.65 is FineWeb's threshold for English (there with fastText); py3langid's probabilities are
    calibrated by text length, so short snippets score lower than pages.
    """

    type_name: ClassVar[str] = "language"
    languages: tuple = ("en",)
    min_score: float = 0.65
    max_chars: int = 10_000  # a page's first 10k characters decide; longer text costs time, not accuracy

    def __post_init__(self):
        check_language_codes(self.languages)

    def __call__(self, doc: Document) -> Rejected | None:
        best, score = identify(doc.text, self.max_chars)
        language = best if score >= self.min_score else UNDETERMINED
        doc.metadata["language"] = language
        doc.metadata["language_score"] = round(score, 4)
        if score < self.min_score:
            return Rejected("language_score", f"language_score {score:.3f} < {self.min_score:g} (best guess {best})")
        if self.languages and language not in self.languages:
            return Rejected("language", f"language {language} not in {', '.join(self.languages)}")
        return None


STEPS = (LanguageFilter,)

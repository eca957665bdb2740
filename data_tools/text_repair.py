"""Repair steps of a cleaning pipeline: mojibake (ftfy), Unicode normalisation, control characters, HTML.

These steps change a document's text and never reject it, except that HTML with no text to keep is rejected as
`empty_after_html` (and a page the extractor fails on or takes too long over as `html_extraction_failed` or
`html_timeout`). ftfy and trafilatura are imported lazily, so the other steps work without them.

HTML: FineWeb (Penedo et al. 2024) keeps a page's main content with trafilatura, which drops boilerplate (menus,
link lists, footers, cookie notices) by text density and markup; the web pipelines do the same, with datatrove's
settings (the library FineWeb was made with). The `stdlib` extractor keeps every visible text instead, block tags as
line breaks and only script, style, navigation, footers and forms dropped, on the standard library's html.parser:
no dependency, and `<pre>` layout kept. This module must not filter on quality; see quality_filters.py and
line_filters.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import re
import signal
import threading
import unicodedata
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import ClassVar, Iterator

from loom.data_tools.document import Document, Rejected
from loom.data_tools.jsonl import InputError

NORMAL_FORMS = ("NFC", "NFKC", "NFD", "NFKD")


@functools.lru_cache(maxsize=8)
def _ftfy_config(fixes: tuple[tuple[str, bool], ...]):
    try:
        import ftfy
    except ImportError:
        raise InputError("the unicode_repair step needs ftfy: `pip install ftfy`") from None
    # Normalisation is a step of its own; explanations cost time and are not reported.
    return ftfy.fix_text, ftfy.TextFixerConfig(**dict(fixes), normalization=None, explain=False)


@dataclass
class UnicodeRepair:
    """Mojibake and broken encodings repaired by ftfy (e.g. 'doesnâ€™t' -> 'doesn’t'); each field is the ftfy
    fixer of that name (ftfy's TextFixerConfig; its restore_byte_a0, replace_lossy_sequences and
    decode_inconsistent_utf8 are not fields: ftfy 6.3's fix_text ignores them unless it explains its fixes).

    Defaults keep what a language model should see as written: curly quotes, ligatures and
    full-width characters are left alone, and HTML entities are decoded only by html_to_text
    (so `&lt;` inside source code stays). ftfy's own defaults hold for the rest, which suit prose and can change
    code: a terminal escape is removed whole (`"\x1b[31m"` written raw becomes `""`), deliberate mojibake in a
    test is "repaired", U+2028 becomes a newline and a C1 control a Windows-1252 character; the code pipeline
    turns those off.
    """

    type_name: ClassVar[str] = "unicode_repair"
    unescape_html: bool = False
    uncurl_quotes: bool = False
    fix_latin_ligatures: bool = False
    fix_character_width: bool = False
    fix_encoding: bool = True
    remove_terminal_escapes: bool = True
    fix_c1_controls: bool = True
    fix_line_breaks: bool = True
    fix_surrogates: bool = True
    remove_control_chars: bool = True

    def __call__(self, doc: Document) -> Rejected | None:
        fix_text, config = _ftfy_config(tuple(dataclasses.asdict(self).items()))
        doc.text = fix_text(doc.text, config)
        return None


@dataclass
class Normalize:
    """Unicode normal form: NFC joins combining marks so equal text has equal code points."""

    type_name: ClassVar[str] = "normalize"
    form: str = "NFC"

    def __post_init__(self):
        if self.form not in NORMAL_FORMS:
            raise ValueError(f"form must be one of {', '.join(NORMAL_FORMS)}, got {self.form!r}")

    def __call__(self, doc: Document) -> Rejected | None:
        if not doc.text.isascii():
            doc.text = unicodedata.normalize(self.form, doc.text)
        return None


@functools.lru_cache(maxsize=8)
def _control_table(keep: str) -> dict[int, None]:
    controls = [*range(0x20), *range(0x7F, 0xA0)]
    return {c: None for c in controls if chr(c) not in keep}


@dataclass
class ControlChars:
    """Control characters (Unicode category Cc) removed, except `keep`; CR LF and lone CR become LF.

    Format characters (Cf: zero-width joiners, bidi marks) are kept: emoji and several scripts need them.
    """

    type_name: ClassVar[str] = "control_chars"
    keep: str = "\t\n"

    def __call__(self, doc: Document) -> Rejected | None:
        text = doc.text
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        doc.text = text.translate(_control_table(self.keep + "\n"))
        return None


_HTML_ELEMENTS = (
    "html|body|head|title|meta|link|script|style|noscript|div|span|p|br|hr|a|img|ul|ol|li|dl|dt|dd|table|thead|"
    "tbody|tr|td|th|h[1-6]|b|i|u|s|em|strong|small|sub|sup|code|kbd|pre|blockquote|section|article|header|footer|"
    "nav|aside|main|figure|figcaption|form|input|button|select|option|textarea|iframe|details|summary|center|font"
)
_LOOKS_LIKE_HTML = re.compile(rf"</?(?:{_HTML_ELEMENTS})\b[^>]*>", re.IGNORECASE)
_SPACES = re.compile(r"[ \t\f\v\r\n\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")
_SAME_LINE_BREAK = re.compile(r"[ \t]*\n")


class _TextExtractor(HTMLParser):
    """Visible text of an HTML page with block tags as line (or paragraph) breaks."""

    SKIPPED = frozenset(
        {
            "script",
            "style",
            "noscript",
            "template",
            "head",
            "svg",
            "nav",
            "footer",
            "aside",
            "form",
            "iframe",
            "button",
            "select",
            "object",
        }
    )
    PARAGRAPHS = frozenset(
        {
            "p",
            "h1",
            "h2",
            "h3",
            "h4",
            "h5",
            "h6",
            "blockquote",
            "pre",
            "table",
            "section",
            "article",
            "ul",
            "ol",
            "dl",
            "figure",
            "hr",
            "main",
        }
    )
    LINES = frozenset({"br", "div", "li", "tr", "dd", "dt", "header", "title", "td", "th", "figcaption"})

    SKELETON = frozenset({"html", "body"})

    def __init__(self, keep_newlines: bool = False):
        super().__init__(convert_charrefs=True)
        self._as_written = keep_newlines
        self.parts: list[str] = []
        self._skipped_depth = 0
        self._pre_depth = 0
        self._broke = False  # the last part is a break a tag made
        # Text that is not a page (as written) only mentions a tag whose end never comes: "put it in the <head>"
        # dropped the rest of the post, "starts with <html>" the word. Such tags are kept as written: the skeleton's
        # at their place in parts, a skipped element's with everything read inside it (_unclosed_skip).
        self._open_skeleton: dict[str, list[tuple[int, int, str]]] = {}  # (place in parts, order opened, tag)
        self._opened = 0
        self._unclosed_skip: list[str] = []

    def handle_starttag(self, tag, attrs):
        if self._as_written and not self._skipped_depth and tag in self.SKELETON:
            self._opened += 1
            self._open_skeleton.setdefault(tag, []).append((len(self.parts), self._opened, self.get_starttag_text()))
        if self._as_written and (self._skipped_depth or tag in self.SKIPPED):
            self._unclosed_skip.append(self.get_starttag_text())
        self._boundary(tag, opening=True)

    def handle_endtag(self, tag):
        if self._open_skeleton.get(tag) and not self._skipped_depth:
            self._open_skeleton[tag].pop()
        if self._as_written and self._skipped_depth:
            self._unclosed_skip.append(f"</{tag}>")
        self._boundary(tag, opening=False)
        if not self._skipped_depth:
            self._unclosed_skip.clear()

    def handle_startendtag(self, tag, attrs):
        if self._as_written and self._skipped_depth:
            self._unclosed_skip.append(self.get_starttag_text())
        if tag not in self.SKIPPED:
            self._boundary(tag, opening=True)

    def _boundary(self, tag: str, opening: bool) -> None:
        if tag in self.SKIPPED:
            self._skipped_depth = max(0, self._skipped_depth + (1 if opening else -1))
        elif tag == "pre":
            self._pre_depth = max(0, self._pre_depth + (1 if opening else -1))
        if self._skipped_depth and self._as_written:  # what it holds may come back as written (text())
            return
        wanted = 2 if tag in self.PARAGRAPHS else 1 if tag in self.LINES else 0
        # Adjacent boundaries (</li><li>) share their breaks instead of adding them up.
        trailing = len(self.parts[-1]) - len(self.parts[-1].rstrip("\n")) if self.parts else wanted
        if wanted > trailing:
            self.parts.append("\n" * (wanted - trailing))
        self._broke = self._broke or wanted > 0

    def handle_data(self, data):
        if self._skipped_depth:
            if self._as_written:
                self._unclosed_skip.append(data)
            return
        if not self._pre_depth and not self._as_written:
            # Source formatting is not layout, except inside <pre> (or in text that is not a page).
            data = _SPACES.sub(" ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip(" ")
        elif self._as_written and self._broke:
            # "one<br>\ntwo": the newline written after the tag is the break it made, not a blank line; spaces on
            # the tag's own line are not an indent
            data = _SAME_LINE_BREAK.sub("", data, count=1) if _SAME_LINE_BREAK.match(data) else data.lstrip(" ")
        if data:
            self.parts.append(data)
            self._broke = False

    def text(self) -> str:
        if self._skipped_depth and self._unclosed_skip:  # html.parser keeps an unclosed <script>'s text unread
            self.parts.append("".join(self._unclosed_skip) + self.rawdata)
        # the later-opened first, so that <html><body> at one place goes back in that order
        for index, _, tag in sorted((mark for marks in self._open_skeleton.values() for mark in marks), reverse=True):
            self.parts.insert(index, tag)
        lines = (line.rstrip() for line in "".join(self.parts).split("\n"))
        return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def html_to_text(html: str, keep_newlines: bool = False) -> str:
    """The visible text of an HTML document: scripts, styles and navigation dropped, entities decoded. A page's
    newlines and spaces are source formatting; `keep_newlines` keeps those of text that is not a page (markdown or a
    post with a stray tag, whose paragraphs, lists and indented code are its newlines and spaces) as written."""
    extractor = _TextExtractor(keep_newlines)
    extractor.feed(html)
    extractor.close()
    return extractor.text()


HTML_EXTRACTORS = ("trafilatura", "stdlib")


# A page begins with its doctype or <html> (after an XML declaration or comments, if any); prose that mentions
# <html> or <body> is not one.
_WHOLE_PAGE = re.compile(r"\A\s*(?:<\?xml[^>]*>\s*)?(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html)\b", re.I | re.S)


@dataclass
class HtmlToText:
    """HTML converted to text; with only_if_html, documents without HTML tags are left alone.

    extractor `trafilatura`: a whole page (one that begins with a doctype or `<html>`) keeps its main content, as
    FineWeb kept it (datatrove's Trafilatura extractor: favour precision, no comments), one line per paragraph; a
    page where it finds none is rejected (empty_after_html). Text that is not a whole page (a post with a stray
    `<br>` or link, a fragment, prose that mentions <html>) goes through `stdlib`, which keeps its words, newlines
    and spaces as written: trafilatura keeps nothing of it. Unlike datatrove's default, trafilatura's cross-document
    deduplication is off: it remembers the segments of every page a process has seen, so a page's text would depend
    on which worker read it and after what (Gopher's repetition rules judge repeats within a page, `loom data dedup`
    across pages). `stdlib`: every visible text."""

    type_name: ClassVar[str] = "html_to_text"
    only_if_html: bool = True
    extractor: str = "trafilatura"
    timeout_seconds: float = 1.0
    """trafilatura only: a page it takes longer over is rejected (html_timeout), as datatrove drops it; 0: no limit.
    Checked between Python steps (a SIGALRM), so a parse inside lxml's C code runs to its end first."""

    def __post_init__(self) -> None:
        if self.extractor not in HTML_EXTRACTORS:
            raise ValueError(f"extractor = {self.extractor!r} is not one of {', '.join(HTML_EXTRACTORS)}")
        if not math.isfinite(self.timeout_seconds):
            raise ValueError(f"timeout_seconds = {self.timeout_seconds} must be a number of seconds (0: no limit)")
        if self.extractor == "stdlib" and self.timeout_seconds != 1.0:
            raise ValueError("timeout_seconds is trafilatura's time limit; extractor stdlib takes none")
        if self.extractor == "trafilatura" and importlib.util.find_spec("trafilatura") is None:
            raise ValueError(
                'extractor trafilatura needs trafilatura: `pip install trafilatura`, or set extractor = "stdlib"'
            )

    def __call__(self, doc: Document) -> Rejected | None:
        if self.only_if_html and not _LOOKS_LIKE_HTML.search(doc.text):
            return None
        whole_page = _WHOLE_PAGE.match(doc.text) is not None
        by_trafilatura = self.extractor == "trafilatura" and whole_page
        if not by_trafilatura:
            doc.text = html_to_text(doc.text, keep_newlines=not whole_page)
        else:
            _trafilatura()  # outside the try: a trafilatura that cannot start fails the command, not every page
            try:
                doc.text = main_content(doc.text, self.timeout_seconds)
            except _ExtractionTimeout:
                return Rejected("html_timeout", f"trafilatura took over {self.timeout_seconds:g} s")
            except Exception as error:  # noqa: BLE001 -- a page the library cannot take is a rejected document
                return Rejected("html_extraction_failed", f"{type(error).__name__}: {str(error)[:200]}")
        if doc.text:
            return None
        if by_trafilatura:
            return Rejected("empty_after_html", "trafilatura found no main content in the page")
        return Rejected("empty_after_html", "no text to keep in the HTML")


class _ExtractionTimeout(BaseException):
    """Not an Exception: trafilatura catches those around its slower stages, and went on with the limit spent."""


@functools.lru_cache(maxsize=1)
def _trafilatura():
    """trafilatura's extract, once warmed up: its first call loads what a page's timeout must not pay for."""
    from trafilatura import extract

    extract("<html><body><p>" + "A paragraph of text to warm up the extractor. " * 8 + "</p></body></html>")
    return extract


def main_content(html: str, timeout_seconds: float = 0.0) -> str:
    """The main content of an HTML page as trafilatura extracts it with FineWeb's settings ("" where it finds none);
    raises _ExtractionTimeout after `timeout_seconds` (0: none)."""
    extract = _trafilatura()
    with _time_limit(timeout_seconds):
        text = extract(html, favor_precision=True, include_comments=False, deduplicate=False)
    return text or ""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _ExtractionTimeout in this thread after `seconds`. No limit with 0, off the main thread (which alone
    takes signals), or where a timer of someone else's runs (a test's hang guard): replacing it would cancel it."""
    elsewhere = threading.current_thread() is not threading.main_thread()
    if not seconds or elsewhere or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def expired(signum, frame):
        raise _ExtractionTimeout

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


STEPS = (UnicodeRepair, Normalize, ControlChars, HtmlToText)

"""Streaming JSONL input and atomic JSONL output for every data step (.jsonl, .jsonl.gz, .jsonl.zst).

Readers yield one dict per good line and count bad lines (invalid JSON, a JSON value that is not an
object, a missing or non-string text field, a lone surrogate) in a JsonlStats instead of stopping: real
corpora always hold a few. Each bad line also goes to the caller's `on_bad_line` (a `bad_line` record:
file, line number, reason, the raw line), so that a command can keep it: lines = documents + bad +
blank, exactly. A line with a few bytes that are not UTF-8 (a Latin-1 "café") is a document with an
encoding problem, not a bad line: those bytes are decoded as Windows-1252 (Latin-1 where 1252 has no
character), the line is kept and counted in `repaired_utf8`. Memory stays flat in the size of the
input. This module must not tokenize or filter documents; it only moves them in and out of files.
"""

from __future__ import annotations

import base64
import codecs
import gzip
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

from loom.data_tools.atomic import atomic_path
from loom.errors import LoomError

ZSTD_SUFFIXES = (".zst", ".zstd")
# Size estimates count a compressed byte as this many bytes of text (JSONL compresses 3-5x).
COMPRESSION_RATIO = 4
_COUNT_BLOCK_BYTES = 16 << 20


class InputError(LoomError):
    """An input that cannot be read at all; the one-line message says which and what to do."""


@dataclass
class JsonlStats:
    """What a reader saw: lines read, documents yielded and bad lines by reason."""

    files: int = 0
    lines: int = 0
    documents: int = 0
    blank_lines: int = 0
    invalid_json: int = 0
    not_an_object: int = 0
    missing_text: int = 0
    text_not_a_string: int = 0
    invalid_utf8: int = 0  # lone surrogates escaped in JSON: no UTF-8 file or tokenizer can hold them
    repaired_utf8: int = 0  # documents kept after decoding their non-UTF-8 bytes as Windows-1252

    @property
    def bad_lines(self) -> int:
        return self.invalid_json + self.not_an_object + self.missing_text + self.text_not_a_string + self.invalid_utf8

    def as_dict(self) -> dict:
        return {**asdict(self), "bad_lines": self.bad_lines}


def _zstandard(path: Path, writing: bool = False):
    try:
        import zstandard
    except ImportError:
        what = f"writing {path} zstd-compressed" if writing else f"{path} is zstd-compressed; reading it"
        raise InputError(
            f"{what} needs the zstandard module: pip install 'loom[zstd]'"
            + (", or name it .jsonl.gz" if writing else "")
        ) from None
    return zstandard


def _not_a_file(path: Path) -> FileNotFoundError:
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".gz", *ZSTD_SUFFIXES))
        hint = f" (here: {', '.join(found[:3])})" if found else ""
        return FileNotFoundError(f"input {path} is a directory; give its JSONL files{hint}")
    return FileNotFoundError(f"input {path} does not exist")


def open_input(path: str | Path) -> IO[bytes]:
    """A binary stream over a plain, gzip or zstd file, chosen by its suffix."""
    path = Path(path)
    if not path.is_file():
        raise _not_a_file(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix in ZSTD_SUFFIXES:
        decompressor = _zstandard(path).ZstdDecompressor()
        return io.BufferedReader(decompressor.stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _as_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def check_inputs(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """The input paths, after checking up front that each exists and can be decompressed."""
    checked = _as_paths(paths)
    if not checked:
        raise FileNotFoundError("no input files given")
    seen: dict[Path, Path] = {}
    for path in checked:
        if not path.is_file():
            raise _not_a_file(path)
        if path.suffix in ZSTD_SUFFIXES:
            _zstandard(path)
        earlier = seen.get(path.resolve())
        if earlier is not None:
            named = f"{path}" if str(earlier) == str(path) else f"{earlier} and {path}"
            raise InputError(f"input {named} is given twice (its documents would be read twice); give each file once")
        seen[path.resolve()] = path
    return checked


def _is_compressed(path: Path) -> bool:
    return path.suffix in (".gz", *ZSTD_SUFFIXES)


def estimated_output_bytes(output: Path, text_bytes: int) -> int:
    """What `text_bytes` of JSONL take written to `output`: COMPRESSION_RATIO times less compressed (by suffix)."""
    return text_bytes // COMPRESSION_RATIO if _is_compressed(Path(output)) else text_bytes


def estimated_input_bytes(paths: Iterable[Path]) -> int:
    """Expected uncompressed size of the input (compressed files count COMPRESSION_RATIO times)."""
    return sum(p.stat().st_size * (COMPRESSION_RATIO if _is_compressed(p) else 1) for p in paths)


def count_lines(paths: Iterable[Path]) -> int | None:
    """Lines in uncompressed inputs (a fast byte scan, for a progress bar's total); None if any is compressed."""
    paths = list(paths)
    if any(map(_is_compressed, paths)):
        return None
    lines = 0
    for path in paths:
        with open(path, "rb") as stream:
            last = b"\n"
            while block := stream.read(_COUNT_BLOCK_BYTES):
                lines += block.count(b"\n")
                last = block[-1:]
            lines += last != b"\n"
    return lines


BAD_LINES_NAME = "bad_lines.jsonl"
BadLineSink = Callable[[dict], None]


def _windows_1252_bytes(error: UnicodeDecodeError) -> tuple[str, int]:
    """Decode error handler: the undecodable bytes as Windows-1252 (the web's usual non-UTF-8), else Latin-1."""
    chars = []
    for byte in error.object[error.start : error.end]:
        try:
            chars.append(bytes([byte]).decode("cp1252"))
        except UnicodeDecodeError:  # 0x81, 0x8d, 0x8f, 0x90, 0x9d have no cp1252 character
            chars.append(chr(byte))
    return "".join(chars), error.end


codecs.register_error("loom_cp1252_fallback", _windows_1252_bytes)


def bad_line(path: Path, number: int, reason: str, detail: str, raw: bytes) -> dict:
    """The record a bad line is kept as: where it was, why it was not a document, and its bytes.

    The raw line is text when it is UTF-8, else base64, so that the record is valid JSON either way
    and the original bytes can be restored exactly."""
    try:
        kept = {"raw": raw.decode("utf-8")}
    except UnicodeDecodeError:
        kept = {"raw_base64": base64.b64encode(raw).decode("ascii")}
    return {"file": str(path), "line": number, "reason": reason, "detail": detail, **kept}


UTF8_BOM = b"\xef\xbb\xbf"


def no_documents(text_key: str, paths: Iterable[str | Path]) -> str:
    """What a data command says when its input held no document: which field it looked for, and where."""
    nested = " (a top-level key: nested fields are not read)" if "." in text_key else ""
    return f"no documents with a string {text_key!r} field{nested} in {', '.join(map(str, paths))}"


def _decoded(raw: bytes) -> tuple[str, bool]:
    """The line as text, and whether some of its bytes needed the fallback."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", "loom_cp1252_fallback"), True


def _parse_line(line: str, text_key: str) -> tuple[dict | None, str, str]:
    """(record, "", "") for a document, else (None, reason, detail); reason is a JsonlStats field."""
    try:
        record = json.loads(line)
    except ValueError as error:
        return None, "invalid_json", str(error)
    if not isinstance(record, dict):
        return None, "not_an_object", f"a JSON {type(record).__name__}, not an object"
    if text_key not in record:
        return None, "missing_text", f"no {text_key!r} field"
    text = record[text_key]
    if not isinstance(text, str):
        return None, "text_not_a_string", f"{text_key!r} is a JSON {type(text).__name__}"
    # JSON may escape lone surrogates, which no tokenizer or UTF-8 file can hold.
    if "\\u" in line and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None, "invalid_utf8", f"{text_key!r} holds a lone surrogate (an escaped \\ud800-\\udfff)"
    return record, "", ""


def iter_jsonl(
    paths: str | Path | Iterable[str | Path],
    text_key: str = "text",
    stats: JsonlStats | None = None,
    on_bad_line: BadLineSink | None = None,
) -> Iterator[dict]:
    """Yield every good record (a dict whose `text_key` is a string) of the files, in order.

    Each bad line is counted in `stats` and handed to `on_bad_line` as a `bad_line` record."""
    for _, _, record in located_jsonl(paths, text_key, stats, on_bad_line):
        yield record


def located_jsonl(
    paths: str | Path | Iterable[str | Path],
    text_key: str = "text",
    stats: JsonlStats | None = None,
    on_bad_line: BadLineSink | None = None,
) -> Iterator[tuple[Path, int, dict]]:
    """iter_jsonl's records with where each was read: (file, line number from 1, record)."""
    stats = stats if stats is not None else JsonlStats()
    for path in _as_paths(paths):
        with open_input(path) as stream:
            stats.files += 1
            try:
                for number, raw in enumerate(stream, start=1):
                    stats.lines += 1
                    raw = raw.rstrip(b"\r\n")
                    if number == 1 and raw.startswith(UTF8_BOM):  # a file saved "with BOM" (Windows editors)
                        raw = raw[len(UTF8_BOM) :]
                    line, repaired = _decoded(raw)
                    if not line.strip():
                        stats.blank_lines += 1
                        continue
                    record, reason, detail = _parse_line(line, text_key)
                    if record is None:
                        setattr(stats, reason, getattr(stats, reason) + 1)
                        if on_bad_line is not None:
                            on_bad_line(bad_line(path, number, reason, detail, raw))
                        continue
                    stats.documents += 1
                    stats.repaired_utf8 += repaired
                    yield path, number, record
            except (EOFError, OSError) as error:
                raise InputError(f"{path} is truncated or corrupt after line {stats.lines}: {error}") from None


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> int:
    """Write records one per line (compressed by suffix) under a temporary name, then rename; returns the count."""
    path = Path(path)
    count = 0
    with atomic_path(path) as tmp:
        with _writer(path, tmp) as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
                count += 1
    return count


def _writer(final: Path, tmp: Path) -> IO[bytes]:
    """Open tmp for writing with the compression the final name asks for."""
    if final.suffix == ".gz":
        return gzip.open(tmp, "wb", compresslevel=6)
    if final.suffix in ZSTD_SUFFIXES:
        return _zstandard(final, writing=True).ZstdCompressor().stream_writer(open(tmp, "wb"), closefd=True)
    return open(tmp, "wb", buffering=1 << 20)


class BadLinesFile:
    """An `on_bad_line` sink: bad-line records as JSONL at `path`, created on the first one only."""

    def __init__(self, path: str | Path):
        self.path, self.count = Path(path), 0
        self._out: IO[str] | None = None

    def __call__(self, record: dict) -> None:
        if self._out is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out = open(self.path, "w", encoding="utf-8", buffering=1 << 20)
        self._out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1

    def close(self) -> None:
        if self._out is not None:
            self._out.close()

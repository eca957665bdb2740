"""Streaming JSONL input and atomic JSONL output for every data step (.jsonl, .jsonl.gz, .jsonl.zst).

Readers yield one dict per good line and count bad lines (invalid JSON, a missing or non-string
text field, bytes that are not UTF-8) in a JsonlStats instead of stopping: real corpora always
hold a few. Memory stays flat in the size of the input. This module must not tokenize or filter
documents; it only moves them in and out of files.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator

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
    missing_text: int = 0
    invalid_utf8: int = 0

    @property
    def bad_lines(self) -> int:
        return self.invalid_json + self.missing_text + self.invalid_utf8

    def as_dict(self) -> dict:
        return {**asdict(self), "bad_lines": self.bad_lines}


def _zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise InputError(f"{path} is zstd-compressed; install the decoder with `pip install zstandard`") from None
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
    for path in checked:
        if not path.is_file():
            raise _not_a_file(path)
        if path.suffix in ZSTD_SUFFIXES:
            _zstandard(path)
    return checked


def _is_compressed(path: Path) -> bool:
    return path.suffix in (".gz", *ZSTD_SUFFIXES)


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


def _parse_line(raw: bytes, text_key: str, stats: JsonlStats) -> dict | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        return None
    if not line.strip():
        stats.blank_lines += 1
        return None
    try:
        record = json.loads(line)
    except ValueError:
        stats.invalid_json += 1
        return None
    if not isinstance(record, dict):
        stats.invalid_json += 1
        return None
    text = record.get(text_key)
    if not isinstance(text, str):
        stats.missing_text += 1
        return None
    # JSON may escape lone surrogates, which no tokenizer or UTF-8 file can hold.
    if "\\u" in line and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            stats.invalid_utf8 += 1
            return None
    return record


def iter_jsonl(
    paths: str | Path | Iterable[str | Path], text_key: str = "text", stats: JsonlStats | None = None
) -> Iterator[dict]:
    """Yield every good record (a dict whose `text_key` is a string) of the files, in order."""
    stats = stats if stats is not None else JsonlStats()
    for path in _as_paths(paths):
        with open_input(path) as stream:
            stats.files += 1
            try:
                for raw in stream:
                    stats.lines += 1
                    record = _parse_line(raw.rstrip(b"\r\n"), text_key, stats)
                    if record is not None:
                        stats.documents += 1
                        yield record
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
        return _zstandard(final).ZstdCompressor().stream_writer(open(tmp, "wb"), closefd=True)
    return open(tmp, "wb", buffering=1 << 20)

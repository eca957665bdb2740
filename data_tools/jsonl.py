"""Streaming JSONL input (.jsonl, .jsonl.gz, .jsonl.zst) that counts bad lines instead of crashing,
and atomic JSONL output. Every line read is accounted for in `ReadStats`."""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO


@dataclass
class ReadStats:
    lines: int = 0
    documents: int = 0
    invalid_json: int = 0
    not_an_object: int = 0
    missing_text_key: int = 0
    invalid_utf8: int = 0
    truncated_files: list[str] = field(default_factory=list)

    @property
    def bad_lines(self) -> int:
        return self.invalid_json + self.not_an_object + self.missing_text_key + self.invalid_utf8

    def as_dict(self) -> dict:
        return {**asdict(self), "bad_lines": self.bad_lines}


def open_binary(path: str | Path) -> BinaryIO:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input {path} does not exist")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise FileNotFoundError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") \
                from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def iter_documents(paths: Iterable[str | Path], text_key: str = "text",
                   stats: ReadStats | None = None) -> Iterator[dict]:
    """Yield each valid JSON object whose `text_key` is a string; count everything else in `stats`."""
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        with open_binary(path) as stream:
            try:
                for raw in stream:
                    record = _parse_line(raw, text_key, stats)
                    if record is not None:
                        stats.documents += 1
                        yield record
            except (EOFError, gzip.BadGzipFile, OSError) as error:
                stats.truncated_files.append(f"{path}: {error}")


def _parse_line(raw: bytes, text_key: str, stats: ReadStats) -> dict | None:
    if not raw.strip():
        return None
    stats.lines += 1
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        stats.invalid_json += 1
        return None
    if not isinstance(record, dict):
        stats.not_an_object += 1
        return None
    if not isinstance(record.get(text_key), str):
        stats.missing_text_key += 1
        return None
    return record


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> int:
    """Write records to `path` through a temporary file renamed when complete; returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    count = 0
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(tmp, "wt", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count

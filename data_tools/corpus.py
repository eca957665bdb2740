"""The embedded default corpus: this interpreter's Python standard library, one document per .py file.

It needs no download, so the whole pipeline runs anywhere. Files are visited in sorted order, so
the corpus is deterministic for a given Python build; site-packages and __pycache__ are skipped,
test suites are kept. This module only collects documents; it must not clean or tokenize them.
"""

from __future__ import annotations

import sys
import sysconfig
import time
import tokenize
from contextlib import closing
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from loom.data_tools.failures import reported_failures
from loom.data_tools.jsonl import InputError, estimated_output_bytes, write_jsonl_atomic
from loom.data_tools.manifest import manifest_path, write_manifest

SOURCE_NAME = "python-stdlib"
# JSON escapes (quotes, backslashes, newlines) and the id field make a document's line this much longer than its file.
JSON_OVERHEAD = 1.15
_SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[Path]:
    """Every .py file under root outside site-packages and __pycache__, sorted by relative path."""
    files = [
        path
        for path in root.rglob("*.py")
        if path.is_file() and not _SKIPPED_DIRECTORIES.intersection(path.relative_to(root).parts)
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def read_source(path: Path) -> str | None:
    """The text of a Python file in its declared encoding (PEP 263), or None if it does not decode."""
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def _documents(files: list[Path], root: Path, counts: dict, progress: bool) -> Iterator[dict]:
    for path in tqdm(files, desc="stdlib corpus", unit="file", file=sys.stderr, disable=not progress, mininterval=1.0):
        text = read_source(path)
        if text is None:
            counts["undecodable"] += 1
            continue
        counts["documents"] += 1
        counts["empty"] += not text
        counts["characters"] += len(text)
        yield {"id": f"stdlib/{path.relative_to(root).as_posix()}", "text": text, "source": SOURCE_NAME}


def build_stdlib_corpus(output: Path, max_docs: int | None = None, *, progress: bool = True) -> dict:
    """Write the corpus as JSONL to `output` (atomically); returns counts of what was written and skipped."""
    output, started = Path(output), time.time()
    root = stdlib_root()
    files = stdlib_sources(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; this Python has no standard library sources")
    if max_docs is not None and max_docs < 0:
        raise InputError(f"max_docs must be >= 0, got {max_docs}")
    counts = {"documents": 0, "empty": 0, "undecodable": 0, "characters": 0}
    chosen = files if max_docs is None else files[:max_docs]
    text_bytes = int(sum(path.stat().st_size for path in chosen) * JSON_OVERHEAD)
    with reported_failures(output, estimated_output_bytes(output, text_bytes)):
        # Closed on failure too, so the progress bar ends before the error is printed.
        with closing(_documents(files, root, counts, progress)) as documents:
            # range comes first so that zip stops before pulling (and counting) one document too many.
            write_jsonl_atomic(
                output, documents if max_docs is None else (d for _, d in zip(range(max_docs), documents))
            )
        try:
            # files read (each a document, or undecodable and skipped), of the files_available the embedded corpus has
            read = counts["documents"] + counts["undecodable"]
            result = {**counts, "files": read, "files_available": len(files), "bytes": output.stat().st_size}
            result["output"] = str(output)
            write_manifest(
                output,
                command="loom data corpus",
                inputs=[],
                outputs=[output],
                parameters={
                    "source": "stdlib",
                    "stdlib_root": str(root),
                    "python": sys.version.split()[0],
                    "max_docs": max_docs,
                },
                counts={k: result[k] for k in ("documents", "empty", "undecodable", "files")},
                started=started,
                is_folder=False,
            )
        except BaseException:
            # The new corpus replaced the old one: without its manifest (or beside the old one) it would look finished.
            output.unlink(missing_ok=True)
            manifest_path(output, is_folder=False).unlink(missing_ok=True)
            raise
    return result

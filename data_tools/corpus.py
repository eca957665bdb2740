"""The embedded default corpus: this interpreter's Python standard library, one document per .py file.

Deterministic (sorted paths) and needs no download. Files that are not valid UTF-8 are counted
and skipped; site-packages and caches are not part of it.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from data_tools.jsonl import write_jsonl_atomic

SKIPPED_DIRECTORIES = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRECTORIES & set(p.relative_to(root).parts))


def _documents(files: list[Path], root: Path, counts: dict) -> Iterator[dict]:
    for path in tqdm(files, desc="corpus", unit="file", mininterval=1.0):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            counts["unreadable"] += 1
            continue
        counts["documents"] += 1
        counts["bytes"] += len(text.encode("utf-8"))
        yield {"id": f"stdlib/{path.relative_to(root).as_posix()}", "text": text, "source": "python-stdlib"}


def build_stdlib_corpus(output: Path, max_docs: int | None = None) -> dict:
    """Write the corpus as JSONL to `output`; returns counts (documents, bytes, unreadable files)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()[:max_docs]
    counts = {"files": len(files), "documents": 0, "bytes": 0, "unreadable": 0}
    write_jsonl_atomic(output, _documents(files, root, counts))
    return counts

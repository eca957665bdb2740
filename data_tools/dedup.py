"""`loom data dedup`: drop exact (normalised-text hash), near (MinHash + LSH) or semantic (embedding) duplicates.

Two passes over the input: the first decides, for every document, which document it duplicates
(itself when it is kept: the first of its cluster in input order); the second streams the input
again and writes the decisions. Texts are never held: exact keeps one 16-byte hash per document,
minhash keeps its signatures and band keys on disk (data_tools/minhash_lsh.py), semantic its
embeddings (data_tools/semantic.py); document ids go to a staging file with one offset per
document. Exact normalisation is Unicode NFKC, case folding, whitespace runs collapsed.

Outputs in D: kept.jsonl (every field kept), removed/removed.jsonl (each with `duplicate_of`, the
id of the kept document), clusters.jsonl (one line per cluster with a removed document, in the
order of their kept documents: kept id, removed ids in input order, size), rejected/bad_lines.jsonl (each
input line that is not a document, with file, line, reason and the raw line), stats.json (input =
kept + removed, plus bad input lines, and `repeated_ids`: documents whose id an earlier one has, which
make those names ambiguous), manifest.json (lineage, written last). A document is named by its `id`
field; one without gets `FILE:LINE` of the input as its id, written into kept.jsonl or removed.jsonl.
Everything is written under D/.staging-<host>-<pid>/ (engine/atomic.staging_folder: the next run removes one a
killed run left) and moved into place only when complete, so an interrupted run leaves no output that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import unicodedata
from array import array
from collections.abc import Iterable, Iterator
from contextlib import suppress
from pathlib import Path

import numpy as np
from tqdm import tqdm

from loom.data_tools.atomic import atomic_path, staging_folder
from loom.data_tools.failures import reported_failures
from loom.data_tools.jsonl import (
    BAD_LINES_NAME,
    BadLinesFile,
    InputError,
    JsonlStats,
    check_inputs,
    estimated_input_bytes,
    iter_jsonl,
    located_jsonl,
    no_documents,
)
from loom.data_tools.manifest import write_manifest
from loom.data_tools.minhash_lsh import LshPlan, cluster_on_disk, plan_lsh, staging_bytes
from loom.data_tools.progress import Progress

_WHITESPACE = re.compile(r"\s+")
METHODS = ("exact", "minhash", "semantic")
# semantic: all-MiniLM-L6-v2 gives 0.90-0.98 to a paragraph with its sentences reordered, >= 0.99 to light
# edits and <= 0.1 to unrelated topics (tests/test_dedup_semantic.py).
DEFAULT_THRESHOLDS = {"minhash": 0.8, "semantic": 0.9}
_PROGRESS_EVERY = 256


_DIGEST_PIECE_CHARACTERS = 1 << 20


def normalise(text: str) -> str:
    """What exact dedup compares: NFKC, case-folded, whitespace collapsed (text_digest hashes it piece by piece)."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_digest(text: str) -> bytes:
    """16 bytes of SHA-256 of the normalised text: collisions are negligible below ~10^18 documents. The text is
    normalised a piece of about 1 M characters at a time (one 218 MB document took 4.5 GB whole): pieces cut where
    whitespace begins normalise to the words the whole does, as NFKC composes no character with whitespace that
    follows it."""
    digest, start, separator = hashlib.sha256(), 0, b""
    while start < len(text):
        gap = _WHITESPACE.search(text, start + _DIGEST_PIECE_CHARACTERS)
        end = gap.start() if gap is not None else len(text)
        words = " ".join(unicodedata.normalize("NFKC", text[start:end]).casefold().split())
        if words:
            digest.update(separator + words.encode("utf-8"))
            separator = b" "
        start = end
    return digest.digest()[:16]


def exact_representatives(texts: Iterable[str]) -> np.ndarray:
    first_seen: dict[bytes, int] = {}
    return np.fromiter((first_seen.setdefault(text_digest(text), i) for i, text in enumerate(texts)), dtype=np.int64)


def document_id(record: dict, path: Path, line: int) -> str:
    """What dedup's outputs call a document: its `id` field, else where it was read (`FILE:LINE`), which the
    kept and removed documents then carry as their `id`."""
    given = record.get("id")
    return f"{path}:{line}" if given is None else str(given)


class _DocumentIds:
    """Every document's id in a staging file, found through one int64 offset per document (and a hash of it,
    to find ids that repeat)."""

    def __init__(self, path: Path):
        self.path = path
        self._out = open(path, "wb", buffering=1 << 20)
        self._offsets = array("q", [0])
        self._hashes = array("q")
        self._mapped: np.memmap | None = None

    def append(self, doc_id: str) -> None:
        encoded = doc_id.encode("utf-8", "surrogatepass")
        self._out.write(encoded)
        self._offsets.append(self._offsets[-1] + len(encoded))
        self._hashes.append(hash(doc_id))

    def repeated(self) -> int:
        """How many documents have the id of an earlier document (after close)."""
        hashes = np.frombuffer(self._hashes, dtype=np.int64)
        _, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
        sharing = [self[int(doc)] for doc in np.flatnonzero(counts[inverse] > 1)]  # a hash's, then compared whole
        return len(sharing) - len(set(sharing))

    def close(self) -> None:
        if not self._out.closed:
            self._out.close()
        if self._mapped is None and self._offsets[-1]:
            self._mapped = np.memmap(self.path, dtype=np.uint8, mode="r")

    def discard(self) -> None:
        """Close without reporting a failed flush (a full disk fails the close again; the file is removed anyway)."""
        try:
            self._out.close()
        except OSError:
            pass

    def __getitem__(self, doc: int) -> str:
        if self._mapped is None:
            return ""
        return bytes(self._mapped[self._offsets[doc] : self._offsets[doc + 1]]).decode("utf-8", "surrogatepass")

    def __len__(self) -> int:
        return len(self._offsets) - 1


def _texts(
    paths: list[Path], text_key: str, stats: JsonlStats, ids: _DocumentIds, bar: Progress, bad_lines: BadLinesFile
) -> Iterator[str]:
    documents = nbytes = 0
    for path, line, record in located_jsonl(paths, text_key, stats, bad_lines):
        ids.append(document_id(record, path, line))
        text = record[text_key]
        documents += 1
        nbytes += len(text)  # characters: encoding every text only for the MB/s figure would cost more than it tells
        if documents == _PROGRESS_EVERY:
            bar.update(documents, nbytes)
            documents = nbytes = 0
        yield text
    bar.update(documents, nbytes)


def _needed_bytes(input_bytes: int, plan: LshPlan | None) -> int:
    """About what the run takes on disk at its peak: kept and removed documents, plus minhash's staging."""
    return input_bytes + (staging_bytes(plan, input_bytes) if plan is not None else 0)


def deduplicate(
    inputs: Iterable[str | Path],
    output: str | Path,
    method: str = "exact",
    text_key: str = "text",
    threshold: float | None = None,
    num_perm: int = 128,
    *,
    workers: int = 1,
    bucket_memory_mb: float = 256,
    progress: bool = True,
    embedder=None,
) -> dict:
    """Write kept and removed documents and the duplicate clusters to `output`; returns the stats.

    threshold: Jaccard for minhash (default 0.8), cosine for semantic (default 0.9). workers: processes for
    minhash signatures and grouping (torch threads for semantic). bucket_memory_mb: minhash memory for
    grouping one bucket, per worker. embedder: semantic only, a callable(list[str]) -> float array
    (default: the packaged all-MiniLM-L6-v2)."""
    if method not in METHODS:
        raise InputError(f"--method {method} is unknown; use one of {', '.join(METHODS)}")
    if workers < 1:
        raise InputError(f"--workers {workers} must be at least 1")
    paths, output, stats = check_inputs(inputs), Path(output), JsonlStats()
    threshold = DEFAULT_THRESHOLDS.get(method) if threshold is None else threshold
    if method == "semantic" and embedder is None:
        from loom.data_tools.semantic import packaged_embedder

        embedder = packaged_embedder(threads=workers)  # fails here, before any output, without the extra
    if output.exists() and not output.is_dir():
        raise InputError(f"--output {output} is a file; dedup writes a folder")
    start, started = time.perf_counter(), time.time()
    input_bytes = estimated_input_bytes(paths)
    plan = None
    if method == "minhash":
        plan = plan_lsh(threshold, num_perm, input_bytes, workers, int(bucket_memory_mb * (1 << 20)))
    with reported_failures(output, _needed_bytes(input_bytes, plan)):
        for stale in ("stats.json", "manifest.json"):
            (output / stale).unlink(missing_ok=True)
        staging = staging_folder(output)
        ids = _DocumentIds(staging / "ids.bin")
        bad_lines = BadLinesFile(staging / BAD_LINES_NAME)
        moved: list[Path] = []
        try:
            with Progress(f"dedup {method}", progress) as bar:
                texts = _texts(paths, text_key, stats, ids, bar, bad_lines)
                representative, extra = _representatives(method, texts, staging, plan, workers, embedder, threshold)
            ids.close()
            bad_lines.close()
            if len(representative) == 0:
                raise InputError(no_documents(text_key, paths))
            kept = _write_decisions(paths, staging, text_key, representative, ids, progress)
            clusters, largest = _write_clusters(staging / "clusters.jsonl", representative, ids)
            _commit(staging, output, moved)
            documents, seconds = len(representative), time.perf_counter() - start
            result = {
                "method": method,
                **({"threshold": threshold} if method != "exact" else {}),
                **extra,
                "input_documents": documents,
                "kept": kept,
                "removed": documents - kept,
                "clusters": clusters,
                "largest_cluster": largest,
                "repeated_ids": ids.repeated(),
                "seconds": round(seconds, 2),
                "docs_per_s": round(documents / seconds, 1),
                "input": stats.as_dict(),
            }
            with atomic_path(output / "stats.json") as tmp:
                tmp.write_text(json.dumps(result, indent=1))
            write_manifest(
                output,
                command="loom data dedup",
                inputs=paths,
                outputs=[*moved, output / "stats.json"],
                parameters=_parameters(method, text_key, threshold, plan, workers, bucket_memory_mb, embedder),
                counts={k: result[k] for k in ("input_documents", "kept", "removed", "clusters")},
                started=started,
                is_folder=True,
            )
        except BaseException:
            ids.discard()
            bad_lines.close()
            _remove_partial_output(staging, output, moved)
            raise
    return result


def _parameters(
    method: str, text_key: str, threshold: float | None, plan: LshPlan | None, workers: int, bucket_mb: float, embedder
) -> dict:
    """The settings a dedup output's manifest records (what a rerun must repeat to get the same output)."""
    parameters = {"method": method, "text_key": text_key}
    if plan is not None:
        parameters.update(threshold=threshold, workers=workers, bucket_memory_mb=bucket_mb, **_plan_fields(plan))
    elif method == "semantic":
        parameters.update(threshold=threshold, model=getattr(embedder, "name", type(embedder).__name__))
    return parameters


def _remove_partial_output(staging: Path, output: Path, moved: list[Path]) -> None:
    """Nothing of a failed run may stay: files already moved into place would look finished without a manifest."""
    shutil.rmtree(staging, ignore_errors=True)
    for path in [*moved, output / "stats.json"]:
        path.unlink(missing_ok=True)
    for folder in ("removed", "rejected"):
        with suppress(OSError):
            (output / folder).rmdir()  # only if empty


def _plan_fields(plan: LshPlan) -> dict:
    return {"num_perm": plan.num_perm, "bands": plan.bands, "rows": plan.rows, "buckets": plan.buckets}


def _representatives(
    method: str,
    texts: Iterable[str],
    staging: Path,
    plan: LshPlan | None,
    workers: int,
    embedder,
    threshold: float | None,
) -> tuple[np.ndarray, dict]:
    """For every text, the index of the first document it duplicates (its own when kept); and the method's counts."""
    if method == "exact":
        return exact_representatives(texts), {}
    if method == "minhash":
        return cluster_on_disk(texts, staging / "minhash", plan, workers)
    from loom.data_tools.semantic import semantic_representatives

    return semantic_representatives(texts, staging / "semantic", embedder, threshold)


def _write_decisions(
    paths: list[Path], staging: Path, text_key: str, representative: np.ndarray, ids: _DocumentIds, progress: bool
) -> int:
    kept = 0
    records = tqdm(
        iter_jsonl(paths, text_key, JsonlStats()),
        desc="dedup: writing",
        unit="doc",
        total=len(representative),
        mininterval=1.0,
        leave=False,
        disable=not progress,
    )
    with (
        records,  # closed on failure too, so the bar is gone before the error is printed
        open(staging / "kept.jsonl", "w", encoding="utf-8", buffering=1 << 20) as kept_out,
        open(staging / "removed.jsonl", "w", encoding="utf-8", buffering=1 << 20) as removed_out,
    ):
        for doc, record in enumerate(records):
            if record.get("id") is None:
                record["id"] = ids[doc]  # the name clusters.jsonl and duplicate_of give it
            first = int(representative[doc])
            if first == doc:
                kept_out.write(json.dumps(record, ensure_ascii=False) + "\n")
                kept += 1
            else:
                removed_out.write(json.dumps({**record, "duplicate_of": ids[first]}, ensure_ascii=False) + "\n")
    return kept


def _write_clusters(path: Path, representative: np.ndarray, ids: _DocumentIds) -> tuple[int, int]:
    """One line per cluster, ordered by kept document; returns (clusters, largest size)."""
    removed = np.flatnonzero(representative != np.arange(len(representative)))
    removed = removed[np.argsort(representative[removed], kind="stable")]  # by cluster, input order inside
    firsts = representative[removed]
    bounds = np.flatnonzero(np.diff(firsts)) + 1
    clusters, largest = 0, 1
    with open(path, "w", encoding="utf-8", buffering=1 << 20) as out:
        for members in np.split(removed, bounds) if len(removed) else []:
            first = int(representative[members[0]])
            group = {"kept": ids[first], "removed": [ids[int(m)] for m in members], "size": len(members) + 1}
            out.write(json.dumps(group, ensure_ascii=False) + "\n")
            clusters, largest = clusters + 1, max(largest, len(members) + 1)
    return clusters, largest


def _commit(staging: Path, output: Path, moved: list[Path]) -> None:
    """Move the finished files from staging into the output folder, appending each final path to `moved`
    as it lands (so a failure part way removes exactly those)."""
    (output / "removed").mkdir(parents=True, exist_ok=True)
    moves = {
        "kept.jsonl": output / "kept.jsonl",
        "removed.jsonl": output / "removed" / "removed.jsonl",
        "clusters.jsonl": output / "clusters.jsonl",
    }
    for name, target in moves.items():
        os.replace(staging / name, target)
        moved.append(target)
    bad_lines = output / "rejected" / BAD_LINES_NAME
    bad_lines.unlink(missing_ok=True)  # a previous run's
    if (staging / BAD_LINES_NAME).exists():
        bad_lines.parent.mkdir(exist_ok=True)
        os.replace(staging / BAD_LINES_NAME, bad_lines)
        moved.append(bad_lines)
    shutil.rmtree(staging)

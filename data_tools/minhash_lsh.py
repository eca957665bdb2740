"""MinHash + LSH clustering that keeps its working set on disk.

Memory is flat in corpus size apart from 8-16 bytes per document.

Three stages over a staging folder (dedup.py owns it and deletes it):

1. signatures: the parent streams texts in chunks to workers (data_tools/parallel.py); a worker
   computes the chunk's MinHash signatures, writes them into its rows of `signatures.u32` (a
   [documents, num_perm] uint32 file that the parent grows before handing out each chunk) and
   appends one (band key, document) entry per band to `buckets/<bucket>-<pid>.bin`. The bucket is
   chosen from the key's high 32 bits, so every document sharing a band key lands in the same bucket.
2. grouping: a worker loads one bucket (all workers' files of it), sorts it by key, and pairs every
   document with the first document of its key run (as datasketch's LSH query would); a bucket
   larger than the memory budget is read in several passes, each keeping one slice of the key space.
3. verification: the worker reads the signature rows of its candidate pairs from the memory-mapped
   file, drops pairs whose estimated Jaccard is far below the threshold (ESTIMATE_MARGIN, over four
   standard deviations of the estimate), and keeps those whose *exact* Jaccard reaches it, computed from
   the documents' hashed shingle sets that stage 1 wrote (`shingles/`, sorted per document): the
   estimate's own noise (±0.035 at J = 0.8 with 128 permutations) would otherwise cap recall near the
   threshold. The banding aims at recall (minhash.recall_bands: a pair at the threshold becomes a
   candidate with probability 0.99). The parent joins verified pairs in a union-find array
   (data_tools/union_find.py), so each cluster's root is its first document.

The stats' pair counts are summed over buckets: a pair whose band keys fall in two buckets counts in each
(holding every verified pair to count it once would cost memory that grows with the corpus).

Peak memory: one chunk per worker, one bucket slice per worker (`bucket_memory_bytes`), and the
union-find array. This module must not read JSONL nor write dedup outputs.
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loom.data_tools.jsonl import InputError
from loom.data_tools.minhash import (
    band_keys,
    jaccard,
    permutations,
    recall_bands,
    s_curve,
    shingle_hashes,
    signatures,
)
from loom.data_tools.parallel import chunked, imap_ordered
from loom.data_tools.union_find import UnionFind

ENTRY = np.dtype([("key", "<u8"), ("doc", "<u4")])
# What grouping holds per entry: the entry (12), lexsort's order (8), sorted keys and documents
# (8 + 8), run starts and pair arrays (~12): the budget is divided by this to get entries per pass.
GROUPED_BYTES_PER_ENTRY = 48
MAX_DOCUMENTS = (1 << 32) - 1  # documents are uint32 in bucket entries
MAX_BUCKETS = 1024
CHUNK_DOCUMENTS = 512
CHUNK_CHARACTERS = 4 << 20
VERIFY_PAIRS = 16384  # signature rows read per verification step: 2 x 16384 x 512 B = 16 MB at 128 permutations
# Bucket count is planned before the input is read, from its size; a low guess only costs extra
# passes over a bucket, never memory. Web documents average 2-5 KB, so 1 KB overestimates the count.
ASSUMED_BYTES_PER_DOCUMENT = 1024
SIGNATURES_NAME = "signatures.u32"
BUCKETS_DIR = "buckets"
SHINGLES_DIR = "shingles"  # per chunk: <first document>.u64 (sorted hashes back to back) and .off (offsets)
ESTIMATE_MARGIN = 0.15
"""Candidates whose signature estimate is more than this below the threshold skip the exact check."""


@dataclass(frozen=True)
class LshPlan:
    """Everything a worker needs to know about the run (pickled to spawn workers)."""

    threshold: float
    num_perm: int
    bands: int
    rows: int
    buckets: int
    bucket_entries: int  # entries grouped at once per worker: the memory budget in entries


def plan_lsh(threshold: float, num_perm: int, input_bytes: int, workers: int, bucket_memory_bytes: int) -> LshPlan:
    """Bands x rows from the threshold; bucket count so that one bucket of the expected input fits the budget."""
    if not 0.0 < threshold <= 1.0:
        raise InputError(f"--threshold {threshold} must be in (0, 1] for minhash (a Jaccard similarity)")
    if num_perm < 2:
        raise InputError(f"--num-perm {num_perm} must be at least 2")
    bands, rows = recall_bands(threshold, num_perm)
    bucket_entries = max(64, bucket_memory_bytes // GROUPED_BYTES_PER_ENTRY)
    expected_entries = input_bytes // ASSUMED_BYTES_PER_DOCUMENT * bands
    return LshPlan(
        threshold, num_perm, bands, rows, bucket_count(expected_entries, bucket_entries, workers), bucket_entries
    )


def staging_bytes(plan: LshPlan, input_bytes: int) -> int:
    """Disk the stages take for an input of that size: a signature row and one bucket entry per band per document."""
    documents = input_bytes // ASSUMED_BYTES_PER_DOCUMENT
    # Shingle hashes: 8 bytes per word, and a word with its space is rarely under 4 bytes of input.
    return documents * (plan.num_perm * 4 + plan.bands * ENTRY.itemsize) + 2 * input_bytes


def bucket_count(expected_entries: int, bucket_entries: int, workers: int) -> int:
    """Enough buckets for each to fit `bucket_entries`, and 4 per worker so grouping balances; at most MAX_BUCKETS."""
    return int(min(MAX_BUCKETS, max(4 * max(workers, 1), math.ceil(expected_entries / bucket_entries))))


def grouping_passes(entries: int, bucket_entries: int) -> int:
    """Passes over a bucket of `entries` so that each pass holds at most `bucket_entries` (plus hash imbalance)."""
    return max(1, math.ceil(entries / bucket_entries))


def _bucket_files(staging: Path, bucket: int) -> list[Path]:
    return sorted((staging / BUCKETS_DIR).glob(f"{bucket:05d}-*.bin"))


def sign_chunk(texts: list[str], first_doc: int, staging: str, plan: LshPlan) -> int:
    """Stage 1 in a worker: signatures into their rows of the signature file, band keys appended to the buckets."""
    staging = Path(staging)
    a, b = permutations(plan.num_perm)
    hashed = shingle_hashes(texts)
    rows = signatures(texts, a, b, hashed=hashed)
    shingles = staging / SHINGLES_DIR / f"{first_doc:010d}"
    with open(shingles.with_suffix(".u64"), "wb") as out:
        out.write(hashed[0].tobytes())
    with open(shingles.with_suffix(".off"), "wb") as out:
        out.write(np.concatenate([[0], np.cumsum(hashed[1])]).astype(np.int64).tobytes())
    # A plain write, not a memory map: the parent grows the file without allocating blocks, and a store
    # through a map into a block the full disk cannot provide kills the process with SIGBUS instead of ENOSPC.
    with open(staging / SIGNATURES_NAME, "r+b") as out:
        out.seek(first_doc * plan.num_perm * 4)
        out.write(np.ascontiguousarray(rows, dtype=np.uint32).tobytes())
    keys = band_keys(rows, plan.bands, plan.rows).ravel()
    entries = np.empty(len(keys), dtype=ENTRY)
    entries["key"] = keys
    entries["doc"] = np.repeat(np.arange(first_doc, first_doc + len(texts), dtype=np.uint32), plan.bands)
    bucket = (keys >> np.uint64(32)) % np.uint64(plan.buckets)
    order = np.argsort(bucket, kind="stable")
    entries, bounds = entries[order], np.searchsorted(bucket[order], np.arange(plan.buckets + 1))
    pid = os.getpid()
    for index in np.flatnonzero(np.diff(bounds)):
        # One append per bucket and chunk; files are per process, so writers never interleave.
        with open(staging / BUCKETS_DIR / f"{index:05d}-{pid}.bin", "ab") as out:
            out.write(entries[bounds[index] : bounds[index + 1]].tobytes())
    return len(texts)


def _load_bucket(files: list[Path], part: int, passes: int, bucket_entries: int) -> np.ndarray:
    """The bucket's entries whose key falls in slice `part` of `passes` (all of them when passes == 1)."""
    if passes == 1:
        sizes = [f.stat().st_size // ENTRY.itemsize for f in files]
        entries, position = np.empty(sum(sizes), dtype=ENTRY), 0
        for path, size in zip(files, sizes):
            with open(path, "rb") as stream:
                stream.readinto(entries[position : position + size].view(np.uint8))
            position += size
        return entries
    kept = []
    step = max(1, bucket_entries // 4)
    for path in files:
        mapped = np.memmap(path, dtype=ENTRY, mode="r")
        for start in range(0, len(mapped), step):
            block = np.array(mapped[start : start + step])
            kept.append(block[(block["key"] & np.uint64(0xFFFFFFFF)) % np.uint64(passes) == part])
        del mapped
    return np.concatenate(kept) if kept else np.empty(0, dtype=ENTRY)


def candidate_pairs(entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, other) for every document sharing a key with an earlier one: `first` is the key's first document."""
    if len(entries) < 2:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.lexsort((entries["doc"], entries["key"]))
    keys, docs = entries["key"][order], entries["doc"][order].astype(np.int64)
    run_start = np.empty(len(keys), dtype=bool)
    run_start[0] = True
    np.not_equal(keys[1:], keys[:-1], out=run_start[1:])
    first = docs[np.maximum.accumulate(np.where(run_start, np.arange(len(keys)), 0))]
    paired = ~run_start & (first != docs)
    # The same pair can share keys in several bands of one bucket: verify it once.
    packed = np.unique((first[paired].astype(np.uint64) << np.uint64(32)) | docs[paired].astype(np.uint64))
    return (packed >> np.uint64(32)).astype(np.int64), (packed & np.uint64(0xFFFFFFFF)).astype(np.int64)


class ShingleSets:
    """The sorted shingle hashes of any document, read from the chunk files stage 1 wrote (memory-mapped)."""

    def __init__(self, staging: Path):
        self.folder = staging / SHINGLES_DIR
        self.firsts = sorted(int(p.stem) for p in self.folder.glob("*.off"))
        self._open: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getitem__(self, document: int) -> np.ndarray:
        first = self.firsts[bisect.bisect_right(self.firsts, document) - 1]
        if first not in self._open:
            stem = self.folder / f"{first:010d}"
            offsets = np.fromfile(stem.with_suffix(".off"), dtype=np.int64)
            hashes = np.memmap(stem.with_suffix(".u64"), dtype=np.uint64, mode="r") if offsets[-1] else np.empty(0)
            self._open[first] = hashes, offsets
        hashes, offsets = self._open[first]
        return np.asarray(hashes[offsets[document - first] : offsets[document - first + 1]])


def verify(
    first: np.ndarray, other: np.ndarray, signatures_of: np.ndarray, sets: ShingleSets, threshold: float
) -> tuple[np.ndarray, int]:
    """Which candidate pairs reach the threshold by the exact Jaccard of their shingle sets; and how many were
    checked exactly (the others' signature estimate lies more than ESTIMATE_MARGIN below the threshold)."""
    estimate = (signatures_of[first] == signatures_of[other]).mean(axis=1)
    same = estimate >= threshold - ESTIMATE_MARGIN
    checked = np.flatnonzero(same)
    same[checked] = [jaccard(sets[int(a)], sets[int(b)]) >= threshold for a, b in zip(first[checked], other[checked])]
    return same, len(checked)


def group_bucket(bucket: int, staging: str, plan: LshPlan, documents: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Stages 2 and 3 in a worker: verified duplicate pairs (first, other) of one bucket, and counts."""
    staging = Path(staging)
    files = _bucket_files(staging, bucket)
    entries_total = sum(f.stat().st_size for f in files) // ENTRY.itemsize
    passes = grouping_passes(entries_total, plan.bucket_entries)
    stored = np.memmap(staging / SIGNATURES_NAME, dtype=np.uint32, mode="r", shape=(documents, plan.num_perm))
    sets = ShingleSets(staging)
    firsts, others, candidates, largest, exact = [], [], 0, 0, 0
    for part in range(passes):
        entries = _load_bucket(files, part, passes, plan.bucket_entries)
        largest = max(largest, len(entries))
        first, other = candidate_pairs(entries)
        del entries
        candidates += len(first)
        for start in range(0, len(first), VERIFY_PAIRS):
            batch_first, batch_other = first[start : start + VERIFY_PAIRS], other[start : start + VERIFY_PAIRS]
            same, checked = verify(batch_first, batch_other, stored, sets, plan.threshold)
            exact += checked
            firsts.append(batch_first[same])
            others.append(batch_other[same])
    del stored
    counts = {
        "entries": entries_total,
        "passes": passes,
        "largest_pass_entries": largest,
        "candidates": candidates,
        "exact_checks": exact,
    }
    if not firsts:
        return np.empty(0, np.int64), np.empty(0, np.int64), counts
    return np.concatenate(firsts), np.concatenate(others), counts


def _signing_tasks(texts: Iterable[str], staging: Path, plan: LshPlan, counter: list[int]) -> Iterator[tuple]:
    """Chunks as sign_chunk tasks; grows the signature file to hold each chunk's rows before handing it out."""
    row_bytes = plan.num_perm * 4
    path = staging / SIGNATURES_NAME
    for chunk in chunked(texts, CHUNK_DOCUMENTS, CHUNK_CHARACTERS):
        first = counter[0]
        if first + len(chunk) > MAX_DOCUMENTS:
            raise InputError(f"more than {MAX_DOCUMENTS:,} documents in one minhash run; split the input")
        os.truncate(path, (first + len(chunk)) * row_bytes)
        counter[0] += len(chunk)
        yield chunk, first, str(staging), plan


def cluster_on_disk(
    texts: Iterable[str], staging: Path, plan: LshPlan, workers: int = 1, on_bucket=None
) -> tuple[np.ndarray, dict]:
    """For every document of `texts`, the index of the first document of its near-duplicate cluster; and counts.

    `staging` must be an empty folder the caller removes afterwards; on_bucket(counts) is called per bucket."""
    staging = Path(staging)
    (staging / BUCKETS_DIR).mkdir(parents=True)
    (staging / SHINGLES_DIR).mkdir()
    (staging / SIGNATURES_NAME).touch()
    counter, start = [0], time.perf_counter()
    with closing(imap_ordered(sign_chunk, _signing_tasks(texts, staging, plan, counter), workers)) as signed_chunks:
        for _ in signed_chunks:
            pass
    documents, signed = counter[0], time.perf_counter()
    found = UnionFind(documents)
    totals = {
        "candidate_pairs": 0,
        "exact_jaccard_checks": 0,
        "verified_pairs": 0,
        "largest_bucket_entries": 0,
        "largest_pass_entries": 0,
        "most_passes": 0,
    }
    if documents:
        tasks = ((bucket, str(staging), plan, documents) for bucket in range(plan.buckets))
        with closing(imap_ordered(group_bucket, tasks, workers)) as grouped:
            for first, other, counts in grouped:
                found.union(first, other)
                totals["candidate_pairs"] += counts["candidates"]
                totals["exact_jaccard_checks"] += counts["exact_checks"]
                totals["verified_pairs"] += len(first)
                totals["largest_bucket_entries"] = max(totals["largest_bucket_entries"], counts["entries"])
                totals["most_passes"] = max(totals["most_passes"], counts["passes"])
                totals["largest_pass_entries"] = max(totals["largest_pass_entries"], counts["largest_pass_entries"])
                if on_bucket is not None:
                    on_bucket(counts)
    stats = {
        **asdict(plan),
        "candidate_probability_by_jaccard": s_curve(plan.bands, plan.rows),
        "verification": f"exact Jaccard of hashed shingle sets (signature estimate >= threshold - {ESTIMATE_MARGIN})",
        "pair_counts": "summed over buckets: a pair whose band keys fall in two buckets counts in each",
        **totals,
        "workers": workers,
        "signature_seconds": round(signed - start, 2),
        "grouping_seconds": round(time.perf_counter() - signed, 2),
    }
    return found.representatives(), stats

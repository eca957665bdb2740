"""Near-duplicate detection: MinHash signatures over word 5-gram shingles, LSH banding, union-find.

Signatures are datasketch-compatible (datasketch 2's default "affine32" scheme: 32-bit SHA-1 of
each shingle, MurmurHash3's finalizer, then seeded odd-multiplier affine maps mod 2^32, so
`datasketch.MinHash(num_perm, seed)` gives the same values), but each document's signature is one
vectorised numpy step over all its shingles instead of one Python call per shingle. Bands x rows are chosen from the threshold the way datasketch does
(minimising the weighted false-positive and false-negative areas); candidate pairs from a shared
band are verified by their estimated Jaccard before they are joined, and every cluster keeps its
first document. In memory for now: band keys are not yet spilled to disk, and one process works.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np


def permutations(num_perm: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's affine32 parameters: odd multipliers a and offsets b, uint32."""
    generator = np.random.RandomState(seed)
    a = generator.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = generator.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (wrapping uint32 arithmetic)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def shingles(text: str, n: int = 5) -> set[str]:
    words = text.lower().split()
    if len(words) < n:
        return {" ".join(words)}
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def signature(text: str, a: np.ndarray, b: np.ndarray, n: int = 5) -> np.ndarray:
    """MinHash signature (uint32) of a document's word n-gram shingles."""
    digests = b"".join(hashlib.sha1(s.encode("utf-8")).digest()[:4] for s in shingles(text, n))
    hashes = _fmix32(np.frombuffer(digests, dtype="<u4").astype(np.uint32))
    return (np.outer(hashes, a) + b).min(axis=0)


def _candidate_probability(s: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Probability that a pair of Jaccard s shares at least one band: 1 - (1 - s^r)^b."""
    return 1 - (1 - s ** rows) ** bands


def optimal_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising false-positive + false-negative probability areas (as datasketch)."""
    best, best_error = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            below, above = np.linspace(0.0, threshold, 200), np.linspace(threshold, 1.0, 200)
            false_positive = np.trapezoid(_candidate_probability(below, bands, rows), below)
            false_negative = np.trapezoid(1 - _candidate_probability(above, bands, rows), above)
            error = 0.5 * false_positive + 0.5 * false_negative
            if error < best_error:
                best, best_error = (bands, rows), error
    return best


class _UnionFind:
    def __init__(self, size: int):
        self.parent = list(range(size))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, x: int, y: int) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            self.parent[max(rx, ry)] = min(rx, ry)  # the earliest document stays the root


def cluster(signatures: np.ndarray, threshold: float, bands: int, rows: int) -> list[int]:
    """For each document, the index of the document it duplicates (itself if it is kept)."""
    found = _UnionFind(len(signatures))
    for band in range(bands):
        buckets: dict[bytes, list[int]] = defaultdict(list)
        chunk = np.ascontiguousarray(signatures[:, band * rows:(band + 1) * rows])
        for doc, key in enumerate(chunk):
            buckets[key.tobytes()].append(doc)
        for members in buckets.values():
            first = members[0]
            for other in members[1:]:
                if np.mean(signatures[first] == signatures[other]) >= threshold:
                    found.union(first, other)
    return [found.find(i) for i in range(len(signatures))]

"""MinHash signatures over word 5-gram shingles and LSH band keys: the arithmetic of near-duplicate dedup.

Signatures are datasketch-compatible (datasketch 2's default "affine32" scheme: 32-bit SHA-1 of
each shingle, MurmurHash3's finalizer, then seeded odd-multiplier affine maps mod 2^32, so
`datasketch.MinHash(num_perm, seed)` gives the same values), but a whole chunk of documents is one
vectorised numpy step over all its shingles instead of one Python call per shingle. Bands x rows
are chosen from the threshold the way datasketch does (minimising the weighted false-positive and
false-negative areas). A band's rows become one 64-bit key, so documents sharing a band share a
key. This module must not read or write files; minhash_lsh.py runs the stages on disk.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

# Shingles turned into one (shingles x num_perm) matrix at a time: 512 KB at 128 permutations, so the
# multiply-add-min stays in cache (measured ~25% faster end to end than 16 MB blocks).
_SHINGLES_PER_BLOCK = 1024
_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@lru_cache(maxsize=8)
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
    """The distinct word n-grams of the lower-cased text (the whole text when it has fewer than n words)."""
    words = text.lower().split()
    if len(words) < n:
        return {" ".join(words)}
    return set(map(" ".join, zip(*(words[i:] for i in range(n)))))


def _shingle_hashes(text: str, n: int) -> bytes:
    sha1 = hashlib.sha1
    return b"".join([sha1(s).digest()[:4] for s in map(str.encode, shingles(text, n))])


def signature(text: str, a: np.ndarray, b: np.ndarray, n: int = 5) -> np.ndarray:
    """MinHash signature (uint32) of one document's word n-gram shingles."""
    return signatures([text], a, b, n)[0]


def shingle_hashes(texts: list[str], n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(32-bit SHA-1 of every distinct shingle of every text, back to back, uint32; shingles per text)."""
    digests = [_shingle_hashes(text, n) for text in texts]
    counts = np.fromiter((len(d) // 4 for d in digests), dtype=np.int64, count=len(digests))
    return np.frombuffer(b"".join(digests), dtype="<u4").astype(np.uint32), counts


def sorted_per_text(hashes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`hashes` sorted within each text's segment (what exact Jaccard by merging needs)."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return hashes[np.lexsort((hashes, owner))]


def jaccard(first: np.ndarray, second: np.ndarray) -> float:
    """Exact Jaccard similarity of two sets of distinct shingle hashes."""
    shared = len(np.intersect1d(first, second, assume_unique=True))
    return shared / (len(first) + len(second) - shared) if (len(first) or len(second)) else 1.0


def signatures(
    texts: list[str], a: np.ndarray, b: np.ndarray, n: int = 5, hashed: tuple[np.ndarray, np.ndarray] | None = None
) -> np.ndarray:
    """MinHash signatures (documents x len(a), uint32) of many documents in few numpy steps (`hashed`: their
    shingle_hashes, when the caller has them)."""
    raw, counts = hashed if hashed is not None else shingle_hashes(texts, n)
    hashes = _fmix32(raw)
    ends = np.cumsum(counts)
    out = np.empty((len(texts), len(a)), dtype=np.uint32)
    first = 0
    while first < len(texts):
        # Whole documents per block, at least one: every document has >= 1 shingle, so no segment is empty.
        last = max(
            first + 1, int(np.searchsorted(ends, ends[first] - counts[first] + _SHINGLES_PER_BLOCK, side="right"))
        )
        start = ends[first] - counts[first]
        block = hashes[start : ends[last - 1]]
        values = block[:, None] * a + b  # uint32: wraps mod 2^32 like datasketch
        out[first:last] = np.minimum.reduceat(values, ends[first:last] - counts[first:last] - start, axis=0)
        first = last
    return out


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: every input bit reaches every output bit (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX_1
    x = (x ^ (x >> np.uint64(27))) * _MIX_2
    return x ^ (x >> np.uint64(31))


def band_keys(signature_rows: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(documents x bands) uint64: one key per band from its `rows` values; the band number is mixed in,
    so equal rows in different bands give different keys."""
    count = len(signature_rows)
    banded = signature_rows[:, : bands * rows].reshape(count, bands, rows).astype(np.uint64)
    with np.errstate(over="ignore"):
        keys = np.broadcast_to(_mix64(np.arange(1, bands + 1, dtype=np.uint64)), (count, bands)).copy()
        for row in range(rows):
            keys = _mix64(keys ^ banded[:, :, row])
    return keys


def _candidate_probability(s: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Probability that a pair of Jaccard s shares at least one band: 1 - (1 - s^r)^b."""
    return 1 - (1 - s**rows) ** bands


S_CURVE_POINTS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def s_curve(bands: int, rows: int) -> dict[str, float]:
    """The probability that a pair becomes a candidate, at a few Jaccard similarities (for stats.json)."""
    values = _candidate_probability(np.array(S_CURVE_POINTS), bands, rows)
    return {f"{s:.2f}": round(float(p), 4) for s, p in zip(S_CURVE_POINTS, values, strict=True)}


CANDIDATE_RECALL = 0.99
"""The probability a pair at the threshold must have of becoming a candidate."""


@lru_cache(maxsize=32)
def recall_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) that make a pair at the threshold a candidate with probability >= CANDIDATE_RECALL: the
    optimal banding (below) of the highest threshold, in steps of 0.05 below the real one, that reaches it.
    Candidates are then verified exactly, so the extra ones below the threshold cost time, not precision."""
    aimed = threshold
    while aimed > 0.05:
        bands, rows = optimal_bands(round(aimed, 2), num_perm)
        if _candidate_probability(np.array(threshold), bands, rows) >= CANDIDATE_RECALL:
            return bands, rows
        aimed -= 0.05
    return num_perm, 1


@lru_cache(maxsize=32)
def optimal_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising false-positive + false-negative probability areas (as datasketch)."""
    best, best_error = (1, num_perm), float("inf")
    below, above = np.linspace(0.0, threshold, 200), np.linspace(threshold, 1.0, 200)
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            false_positive = np.trapezoid(_candidate_probability(below, bands, rows), below)
            false_negative = np.trapezoid(1 - _candidate_probability(above, bands, rows), above)
            error = 0.5 * false_positive + 0.5 * false_negative
            if error < best_error:
                best, best_error = (bands, rows), error
    return best


def similar(first: np.ndarray, second: np.ndarray, threshold: float) -> np.ndarray:
    """Per row pair: is the estimated Jaccard (share of equal signature values) >= threshold?"""
    return (first == second).mean(axis=1) >= threshold

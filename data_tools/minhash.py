"""MinHash signatures over hashed word 5-gram shingles and LSH band keys: the arithmetic of near-duplicate dedup.

Words are whitespace-separated, except in scripts written without spaces (Chinese, Japanese, Thai, ...), where
each character is a word: their shingles are character 5-grams.

A chunk of documents is hashed in a few numpy steps, with no Python call per shingle nor per
permutation: the documents' lower-cased words are joined by single spaces into one UTF-8 buffer, a
shingle (n consecutive words) is the byte span from its first word's start to its last word's end,
and its 64-bit hash is a polynomial over those bytes (mod 2^64, odd base) read from prefix sums,
finished by SplitMix64's mixer with the span length. The permutations follow datasketch 2's default
"affine32" scheme on the hash's high 32 bits (MurmurHash3's finalizer, then seeded odd-multiplier
affine maps mod 2^32), so `datasketch.MinHash(num_perm, seed=1, hashfunc=<that 32-bit hash>)` gives
the same values. A band's rows become one 64-bit key, so documents sharing a band share a key. This
module must not read or write files; minhash_lsh.py runs the stages on disk.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache

import numpy as np

# Shingles turned into one (num_perm x shingles) matrix at a time: 2 MB at 128 permutations, reused, so the
# multiply-add-min stays in cache (measured 9-16 ms per 150k shingles, against 35 ms for 1,024 and 29 ms for 65,536).
_SHINGLES_PER_BLOCK = 4096
_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
SHINGLE_HASH_BASE = 0x100000001B3  # odd, so its powers are invertible mod 2^64
_BASE_INVERSE = pow(SHINGLE_HASH_BASE, -1, 1 << 64)
_SPACE, _DOCUMENT_END = 0x20, 0x0A
_HASH_CHARACTERS = 1 << 20
_WHITESPACE_RUN, _WORD = re.compile(r"\s+"), re.compile(r"\S+")  # str.split()'s words: \s is str.isspace()


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


# Scripts written without spaces between words (Han, kana, Thai, Lao, Khmer, Myanmar, Tibetan; CJK punctuation): each
# character is a word of its own, else a Chinese page was one or two "words", a single shingle that any edit changed
# (near-duplicates of Chinese, Japanese and Thai were never found: word 5-gram Jaccard 0.0, character 5-grams 0.94).
_UNSPACED = re.compile(
    "[\u0e00-\u0eff\u0f00-\u0fff\u1000-\u109f\u1780-\u17ff\u3000-\u30ff\u31f0-\u31ff\u3400-\u4dbf"
    "\u4e00-\u9fff\uf900-\ufaff\uff61-\uff9f\U00020000-\U0003134f]"
)


def spaced(text: str) -> str:
    """The text with a space on each side of every character of a script written without spaces, so that its
    whitespace-separated words are the words shingles are made of."""
    return text if text.isascii() else _UNSPACED.sub(r" \g<0> ", text)


def shingles(text: str, n: int = 5) -> set[str]:
    """The distinct word n-grams of the lower-cased text (the whole text when it has fewer than n words); a
    character of a script written without spaces is a word."""
    words = spaced(text).lower().split()
    if len(words) < n:
        return {" ".join(words)}
    return set(map(" ".join, zip(*(words[i:] for i in range(n)))))


def signature(text: str, a: np.ndarray, b: np.ndarray, n: int = 5) -> np.ndarray:
    """MinHash signature (uint32) of one document's word n-gram shingles."""
    return signatures([text], a, b, n)[0]


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: every input bit reaches every output bit (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX_1
    x = (x ^ (x >> np.uint64(27))) * _MIX_2
    return x ^ (x >> np.uint64(31))


_power_tables: dict[int, np.ndarray] = {}


def _powers(base: int, count: int) -> np.ndarray:
    """base^0 .. base^(count-1) mod 2^64, read from a table kept per process and grown with a quarter of headroom:
    the cumulative product is sequential, and computing it for every group was a third of the hashing time. A
    group made large by one huge document gets its own table, not kept."""
    table = _power_tables.get(base)
    if table is None or len(table) < count:
        table = np.full(count + count // 4, base, dtype=np.uint64)
        table[0] = 1
        with np.errstate(over="ignore"):
            np.cumprod(table, out=table)
        table.flags.writeable = False
        if count <= 4 * _HASH_CHARACTERS:
            _power_tables[base] = table
    return table[:count]


def shingle_hashes(texts: list[str], n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, counts): every document's distinct shingle hashes (uint64, sorted), back to back, and how many
    each has (at least one: a text of fewer than n words is one shingle). The hash of a shingle's UTF-8 bytes
    c_0..c_k-1 is mix64((sum c_j * SHINGLE_HASH_BASE^j mod 2^64) ^ k)."""
    batches = list(_hashed_batches(texts, n))
    if not batches:
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64)
    return np.concatenate([hashes for hashes, _ in batches]), np.concatenate([counts for _, counts in batches])


def _hashed_batches(texts: list[str], n: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """shingle_hashes of consecutive groups of `texts`, in order. The byte-wise arrays take ~40 bytes per input
    byte: a group holds at most _HASH_CHARACTERS of text, and a longer text is hashed alone, in overlapping pieces
    (one 62 MB document took 2 GB)."""
    group, characters = [], 0
    for text in map(spaced, texts):
        if len(text) > _HASH_CHARACTERS and len(pieces := _overlapping_pieces(text, n)) > 1:
            if group:
                yield _group_shingle_hashes(group, n)
                group, characters = [], 0
            union = np.unique(np.concatenate([_group_shingle_hashes([piece], n)[0] for piece in pieces]))
            yield union, np.array([len(union)], dtype=np.int64)
            continue
        group.append(text)
        characters += len(text)
        if characters >= _HASH_CHARACTERS:
            yield _group_shingle_hashes(group, n)
            group, characters = [], 0
    if group:
        yield _group_shingle_hashes(group, n)


def _overlapping_pieces(text: str, n: int) -> list[str]:
    """`text` cut into pieces of about _HASH_CHARACTERS whose shingles together are the text's: a cut falls where
    whitespace is followed by a word, and the next piece starts n - 1 words before it, so every n consecutive words
    lie whole in one piece, and every piece has at least n words (none becomes a short text's single shingle)."""
    pieces, start, position = [], 0, _HASH_CHARACTERS
    while position < len(text):
        gap = _WHITESPACE_RUN.search(text, position)
        if gap is None or gap.end() == len(text):
            break
        overlap_start = _start_of_last_words(text, start, gap.start(), n - 1)
        if overlap_start is None or not _has_words(text, start, overlap_start):  # fewer than n words so far
            position = gap.end()
            continue
        pieces.append(text[start : gap.start()])
        start = overlap_start
        position = max(gap.end(), start + _HASH_CHARACTERS)
    pieces.append(text[start:])
    return pieces


def _start_of_last_words(text: str, start: int, end: int, count: int) -> int | None:
    """Where the last `count` words of text[start:end] (which ends in a word) begin; None when it has fewer."""
    if count == 0:
        return end
    window = 64
    while True:
        first = max(start, end - window)
        words = [m.start() for m in _WORD.finditer(text, first, end)]
        if len(words) > count or (first == start and len(words) >= count):  # the window's first word may be cut
            return words[-count]
        if first == start:
            return None
        window *= 4


def _has_words(text: str, start: int, end: int) -> bool:
    return _WORD.search(text, start, end) is not None


def _group_shingle_hashes(texts: list[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    joined = "\n".join(" ".join(text.lower().split()) for text in texts).encode("utf-8", "surrogatepass")
    data = np.frombuffer(joined, dtype=np.uint8)
    size = len(data)
    with np.errstate(over="ignore"):
        powers = _powers(SHINGLE_HASH_BASE, size + 1)
        prefix = np.zeros(size + 1, dtype=np.uint64)
        np.cumsum(data * powers[:-1], out=prefix[1:])
        separators = np.flatnonzero((data == _SPACE) | (data == _DOCUMENT_END))
        starts = np.concatenate(([0], separators + 1))
        ends = np.concatenate((separators, [size]))
        # Word i belongs to document doc[i]; an empty text is one empty word, so every document has a word.
        doc = np.concatenate(([0], np.cumsum(data[separators] == _DOCUMENT_END)))
        words = np.bincount(doc, minlength=len(texts))
        first_word = np.cumsum(words) - words
        full = np.flatnonzero(doc[: max(len(doc) - n + 1, 0)] == doc[n - 1 :])  # n-gram starts inside one document
        short = np.flatnonzero(words < n)
        span_start = np.concatenate((starts[full], starts[first_word[short]]))
        span_end = np.concatenate((ends[full + n - 1], ends[first_word[short] + words[short] - 1]))
        span_doc = np.concatenate((doc[full], short))
        inverse = _powers(_BASE_INVERSE, size + 1)
        hashes = (prefix[span_end] - prefix[span_start]) * inverse[span_start]
        hashes = _mix64(hashes ^ (span_end - span_start).astype(np.uint64))
    # Sorted by hash, then stably by document: two argsorts (SIMD, then radix on 16 bits) are ~7x lexsort.
    order = np.argsort(hashes)
    order = order[np.argsort(span_doc[order].astype(np.uint16 if len(texts) <= 1 << 16 else np.int64), kind="stable")]
    hashes, span_doc = hashes[order], span_doc[order]
    distinct = np.ones(len(hashes), dtype=bool)
    distinct[1:] = (hashes[1:] != hashes[:-1]) | (span_doc[1:] != span_doc[:-1])
    return hashes[distinct], np.bincount(span_doc[distinct], minlength=len(texts))


def hash32(hashes: np.ndarray) -> np.ndarray:
    """The 32 bits of a shingle hash that the permutations see (datasketch's hashfunc output)."""
    return (hashes >> np.uint64(32)).astype(np.uint32)


def jaccard(first: np.ndarray, second: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted arrays of distinct shingle hashes."""
    if len(first) < len(second):
        first, second = second, first
    if not len(second):
        return 1.0 if not len(first) else 0.0
    places = np.minimum(np.searchsorted(first, second), len(first) - 1)
    shared = int(np.count_nonzero(first[places] == second))
    return shared / (len(first) + len(second) - shared)


def signatures(
    texts: list[str], a: np.ndarray, b: np.ndarray, n: int = 5, hashed: tuple[np.ndarray, np.ndarray] | None = None
) -> np.ndarray:
    """MinHash signatures (documents x len(a), uint32) of many documents in few numpy steps (`hashed`: their
    shingle_hashes, when the caller has them)."""
    raw, counts = hashed if hashed is not None else shingle_hashes(texts, n)
    hashes = _fmix32(hash32(raw))
    ends = np.cumsum(counts)
    out = np.empty((len(a), len(texts)), dtype=np.uint32)
    scratch = np.empty((len(a), _SHINGLES_PER_BLOCK), dtype=np.uint32)
    first = 0
    while first < len(texts):
        start = ends[first] - counts[first]
        if counts[first] > _SHINGLES_PER_BLOCK:  # one long document: its blocks' minima, one block at a time
            out[:, first] = np.iinfo(np.uint32).max
            for block_start in range(start, ends[first], _SHINGLES_PER_BLOCK):
                block = hashes[block_start : min(block_start + _SHINGLES_PER_BLOCK, ends[first])]
                values = _permuted(a, b, block, scratch)
                np.minimum(out[:, first], values.min(axis=1), out=out[:, first])
            first += 1
            continue
        # Whole documents per block: every document has >= 1 shingle, so no segment is empty.
        last = int(np.searchsorted(ends, start + _SHINGLES_PER_BLOCK, side="right"))
        values = _permuted(a, b, hashes[start : ends[last - 1]], scratch)
        out[:, first:last] = np.minimum.reduceat(values, ends[first:last] - counts[first:last] - start, axis=1)
        first = last
    return out.T


def _permuted(a: np.ndarray, b: np.ndarray, block: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """(a * block + b) mod 2^32 for every permutation (rows) and shingle (columns), written into `scratch`."""
    values = scratch[:, : len(block)]
    np.multiply.outer(a, block, out=values)  # uint32: wraps mod 2^32 like datasketch
    values += b[:, None]
    return values


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

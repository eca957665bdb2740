"""GPTDataset: fixed-length training samples cut from a shuffled stream of documents.

Each epoch the selected documents are shuffled (seeded) and concatenated; sample i covers tokens
[i*S, i*S + S + 1) of that stream, so consecutive samples overlap by one token (inputs and
shifted labels). Three index arrays describe it, built with vectorised numpy (no loop over
documents or samples) and cached as .npy beside the data under a hash of what determines them:
the document index (document ids over the epochs), the sample index (document position and
offset where each sample starts) and the shuffle index (the order samples are served in).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from engine.data.indexed import IndexedDataset

INDEX_FORMAT_VERSION = 1


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """[start, end) document ranges of the train, valid and test splits for weights like '98,1,1'."""
    weights = [float(w) for w in split.split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight / total * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [0] + [max(0, b - excess) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_sample_indices(document_lengths: np.ndarray, document_ids: np.ndarray, num_samples: int,
                         seq_length: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for `num_samples` samples of seq_length + 1 tokens.

    document_lengths is indexed by document id; sample_index has num_samples + 1 rows of
    (position in document_index, token offset): sample i runs from row i to row i+1 inclusive.
    """
    tokens_per_epoch = int(document_lengths[document_ids].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError("the selected documents hold no tokens; check data.paths and data.split")
    needed = num_samples * seq_length + 1
    num_epochs = -(-needed // tokens_per_epoch)
    rng = np.random.RandomState(seed % 2**32)
    document_index = np.concatenate([rng.permutation(document_ids) for _ in range(num_epochs)]).astype(np.int64)
    lengths = document_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - lengths[position])
    sample_index = np.stack([position, offset], axis=1)
    shuffle_index = rng.permutation(num_samples).astype(np.int64)
    return document_index, sample_index, shuffle_index


class GPTDataset:
    """`dataset[i]` is an int64 array of seq_length + 1 tokens."""

    def __init__(self, indexed: IndexedDataset, document_ids: np.ndarray, num_samples: int, seq_length: int,
                 seed: int, cache_dir: Path | None = None, is_builder: bool = True,
                 barrier: Callable[[], None] | None = None):
        self.indexed, self.num_samples, self.seq_length = indexed, num_samples, seq_length
        if len(document_ids) == 0:
            raise ValueError(f"{indexed.prefix}: this split selects no documents; adjust data.split")
        cache_dir = Path(cache_dir) if cache_dir else Path(indexed.prefix + "_cache")
        key = self._cache_key(indexed, document_ids, num_samples, seq_length, seed)
        paths = {name: cache_dir / f"{key}-{name}.npy" for name in ("document_index", "sample_index", "shuffle_index")}
        if is_builder and not all(p.exists() for p in paths.values()):
            arrays = build_sample_indices(indexed.sequence_lengths, np.asarray(document_ids, dtype=np.int64),
                                          num_samples, seq_length, seed)
            cache_dir.mkdir(parents=True, exist_ok=True)
            for path, array in zip(paths.values(), arrays):
                _save_atomic(path, array)
        if barrier is not None:
            barrier()
        self.document_index, self.sample_index, self.shuffle_index = (
            np.load(p, mmap_mode="r") for p in paths.values())

    @staticmethod
    def _cache_key(indexed: IndexedDataset, document_ids: np.ndarray, num_samples: int, seq_length: int,
                   seed: int) -> str:
        description = json.dumps({
            "dataset": Path(indexed.prefix).name, "bin_bytes": indexed.bin_path.stat().st_size,
            "documents": hashlib.sha256(np.ascontiguousarray(document_ids, dtype=np.int64).tobytes()).hexdigest(),
            "num_samples": num_samples, "seq_length": seq_length, "seed": seed, "format": INDEX_FORMAT_VERSION})
        return hashlib.sha256(description.encode()).hexdigest()[:20]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[i])
        (first, start), (last, stop) = self.sample_index[j], self.sample_index[j + 1]
        docs = self.document_index
        if first == last:
            return self.indexed.get(int(docs[first]), int(start), int(stop - start + 1)).astype(np.int64)
        parts = [self.indexed.get(int(docs[first]), int(start))]
        parts += [self.indexed.get(int(docs[k])) for k in range(first + 1, last)]
        parts.append(self.indexed.get(int(docs[last]), 0, int(stop + 1)))
        return np.concatenate(parts).astype(np.int64)


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)

"""GPTDataset: fixed-length training samples cut from a shuffled stream of documents.

Every epoch the selected documents are shuffled (np.random.RandomState(seed), one permutation per
epoch, drawn in epoch order) and concatenated; sample i covers tokens [i*S, i*S + S + 1) of that
stream, so consecutive samples overlap by one token (inputs and shifted labels) and may span
documents. Three index arrays describe it:

- document index: the document ids of all epochs, in stream order;
- sample index: num_samples + 1 rows of (position in the document index, token offset) where
  sample i starts; sample i ends, inclusively, where sample i + 1 starts;
- shuffle index: the order samples are served in (a permutation drawn after the epochs').

They are built by `build_sample_indices`, a pure, vectorised function (cumsum + searchsorted,
no Python loop over documents or samples), and cached as .npy beside the data under a sha256 of
everything that determines them. This module reads tokens only through IndexedDataset and must
not import torch or know about ranks: the caller says who builds and passes a barrier.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from loom.engine.data.indexed import DatasetError, IndexedDataset

INDEX_FORMAT_VERSION = 1
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """Normalised train/valid/test weights from a string like '98,1,1' (missing parts are 0)."""
    try:
        weights = [float(part) for part in split.split(",")]
    except ValueError:
        raise DatasetError(f"split {split!r} must be up to three comma-separated weights like '98,1,1'") from None
    if len(weights) > len(SPLIT_NAMES) or any(not w >= 0 for w in weights) or not sum(weights) > 0:
        raise DatasetError(
            f"split {split!r} must be up to three non-negative weights with a positive sum, like '98,1,1'"
        )
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    total = float(np.sum(np.asarray(weights, dtype=np.float64)))
    return [w / total for w in weights]


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """[start, end) document ranges of the train, valid and test splits, as megatron-core draws them.

    The cumulative normalised weights are rounded to document boundaries, so the three ranges
    always tile [0, num_documents) exactly and a zero weight gives an empty range.
    """
    cumulative = [0.0]
    for weight in parse_split(split):
        cumulative.append(cumulative[-1] + weight)
    bounds = [min(num_documents, int(round(c * float(num_documents)))) for c in cumulative]
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(len(SPLIT_NAMES))]


def _smallest_int(upper: int) -> type:
    return np.int32 if upper <= np.iinfo(np.int32).max else np.int64


def _containing_documents(ends: np.ndarray, seq_length: int, count: int) -> np.ndarray:
    """For k < count, the first document position whose end exceeds token k*seq_length.

    Equal to np.searchsorted(ends, k*seq_length, side="right") (so empty documents are skipped),
    but a bincount of ceil(ends / seq_length) is linear and several times faster.
    """
    first_boundary_at_or_after_end = ends + (seq_length - 1)
    first_boundary_at_or_after_end //= seq_length
    ended_before = np.bincount(first_boundary_at_or_after_end, minlength=count)[:count]
    return np.cumsum(ended_before)


def build_sample_indices(
    document_lengths: np.ndarray, document_ids: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for `num_samples` samples of seq_length + 1 tokens.

    document_lengths is indexed by document id. As many epochs are used as the samples need
    (num_samples * seq_length + 1 tokens); the last one may be partly unused.
    """
    document_ids = np.asarray(document_ids)
    tokens_per_epoch = int(document_lengths[document_ids].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise DatasetError(f"the {len(document_ids)} selected documents hold no tokens; check the data and its split")
    num_epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)
    rng = np.random.RandomState(seed % 2**32)
    count = len(document_ids)
    # int64 because RandomState shuffles pointer-sized items fastest; the draws do not depend on the dtype.
    document_index = np.empty(num_epochs * count, dtype=np.int64)
    for epoch in range(num_epochs):
        block = document_index[epoch * count : (epoch + 1) * count]
        block[:] = document_ids
        rng.shuffle(block)

    lengths = document_lengths[document_index]
    ends = lengths.astype(np.int64)
    np.cumsum(ends, out=ends)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = _containing_documents(ends, seq_length, num_samples + 1)
    # megatron-core starts at the first document even when it is empty; the tokens are the same.
    positions[0] = 0
    # Offsets fit int32 because sequence lengths are int32 in the .idx format.
    sample_index = np.empty((num_samples + 1, 2), dtype=_smallest_int(len(document_index)))
    sample_index[:, 0] = positions
    sample_index[:, 1] = starts - ends[positions] + lengths[positions]

    shuffle_index = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(shuffle_index)
    document_index = document_index.astype(_smallest_int(len(document_lengths)), copy=False)
    return document_index, sample_index, shuffle_index


def _cache_key(
    indexed: IndexedDataset, document_ids: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[str, str]:
    """(sha256 hex key, JSON description) of everything the three index arrays depend on."""
    description = json.dumps(
        {
            "class": "GPTDataset",
            "format": INDEX_FORMAT_VERSION,
            "dataset": Path(indexed.prefix).name,
            "bin_bytes": indexed.bin_path.stat().st_size,
            "idx_bytes": indexed.idx_path.stat().st_size,
            # A strided sample of the lengths tells apart equally sized shards sharing a cache_dir, cheaply.
            "lengths_sample_sha256": hashlib.sha256(
                np.ascontiguousarray(indexed.sequence_lengths[:: max(1, len(indexed) // 65536)]).tobytes()
            ).hexdigest(),
            "documents": len(document_ids),
            "document_ids_sha256": hashlib.sha256(np.ascontiguousarray(document_ids, np.int64).tobytes()).hexdigest(),
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
        },
        indent=1,
    )
    return hashlib.sha256(description.encode()).hexdigest(), description


def _save_atomic(path: Path, write: Callable[[object], None]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class GPTDataset:
    """`dataset[i]` is an int64 array of seq_length + 1 tokens; i in [0, num_samples)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        document_ids: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: Path | None = None,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
    ):
        self.indexed, self.num_samples, self.seq_length, self.seed = indexed, num_samples, seq_length, seed
        document_ids = self._check_arguments(indexed, document_ids, num_samples, seq_length)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(indexed.prefix + "_cache")
        key, description = _cache_key(indexed, document_ids, num_samples, seq_length, seed)
        self.cache_paths = {name: self.cache_dir / f"{key[:24]}-{name}.npy" for name in INDEX_NAMES}
        self.built = False
        if is_builder and not all(path.is_file() for path in self.cache_paths.values()):
            self._build_and_save(document_ids, description, key)
        if barrier is not None:
            barrier()
        missing = [path for path in self.cache_paths.values() if not path.is_file()]
        if missing:
            raise FileNotFoundError(
                f"GPTDataset index cache {missing[0]} is missing after the builder's barrier; "
                f"cache_dir must be on a filesystem every rank shares"
            )
        self.document_index, self.sample_index, self.shuffle_index = (
            np.load(self.cache_paths[name], mmap_mode="r") for name in INDEX_NAMES
        )

    @staticmethod
    def _check_arguments(
        indexed: IndexedDataset, document_ids: np.ndarray, num_samples: int, seq_length: int
    ) -> np.ndarray:
        if num_samples < 1 or seq_length < 1:
            raise ValueError(
                f"GPTDataset needs num_samples >= 1 and seq_length >= 1, got {num_samples} and {seq_length}"
            )
        document_ids = np.asarray(document_ids)
        if document_ids.ndim != 1 or len(document_ids) == 0:
            raise DatasetError(f"{indexed.prefix}: this split selects no documents; adjust the split or add data")
        if not np.issubdtype(document_ids.dtype, np.integer):
            raise ValueError(f"document ids must be integers, got {document_ids.dtype}")
        if document_ids.min() < 0 or document_ids.max() >= len(indexed):
            raise ValueError(
                f"{indexed.prefix}: document ids must lie in [0, {len(indexed)}), got "
                f"{document_ids.min()}..{document_ids.max()}"
            )
        return document_ids

    def _build_and_save(self, document_ids: np.ndarray, description: str, key: str) -> None:
        arrays = build_sample_indices(
            self.indexed.sequence_lengths, document_ids, self.num_samples, self.seq_length, self.seed
        )
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            _save_atomic(self.cache_dir / f"{key[:24]}-description.json", lambda f: f.write(description.encode()))
            for name, array in zip(INDEX_NAMES, arrays):
                _save_atomic(self.cache_paths[name], lambda f, a=array: np.save(f, a))
        except OSError as error:
            raise OSError(
                f"cannot write the GPTDataset index cache in {self.cache_dir} ({error.strerror}); "
                f"point data.cache_dir at a writable directory"
            ) from None
        self.built = True

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} outside a dataset of {self.num_samples}")
        j = int(self.shuffle_index[i])
        (first, start), (last, stop) = self.sample_index[j].tolist(), self.sample_index[j + 1].tolist()
        documents, get = self.document_index, self.indexed.get
        if first == last:
            return get(int(documents[first]), start, stop - start + 1).astype(np.int64)
        sample = np.empty(self.seq_length + 1, dtype=np.int64)
        head = get(int(documents[first]), start)
        sample[: len(head)] = head
        filled = len(head)
        for position in range(first + 1, last):
            tokens = get(int(documents[position]))
            sample[filled : filled + len(tokens)] = tokens
            filled += len(tokens)
        sample[filled:] = get(int(documents[last]), 0, stop + 1)
        return sample

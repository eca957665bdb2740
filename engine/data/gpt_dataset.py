"""GPTDataset: fixed-length training samples cut from shuffled epochs of documents.

Each epoch is one pass over the selected documents: they are shuffled and concatenated, and the
epoch yields (tokens - 1) // S samples, sample k covering tokens [k*S, k*S + S + 1) of that stream
(consecutive samples overlap by one token: inputs and shifted labels; a sample may span documents;
the partial tail is dropped). The epoch's samples are then served in a shuffled order. Epoch 0
draws both permutations from RandomState(seed), so a run within one epoch sees exactly the samples
megatron-core's GPTDataset serves for the same .bin/.idx, seed, split and sequence length. Each
later epoch draws from its own RandomState([seed, epoch]) — the one deliberate difference from
megatron-core, which shuffles the documents of all epochs together, so that the order is a
function of (data, seq_length, seed, split) alone: a longer or shorter `train.steps`, or a run
extended on resume, never changes the samples already consumed. Every label counts in the loss:
megatron-core's loss mask also drops its tokenizer's pad id where that differs from the end-of-document
id (loom's datasets hold no padding; a corpus that spells the pad id inside documents trains on it). A split
whose documents hold fewer tokens than one sample repeats them within an epoch (`EpochShape.passes`). Three index
arrays describe it:

- document index: the document ids of all epochs, in stream order;
- sample index: per epoch, samples + 1 rows of (position in the document index, token offset)
  where each sample starts; a sample ends, inclusively, where the next row starts;
- shuffle index: the sample-index row of each sample, in the order samples are served.

They are built by `build_sample_indices`, a pure, vectorised function (cumsum + searchsorted,
no Python loop over documents or samples), and cached as .npy beside the data under a sha256 of
everything that determines them. This module reads tokens only through IndexedDataset and must
not import torch or know about ranks: the caller says who builds and passes how the ranks agree (`agree`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from loom.engine.atomic import atomic_path
from loom.engine.data.indexed import DatasetError, IndexedDataset, default_cache_dir

SLOW_BUILD_SAMPLES = 4_000_000
"""A sample index this large takes seconds to build (~2.7 s and 1 GB for 18 M samples): said, not silent."""
INDEX_FORMAT_VERSION = 2  # 2: epochs shuffled on their own, cached per whole epoch
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


@dataclass(frozen=True)
class EpochShape:
    """How the samples are cut: an epoch is `passes` shuffled passes over the documents (1 unless the
    documents hold fewer tokens than one sample) and yields `samples` samples."""

    passes: int
    samples: int


def epoch_shape(tokens_per_pass: int, seq_length: int) -> EpochShape:
    """Each sample holds seq_length + 1 tokens (its last is the next sample's first) and an epoch's partial
    tail is dropped, as megatron-core does; a split too small for one sample repeats its documents."""
    passes = max(1, -(-(seq_length + 1) // tokens_per_pass))
    return EpochShape(passes, (passes * tokens_per_pass - 1) // seq_length)


def _epoch_shape_of(document_lengths: np.ndarray, document_ids: np.ndarray, seq_length: int) -> EpochShape:
    tokens_per_pass = int(document_lengths[document_ids].sum(dtype=np.int64))
    if tokens_per_pass == 0:
        raise DatasetError(f"the {len(document_ids)} selected documents hold no tokens; check the data and its split")
    return epoch_shape(tokens_per_pass, seq_length)


def epoch_random_state(seed: int, epoch: int) -> np.random.RandomState:
    """The generator of one epoch's document and sample permutations.

    Epoch 0 draws from RandomState(seed), exactly like megatron-core's GPTDataset for a run that fits
    in one epoch. Later epochs draw from their own stream instead of reshuffling all epochs together
    (megatron-core's way), so asking for more samples never reorders the ones already served.
    """
    return np.random.RandomState(seed % 2**32 if epoch == 0 else [seed % 2**32, epoch])


def _epoch_indices(
    document_lengths: np.ndarray,
    document_ids: np.ndarray,
    seq_length: int,
    shape: EpochShape,
    rng: np.random.RandomState,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One epoch's (document order, shape.samples + 1 sample boundaries, sample order)."""
    # int64 because RandomState shuffles pointer-sized items fastest; the draws do not depend on the dtype.
    document_index = np.tile(document_ids.astype(np.int64), shape.passes)
    rng.shuffle(document_index)
    lengths = document_lengths[document_index]
    ends = lengths.astype(np.int64)
    np.cumsum(ends, out=ends)
    starts = np.arange(shape.samples + 1, dtype=np.int64) * seq_length
    positions = _containing_documents(ends, seq_length, shape.samples + 1)
    # megatron-core starts at the first document even when it is empty; the tokens are the same.
    positions[0] = 0
    sample_index = np.stack([positions, starts - ends[positions] + lengths[positions]], axis=1)
    shuffle_index = np.arange(shape.samples, dtype=np.int64)
    rng.shuffle(shuffle_index)
    return document_index, sample_index, shuffle_index


def build_sample_indices(
    document_lengths: np.ndarray, document_ids: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) of the whole epochs that hold `num_samples` samples.

    document_lengths is indexed by document id. Epoch e contributes passes * len(document_ids) rows to
    the document index, samples + 1 rows to the sample index (positions count from the start of the
    whole document index) and `samples` entries, rows of the sample index, to the shuffle index.
    Sample i is the shuffle index's entry i, so the order depends on the data, seq_length and seed
    only, never on num_samples.
    """
    document_ids = np.asarray(document_ids)
    shape = _epoch_shape_of(document_lengths, document_ids, seq_length)
    num_epochs = -(-num_samples // shape.samples)
    documents_per_epoch = shape.passes * len(document_ids)
    parts = [
        _epoch_indices(document_lengths, document_ids, seq_length, shape, epoch_random_state(seed, epoch))
        for epoch in range(num_epochs)
    ]
    document_index = np.concatenate([part[0] for part in parts])
    sample_index = np.concatenate([part[1] + (epoch * documents_per_epoch, 0) for epoch, part in enumerate(parts)])
    shuffle_index = np.concatenate([part[2] + epoch * (shape.samples + 1) for epoch, part in enumerate(parts)])
    # Offsets fit int32 because sequence lengths are int32 in the .idx format.
    sample_index = sample_index.astype(_smallest_int(len(document_index)), copy=False)
    document_index = document_index.astype(_smallest_int(len(document_lengths)), copy=False)
    return document_index, sample_index, shuffle_index


def _cache_key(
    indexed: IndexedDataset, document_ids: np.ndarray, num_epochs: int, seq_length: int, seed: int
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
            "epochs": num_epochs,
            "seq_length": seq_length,
            "seed": seed,
        },
        indent=1,
    )
    return hashlib.sha256(description.encode()).hexdigest(), description


def _failure_of(step: Callable[[], None]) -> DatasetError | None:
    """What `step` raised that the other ranks must hear of, or None."""
    try:
        step()
    except DatasetError as failure:
        return failure
    return None


def _settle(failure: DatasetError | None, agree: Callable[[Exception | None], None] | None) -> None:
    if agree is not None:
        agree(failure)
    if failure is not None:
        raise failure


def _save_atomic(path: Path, write: Callable[[object], None]) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


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
        agree: Callable[[Exception | None], None] | None = None,
    ):
        """`is_builder`: this rank builds the index cache if it is not there. `agree`, on every rank of a launch:
        called with this rank's failure (None when it has none) after the builder's turn, then after the rank has
        read the cache; it waits for every rank and raises on each if any failed (a rank that failed alone left the
        others waiting out the collective timeout)."""
        self.indexed, self.num_samples, self.seq_length, self.seed = indexed, num_samples, seq_length, seed
        document_ids = self._check_arguments(indexed, document_ids, num_samples, seq_length)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(indexed.prefix)
        self.epoch = _epoch_shape_of(indexed.sequence_lengths, document_ids, seq_length)
        self.num_epochs = -(-num_samples // self.epoch.samples)
        key, description = _cache_key(indexed, document_ids, self.num_epochs, seq_length, seed)
        self.cache_paths = {name: self.cache_dir / f"{key[:24]}-{name}.npy" for name in INDEX_NAMES}
        self.built = False
        failure = None
        if is_builder and not all(path.is_file() for path in self.cache_paths.values()):
            failure = _failure_of(lambda: self._build_and_save(document_ids, description, key))
        _settle(failure, agree)
        _settle(_failure_of(lambda: self._load(len(document_ids))), agree)

    def _load(self, documents: int) -> None:
        missing = [path for path in self.cache_paths.values() if not path.is_file()]
        if missing:
            raise DatasetError(
                f"GPTDataset index cache {missing[0].absolute()} is missing after rank 0 built it: data.cache_dir "
                "must be on a filesystem every rank shares, and every rank must read the same data files"
            )
        arrays = []
        for name in INDEX_NAMES:
            try:
                arrays.append(np.load(self.cache_paths[name], mmap_mode="r"))
            except (OSError, ValueError) as error:
                raise DatasetError(
                    f"cannot read index cache {self.cache_paths[name]} ({error}); delete it: the next run (or `loom "
                    "data index`) builds it again"
                ) from None
        self.document_index, self.sample_index, self.shuffle_index = arrays
        self._verify(documents)

    def _verify(self, documents: int) -> None:
        """The cached arrays have the lengths this dataset's shape implies (a cache written by a build of
        `loom data index` in preprocessing is found by its key; this catches one damaged or from elsewhere)."""
        epochs, shape = self.num_epochs, self.epoch
        expected = {
            "document_index": (len(self.document_index), epochs * shape.passes * documents),
            "sample_index": (len(self.sample_index), epochs * (shape.samples + 1)),
            "shuffle_index": (len(self.shuffle_index), epochs * shape.samples),
        }
        for name, (found, wanted) in expected.items():
            if found != wanted:
                raise DatasetError(
                    f"index cache {self.cache_paths[name]} holds {found} entries where {self.indexed.prefix} "
                    f"needs {wanted}; delete it: the next run (or `loom data index`) builds it again"
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
        built = self.num_epochs * self.epoch.samples  # whole epochs, whatever the run asks for
        if built > SLOW_BUILD_SAMPLES:
            print(
                f"building the sample index of {self.indexed.prefix} ({built:,} samples of "
                f"{self.seq_length} tokens) once; cached in {self.cache_dir} (`loom data index` builds it ahead)",
                flush=True,
            )
        arrays = build_sample_indices(
            self.indexed.sequence_lengths, document_ids, self.num_samples, self.seq_length, self.seed
        )
        description_path = self.cache_dir / f"{key[:24]}-description.json"
        written: list[Path] = []  # only this call's: another run may share the cache and have finished its own
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            _save_atomic(description_path, lambda f: f.write(description.encode()))
            written.append(description_path)
            for name, array in zip(INDEX_NAMES, arrays):
                _save_atomic(self.cache_paths[name], lambda f, a=array: np.save(f, a))
                written.append(self.cache_paths[name])
        except OSError as error:
            for path in written:
                with contextlib.suppress(OSError):
                    path.unlink()
            # np.save's short write is an OSError with no errno ("N requested and M written"): a full disk
            full = error.errno in (errno.ENOSPC, errno.EDQUOT) or (error.errno is None and "written" in str(error))
            reason = os.strerror(errno.ENOSPC) if full else (error.strerror or str(error))
            raise DatasetError(
                f"cannot write the GPTDataset index cache in {self.cache_dir} ({reason}); "
                + ("free some space, or " if full else "")
                + "point data.cache_dir at a writable directory"
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

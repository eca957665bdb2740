"""The one place that knows the .bin/.idx format: Megatron-LM's MMIDIDX, version 1, byte for byte.

P.idx: magic `MMIDIDX\\x00\\x00`, u64 version (1), u8 dtype code, u64 sequence count, u64
document-index count, then int32 sequence lengths, int64 byte pointers into P.bin, int64
document indices (sequence numbers where each document starts, plus the final count).
P.bin: the tokens of every sequence, back to back, in the dtype of the code.
Readers memory-map both files and validate them cheaply (vectorised); writers stream and rename
their outputs into place only when complete. No torch here.
"""

from __future__ import annotations

import array
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16}
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8


class IndexFormatError(ValueError):
    """A missing, truncated or corrupt .bin/.idx pair; the message names the file and what to do."""


def dtype_code(dtype: np.dtype) -> int:
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} has no MMIDIDX code")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id fits comfortably, int32 above (Megatron's rule)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """Memory-mapped read access to P.bin/P.idx; `dataset[i]` is sequence i as a numpy array."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = _paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise IndexFormatError(f"{path} does not exist; build the dataset with `loom data build`")
        self._read_index()
        self._bin = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if self.bin_path.stat().st_size else \
            np.zeros(0, dtype=np.uint8)
        self._validate()

    def _fail(self, path: Path, problem: str) -> IndexFormatError:
        return IndexFormatError(f"corrupt dataset {path}: {problem}; rebuild it with `loom data build`")

    def _read_index(self) -> None:
        path, size = self.idx_path, self.idx_path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise self._fail(path, f"{size} bytes is shorter than the {HEADER_SIZE}-byte header")
        if header[:9] != MAGIC:
            raise self._fail(path, f"bad magic {header[:9]!r} (expected Megatron MMIDIDX)")
        version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
        if version != VERSION:
            raise self._fail(path, f"unsupported version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise self._fail(path, f"unknown dtype code {code}")
        expected = HEADER_SIZE + sequences * (4 + 8) + documents * 8
        if size < expected:
            raise self._fail(path, f"truncated: {size} bytes, the header promises {expected}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(index, np.int32, sequences, offset)
        offset += sequences * 4
        self.sequence_pointers = np.frombuffer(index, np.int64, sequences, offset)
        offset += sequences * 8
        self.document_indices = np.frombuffer(index, np.int64, documents, offset)

    def _validate(self) -> None:
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        item = self.dtype.itemsize
        if len(lengths):
            if lengths.min() < 0 or pointers.min() < 0:
                raise self._fail(self.idx_path, "negative sequence length or pointer")
            ends = pointers + lengths.astype(np.int64) * item
            if ends.max() > self._bin.size:
                worst = int(np.argmax(ends))
                raise self._fail(self.bin_path, f"sequence {worst} ends at byte {int(ends[worst])} but the file "
                                                f"has {self._bin.size} bytes (truncated .bin?)")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
            raise self._fail(self.idx_path, "document indices are not a monotonic range 0..sequence count")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i."""
        available = int(self.sequence_lengths[i]) - offset
        length = available if length is None else min(length, available)
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


class IndexedDatasetWriter:
    """Streams sequences into P.bin.tmp/P.idx.tmp; `finalize` renames .bin then .idx into place.

    Used as a context manager, an exception inside the block removes the temporary files, so an
    interrupted build never leaves an .idx that looks complete.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.code = dtype_code(self.dtype)
        self.bin_path, self.idx_path = _paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array.array("i")
        self._document_starts: list[int] = [0]
        self._sequences = 0
        self._done = False

    def add_sequence(self, tokens) -> None:
        tokens = np.asarray(tokens)
        limits = np.iinfo(self.dtype)
        if tokens.size and (tokens.min() < limits.min or tokens.max() > limits.max):
            raise ValueError(f"token ids outside the range of {self.dtype.name}; choose a wider dtype")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(tokens.size)
        self._sequences += 1

    def end_document(self) -> None:
        self._document_starts.append(self._sequences)

    def add_document(self, tokens) -> None:
        """One document made of one sequence (the usual case)."""
        self.add_sequence(tokens)
        self.end_document()

    def add_index(self, prefix: str | Path) -> None:
        """Append every sequence and document of an existing dataset (for merging)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} ({other.dtype.name}) into a {self.dtype.name} dataset")
        chunk = 1 << 24
        data = other._bin[: int(other.sequence_pointers[-1] + other.sequence_lengths[-1] * self.dtype.itemsize)] \
            if len(other) else other._bin[:0]
        for start in range(0, data.size, chunk):
            self._bin.write(data[start:start + chunk].tobytes())
        self._lengths.extend(other.sequence_lengths.tolist())
        self._document_starts.extend((other.document_indices[1:] + self._sequences).tolist())
        self._sequences += len(other)

    def finalize(self) -> None:
        if self._done:
            return
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self._document_starts, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, self.code, len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        # An old .idx must not outlive its .bin, or a crash here would pair it with new tokens.
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        self._done = True

    def abort(self) -> None:
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
        return False

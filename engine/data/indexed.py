"""The one place that knows the .bin/.idx format: Megatron-LM's MMIDIDX, version 1, byte for byte.

P.idx: magic `MMIDIDX\\x00\\x00`, u64 version (1), u8 dtype code, u64 sequence count, u64
document-index count, then int32 sequence lengths, int64 byte pointers into P.bin, int64
document indices (the sequence number where each document starts, then the sequence count, so
one entry more than there are documents). P.bin: the tokens of every sequence, back to back.

Readers memory-map both files and validate them with vectorised checks only, so opening a
multi-terabyte dataset stays cheap. Writers stream tokens to temporary files and rename them into
place only when complete (.bin first, .idx last). This module must not import torch, and nothing
else in loom may parse or write these bytes.
"""

from __future__ import annotations

import array
import functools
import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from loom.errors import LoomError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = MappingProxyType(
    {
        1: np.dtype(np.uint8),
        2: np.dtype(np.int8),
        3: np.dtype(np.int16),
        4: np.dtype(np.int32),
        5: np.dtype(np.int64),
        6: np.dtype(np.float64),
        7: np.dtype(np.float32),
        8: np.dtype(np.uint16),
    }
)
HEADER = struct.Struct("<9sQBQQ")
_REBUILD_HINT = "rebuild it with `loom data build`"
_COPY_CHUNK_BYTES = 64 << 20


class DatasetError(LoomError):
    """A dataset that cannot serve what was asked of it (a split with no documents, ids that do not fit its dtype,
    an incompatible merge); the message says what to change."""


class IndexFormatError(LoomError):
    """A missing, truncated or corrupt .bin/.idx pair; the one-line message names the file."""


@dataclass(frozen=True)
class IndexHeader:
    """The fixed-size head of an .idx file."""

    dtype: np.dtype
    sequence_count: int
    document_index_count: int

    def arrays_end(self) -> int:
        """Byte offset where the three arrays promised by this header end."""
        return HEADER.size + self.sequence_count * (4 + 8) + self.document_index_count * 8


def dtype_code(dtype: np.dtype) -> int:
    """The MMIDIDX code of a numpy dtype."""
    for code, candidate in DTYPE_CODES.items():
        if candidate == np.dtype(dtype):
            return code
    raise ValueError(
        f"dtype {np.dtype(dtype).name} has no MMIDIDX code; use one of "
        f"{', '.join(d.name for d in DTYPE_CODES.values())}"
    )


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id fits comfortably, int32 above (Megatron's rule)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def index_paths(prefix: str | Path) -> tuple[Path, Path]:
    """(P.bin, P.idx) for a dataset prefix."""
    prefix = os.fspath(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def default_cache_dir(prefix: str | Path) -> Path:
    """P_cache/, where training keeps a dataset's sample indices and token-id checks unless data.cache_dir says."""
    return Path(os.fspath(prefix) + "_cache")


def dataset_record(prefix: str) -> dict | None:
    """What a checkpoint records of a training dataset (CheckpointMetadata.datasets): its absolute prefix, the
    sizes of its two files, when its .idx (written last) was written and a digest of blocks sampled from both
    (sampled_sha256), by which a resume tells other data (a rebuild, even of the same size) from the same data
    reached by another path (relative paths, a moved run, a copy: a new write time, the same bytes); None where a
    file is missing."""
    bin_path, idx_path = index_paths(prefix)
    try:
        idx, tokens = idx_path.stat(), bin_path.stat()
        return {"path": str(Path(prefix).resolve()), "bin_bytes": tokens.st_size, "idx_bytes": idx.st_size,
                "idx_written_ns": idx.st_mtime_ns,
                "sampled_sha256": _sampled_sha256(bin_path, idx_path, _version(tokens), _version(idx))}  # fmt: skip
    except OSError:
        return None


def _version(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


_SAMPLED_BLOCKS, _BLOCK_BYTES = 16, 1 << 16


@functools.lru_cache(maxsize=256)
def _sampled_sha256(bin_path: Path, idx_path: Path, *versions: tuple[int, int, int, int]) -> str:
    """sha256 over 16 blocks of 64 KiB spread evenly through each file (a smaller file whole): 2 MiB read per
    dataset, once a process for each version of its files (`versions`: a checkpoint save records it every time),
    where hashing a 100M-document dataset whole would read its GB at every resume. A rebuild that keeps both sizes
    and changes no sampled byte passes for the same data: every other rebuild (another tokenizer, cleaning, order)
    changes bytes throughout both files."""
    digest = hashlib.sha256()
    for path in (bin_path, idx_path):
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            starts = range(0, size, _BLOCK_BYTES) if size <= _SAMPLED_BLOCKS * _BLOCK_BYTES else (
                (size - _BLOCK_BYTES) * block // (_SAMPLED_BLOCKS - 1) for block in range(_SAMPLED_BLOCKS))  # fmt: skip
            for start in starts:
                file.seek(start)
                digest.update(file.read(_BLOCK_BYTES))
    return digest.hexdigest()


def _corrupt(path: Path, problem: str) -> IndexFormatError:
    return IndexFormatError(f"corrupt dataset {path}: {problem}; {_REBUILD_HINT}")


def read_header(idx_path: str | Path) -> IndexHeader:
    """Parse and check the header of an .idx file, including that the file holds what it promises."""
    idx_path = Path(idx_path)
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        raw = f.read(HEADER.size)
    if not MAGIC.startswith(raw[: len(MAGIC)]):
        raise _corrupt(idx_path, f"bad magic {raw[: len(MAGIC)]!r} (expected Megatron MMIDIDX)")
    if len(raw) < HEADER.size:
        raise _corrupt(idx_path, f"truncated: {size} bytes is shorter than the {HEADER.size}-byte header")
    _, version, code, sequences, documents = HEADER.unpack(raw)
    if version != VERSION:
        raise _corrupt(idx_path, f"unsupported version {version} (loom reads MMIDIDX version {VERSION})")
    if code not in DTYPE_CODES:
        raise _corrupt(idx_path, f"unknown dtype code {code}")
    header = IndexHeader(DTYPE_CODES[code], sequences, documents)
    expected = header.arrays_end()
    if size < expected:
        raise _corrupt(idx_path, f"truncated: {size} bytes, but the header promises {expected}")
    # Megatron's multimodal variant appends one int8 mode per sequence; anything else is damage.
    if size not in (expected, expected + sequences):
        raise _corrupt(idx_path, f"{size - expected} unexpected bytes after the arrays the header promises")
    return header


def _map(path: Path) -> np.ndarray:
    """Read-only byte view of a whole file (np.memmap refuses empty files)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


MEGATRON_SUFFIX = "_text_document"
"""What Megatron-LM's preprocess_data.py adds to an output prefix (for its text key); loom data build adds nothing."""


def other_naming_hint(prefix: str) -> str:
    """Where the same dataset exists named the other engine's way (with or without Megatron's suffix), the clause
    that says so, to follow "P.idx does not exist"; "" where none does."""
    other = prefix.removesuffix(MEGATRON_SUFFIX) if prefix.endswith(MEGATRON_SUFFIX) else prefix + MEGATRON_SUFFIX
    return f", but {other}.idx does: that is its prefix" if index_paths(other)[1].is_file() else ""


class IndexedDataset:
    """Memory-mapped read access to P.bin/P.idx; `dataset[i]` is sequence i as a numpy array."""

    def __init__(self, prefix: str | Path):
        self.prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = index_paths(prefix)
        if Path(prefix).is_dir():
            found = sorted(str(p.with_suffix("")) for p in Path(prefix).glob("*.idx"))
            hint = f" (here: {', '.join(found[:3])})" if found else ""
            raise IndexFormatError(f"{prefix} is a directory; give the prefix P of P.bin/P.idx{hint}")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                if self.prefix.endswith((".bin", ".idx")) and Path(self.prefix).is_file():
                    raise IndexFormatError(f"{prefix} is a file of the dataset; give its prefix {self.prefix[:-4]}")
                where = "" if path.is_absolute() else f" (in {Path.cwd()}: paths are relative to the working directory)"
                if hint := other_naming_hint(self.prefix):
                    raise IndexFormatError(f"{path} does not exist{where}{hint}")
                raise IndexFormatError(f"{path} does not exist{where}; build the dataset with `loom data build`")
        header = read_header(self.idx_path)
        self._dtype = header.dtype
        index = _map(self.idx_path)
        offset, count = HEADER.size, header.sequence_count
        self._lengths = np.frombuffer(index, np.int32, count, offset)
        self._pointers = np.frombuffer(index, np.int64, count, offset + 4 * count)
        self._document_indices = np.frombuffer(index, np.int64, header.document_index_count, offset + 12 * count)
        self._bin = _map(self.bin_path)
        self._validate()

    def _validate(self) -> None:
        lengths, pointers, documents = self._lengths, self._pointers, self._document_indices
        bin_bytes, item = self._bin.size, self._dtype.itemsize
        if len(lengths):
            if lengths.min() < 0:
                raise _corrupt(self.idx_path, f"negative length for sequence {int(np.argmin(lengths))}")
            if pointers.min() < 0:
                raise _corrupt(self.idx_path, f"negative byte pointer for sequence {int(np.argmin(pointers))}")
            ends = pointers + lengths.astype(np.int64) * item
            worst = int(np.argmax(ends))
            if ends[worst] > bin_bytes:
                raise _corrupt(
                    self.bin_path,
                    f"sequence {worst} ends at byte {int(ends[worst])} but the file has "
                    f"{bin_bytes} bytes (truncated, or paired with another .idx)",
                )
            # Megatron and loom both write sequences back to back; anything else is a damaged index.
            gaps = np.flatnonzero(pointers[1:] != ends[:-1])
            if pointers[0] != 0 or len(gaps):
                first = 0 if pointers[0] != 0 else int(gaps[0]) + 1
                raise _corrupt(self.idx_path, f"byte pointer of sequence {first} does not follow the previous sequence")
        described = int(lengths.sum(dtype=np.int64)) * item
        if described != bin_bytes:
            raise _corrupt(
                self.bin_path,
                f"{bin_bytes} bytes, but {self.idx_path.name} describes {described} "
                f"(the two files come from different builds)",
            )
        if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths):
            raise _corrupt(self.idx_path, f"document indices must run from 0 to the sequence count {len(lengths)}")
        if len(documents) > 1 and np.any(documents[1:] < documents[:-1]):
            first = int(np.flatnonzero(documents[1:] < documents[:-1])[0])
            raise _corrupt(self.idx_path, f"document indices decrease after entry {first}")

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 token count of every sequence."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in P.bin."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 first sequence of every document, then the sequence count (num_documents + 1 entries)."""
        return self._document_indices

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self._lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None); a read-only view."""
        available = int(self._lengths[i]) - offset
        if offset < 0 or available < 0:
            raise IndexError(f"offset {offset} outside sequence {i} of {self._lengths[i]} tokens")
        if length is not None and length < 0:  # numpy reads a count of -1 as "to the end of the whole .bin"
            raise IndexError(f"length {length} of sequence {i} is negative")
        length = available if length is None else min(length, available)
        start = int(self._pointers[i]) + offset * self._dtype.itemsize
        return np.frombuffer(self._bin, self._dtype, length, start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


def _check_length(tokens: int) -> None:
    """The .idx holds a sequence's length as int32: a longer one wrapped to a negative length, unsaid."""
    if tokens > np.iinfo(np.int32).max:
        raise OverflowError(
            f"a sequence of {tokens:,} tokens exceeds the .idx format's int32 lengths; cut it into sequences of at "
            "most 2,147,483,647"
        )


class IndexedDatasetWriter:
    """Streams sequences into P.bin.tmp/P.idx.tmp; `finalize` renames .bin then .idx into place.

    Used as a context manager, an exception inside the block removes the temporary files, so an
    interrupted build never leaves an .idx that looks complete.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.bin_path, self.idx_path = index_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array.array("i")
        self._document_starts = array.array("q", [0])
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the writer for {self.idx_path} is already finalized or aborted")

    def add_sequence(self, tokens: np.ndarray | list[int]) -> None:
        """Append one sequence to the current document."""
        self._check_open()
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"a sequence must be one-dimensional, got shape {tokens.shape}")
        _check_length(tokens.size)
        self._check_range(tokens)
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(tokens.size)

    def _check_range(self, tokens: np.ndarray) -> None:
        if (
            self._limits is not None
            and tokens.size
            and (tokens.min() < self._limits.min or tokens.max() > self._limits.max)
        ):
            raise DatasetError(
                f"token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype.name}; "
                f"use dtype_for_vocab(vocab_size)"
            )

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: `tokens` back to back, document i has lengths[i]."""
        self._check_open()
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if (
            tokens.ndim != 1
            or lengths.ndim != 1
            or int(lengths.sum()) != tokens.size
            or (lengths.size and lengths.min() < 0)
        ):
            raise ValueError(
                f"lengths (sum {int(lengths.sum())}) must be non-negative and add up to the {tokens.size} tokens"
            )
        if self._document_starts[-1] != len(self._lengths):
            raise ValueError("call end_document() before add_documents(): the current document is still open")
        if lengths.size:
            _check_length(int(lengths.max()))
        self._check_range(tokens)
        self._bin.write(memoryview(np.ascontiguousarray(tokens.astype(self.dtype, copy=False))))
        first = len(self._lengths)
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._document_starts.frombytes(np.arange(first + 1, first + 1 + lengths.size, dtype=np.int64).tobytes())

    def end_document(self) -> None:
        """Close the current document (the sequences added since the previous one)."""
        self._check_open()
        self._document_starts.append(len(self._lengths))

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """One document made of one sequence (the usual case)."""
        self.add_sequence(tokens)
        self.end_document()

    def add_index(self, other_prefix: str | Path, copied: Callable[[int], object] | None = None) -> None:
        """Append every sequence and document of an existing dataset (for merging); `copied(n)` hears of each n bytes
        of its .bin copied."""
        self._check_open()
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise DatasetError(f"cannot merge {other_prefix} ({other.dtype.name}) into a {self.dtype.name} dataset")
        if self._document_starts[-1] != len(self._lengths):
            raise ValueError("call end_document() before add_index(): the current document is still open")
        offset = len(self._lengths)
        with open(other.bin_path, "rb") as source:
            while chunk := source.read(_COPY_CHUNK_BYTES):
                self._bin.write(chunk)
                if copied is not None:
                    copied(len(chunk))
        self._lengths.frombytes(np.ascontiguousarray(other.sequence_lengths).tobytes())
        self._document_starts.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())

    def finalize(self) -> None:
        """Write the index and move both files into place; a second call does nothing."""
        if self._closed:
            return
        if self._document_starts[-1] != len(self._lengths):
            self.abort()
            raise ValueError(
                f"{self.idx_path}: sequences were added after the last end_document(); "
                f"close every document before finalize()"
            )
        try:
            self._write_index()
        except BaseException:
            self.abort()  # a full disk fails here too: no temporary file may outlive the writer
            raise
        # An old .idx must not outlive its .bin, or a crash between the renames would pair it with new tokens.
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        self._closed = True

    def _write_index(self) -> None:
        """Flush P.bin.tmp and write P.idx.tmp for everything added."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        documents = np.frombuffer(self._document_starts, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
            f.flush()
            os.fsync(f.fileno())

    def abort(self) -> None:
        """Drop everything written so far; the final paths are left untouched."""
        try:
            self._bin.close()
        except OSError:
            pass  # on a full disk the close's flush fails again; the file is closed anyway and removed below
        for path in (self._bin_tmp, self._idx_tmp):
            path.unlink(missing_ok=True)
        self._closed = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
        return False

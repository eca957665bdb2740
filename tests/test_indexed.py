"""The .bin/.idx format: loom's writer and reader against a reader written here from the byte layout."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from loom.engine.data.indexed import (
    DatasetError,
    IndexedDataset,
    IndexedDatasetWriter,
    IndexFormatError,
    dtype_for_vocab,
)

CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def read_by_hand(prefix: Path) -> tuple[np.dtype, list[np.ndarray], list[int]]:
    """An independent MMIDIDX v1 reader: (dtype, sequences, document indices)."""
    idx = Path(f"{prefix}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", idx[9:17])
    assert version == 1
    (code,) = struct.unpack("<B", idx[17:18])
    sequences, documents = struct.unpack("<QQ", idx[18:34])
    offset = 34
    lengths = struct.unpack(f"<{sequences}i", idx[offset : offset + 4 * sequences])
    offset += 4 * sequences
    pointers = struct.unpack(f"<{sequences}q", idx[offset : offset + 8 * sequences])
    offset += 8 * sequences
    document_indices = list(struct.unpack(f"<{documents}q", idx[offset : offset + 8 * documents]))
    assert offset + 8 * documents == len(idx)
    dtype = np.dtype(CODES[code])
    data = Path(f"{prefix}.bin").read_bytes()
    tokens = [np.frombuffer(data[p : p + n * dtype.itemsize], dtype) for p, n in zip(pointers, lengths)]
    return dtype, tokens, document_indices


def random_documents(rng: np.random.Generator, count: int, high: int) -> list[np.ndarray]:
    return [rng.integers(0, high, size=int(rng.integers(0, 50))) for _ in range(count)]


@pytest.mark.parametrize("vocab_size", [1000, 65499, 65500, 200_000])
def test_writer_output_reads_back_by_hand_and_through_the_reader(tmp_path, vocab_size):
    rng = np.random.default_rng(vocab_size)
    documents = random_documents(rng, 40, vocab_size) + [np.array([vocab_size - 1]), np.array([], np.int64)]
    dtype = dtype_for_vocab(vocab_size)
    assert dtype == (np.uint16 if vocab_size < 65500 else np.int32)
    prefix = tmp_path / "data"
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents[:20]:
            writer.add_document(doc)
        writer.add_documents(np.concatenate(documents[20:]), [len(d) for d in documents[20:]])
    hand_dtype, hand_tokens, hand_docs = read_by_hand(prefix)
    assert hand_dtype == dtype
    assert hand_docs == list(range(len(documents) + 1))
    dataset = IndexedDataset(prefix)
    assert len(dataset) == dataset.num_documents == len(documents)
    assert dataset.num_tokens == sum(len(d) for d in documents)
    assert dataset.sequence_lengths.dtype == np.int32
    for i, doc in enumerate(documents):
        np.testing.assert_array_equal(hand_tokens[i], doc)
        np.testing.assert_array_equal(dataset[i], doc)
    np.testing.assert_array_equal(dataset.get(0, 2, 3), documents[0][2:5])
    with pytest.raises(IndexError, match="length -1 of sequence 0 is negative"):  # was every token to the .bin's end
        dataset.get(0, 0, -1)


def test_multi_sequence_documents_and_merge(tmp_path):
    rng = np.random.default_rng(1)
    first, second = tmp_path / "a", tmp_path / "b"
    with IndexedDatasetWriter(first, np.uint16) as writer:
        writer.add_sequence([1, 2, 3])
        writer.add_sequence([4])
        writer.end_document()
        writer.add_document([5, 6])
    with IndexedDatasetWriter(second, np.uint16) as writer:
        for doc in random_documents(rng, 5, 100):
            writer.add_document(doc)
    merged = tmp_path / "merged"
    with IndexedDatasetWriter(merged, np.uint16) as writer:
        writer.add_index(first)
        writer.add_document([7])
        writer.add_index(second)
    _, tokens_a, docs_a = read_by_hand(first)
    _, tokens_b, _ = read_by_hand(second)
    _, tokens_m, docs_m = read_by_hand(merged)
    assert docs_a == [0, 2, 3]
    assert docs_m == [0, 2, 3, 4, 5, 6, 7, 8, 9]
    expected = tokens_a + [np.array([7])] + tokens_b
    assert len(tokens_m) == len(expected)
    for got, want in zip(tokens_m, expected):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(DatasetError, match="cannot merge"):
        with IndexedDatasetWriter(tmp_path / "c", np.int32) as writer:
            writer.add_index(first)


def test_out_of_range_tokens_are_refused(tmp_path):
    with pytest.raises(DatasetError, match="do not fit uint16"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
            writer.add_document([70000])
    assert not list(tmp_path.iterdir())
    huge = np.broadcast_to(np.uint16(1), (2**31 + 5,))  # 4 GiB of tokens in no memory
    with pytest.raises(OverflowError, match="2,147,483,653 tokens exceeds the .idx format's int32 lengths"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:  # its length wrapped to a negative one
            writer.add_documents(huge, np.array([huge.size]))
    assert not list(tmp_path.iterdir())
    with pytest.raises(OverflowError, match="exceeds the .idx format's int32 lengths"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:  # refused before its tokens are written
            writer.add_document(huge)
    assert not list(tmp_path.iterdir())


def test_an_interrupted_build_leaves_nothing_that_looks_complete(tmp_path):
    prefix = tmp_path / "data"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document([1, 2, 3])
    old_idx = Path(f"{prefix}.idx").read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_document([9, 9])
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "data.idx"]
    assert Path(f"{prefix}.idx").read_bytes() == old_idx
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "fresh", np.uint16) as writer:
            writer.add_document([1])
            raise RuntimeError("boom")
    assert not (tmp_path / "fresh.idx").exists() and not (tmp_path / "fresh.bin").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_an_unclosed_document_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="end_document"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
            writer.add_sequence([1, 2])
    assert not list(tmp_path.iterdir())


@pytest.fixture
def good(tmp_path) -> Path:
    prefix = tmp_path / "good"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in random_documents(np.random.default_rng(0), 10, 500):
            writer.add_document(np.append(doc, 1))
    return prefix


def _header_fields(idx: bytes) -> list:
    return list(struct.unpack("<9sQBQQ", idx[:34]))


def _with_header(idx: bytes, **changes) -> bytes:
    fields = dict(zip(["magic", "version", "code", "sequences", "documents"], _header_fields(idx)))
    fields.update(changes)
    return struct.pack("<9sQBQQ", *fields.values()) + idx[34:]


def _corrupt_idx(idx: bytes, case: str) -> bytes:
    sequences = _header_fields(idx)[3]
    lengths_at, pointers_at = 34, 34 + 4 * sequences
    documents_at = pointers_at + 8 * sequences
    if case == "magic":
        return b"NOTMMIDX\x00" + idx[9:]
    if case == "version":
        return _with_header(idx, version=2)
    if case == "dtype":
        return _with_header(idx, code=9)
    if case == "short header":
        return idx[:20]
    if case == "truncated arrays":
        return idx[:-8]
    if case == "trailing bytes":
        return idx + b"\x00" * 3
    if case == "pointer past end":
        return idx[: pointers_at + 8] + struct.pack("<q", 10**9) + idx[pointers_at + 16 :]
    if case == "pointer gap":
        (pointer,) = struct.unpack("<q", idx[pointers_at + 16 : pointers_at + 24])
        return idx[: pointers_at + 16] + struct.pack("<q", pointer + 2) + idx[pointers_at + 24 :]
    if case == "negative length":
        return idx[:lengths_at] + struct.pack("<i", -5) + idx[lengths_at + 4 :]
    if case == "documents decrease":
        return idx[: documents_at + 16] + struct.pack("<q", 0) + idx[documents_at + 24 :]
    if case == "documents out of range":
        return idx[:-8] + struct.pack("<q", sequences + 5)
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, message",
    [
        ("magic", "bad magic b'NOTMMIDX\\x00'"),
        ("version", "unsupported version 2"),
        ("dtype", "unknown dtype code 9"),
        ("short header", "shorter than the 34-byte header"),
        ("truncated arrays", "truncated"),
        ("trailing bytes", "unexpected bytes"),
        ("pointer past end", "sequence 1 ends at byte"),
        ("pointer gap", "pointer of sequence 2 does not follow"),
        ("negative length", "negative length"),
        ("documents decrease", "decrease"),
        ("documents out of range", "document indices must run"),
    ],
)
def test_corrupt_index_is_one_line_naming_the_file(good, case, message):
    idx = Path(f"{good}.idx")
    idx.write_bytes(_corrupt_idx(idx.read_bytes(), case))
    with pytest.raises(IndexFormatError) as raised:
        IndexedDataset(good)
    text = str(raised.value)
    assert message in text and "loom data build" in text and "\n" not in text
    assert str(idx) in text or f"{good}.bin" in text


def test_truncated_or_mismatched_bin_names_the_bin(good, tmp_path):
    data = Path(f"{good}.bin")
    data.write_bytes(data.read_bytes()[:-2])
    with pytest.raises(IndexFormatError, match=f"corrupt dataset {data}: sequence 9 ends"):
        IndexedDataset(good)
    data.write_bytes(data.read_bytes() + b"\x00" * 10)
    with pytest.raises(IndexFormatError, match="come from different builds"):
        IndexedDataset(good)


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_missing_file_is_named(good, missing, monkeypatch):
    Path(f"{good}{missing}").unlink()
    with pytest.raises(IndexFormatError, match=f"^{good}{missing} does not exist; .*loom data build"):
        IndexedDataset(good)
    monkeypatch.chdir(Path(good).parent)  # a relative path (a config.toml fed back from elsewhere) says where
    said = f"{Path(good).name}{missing} does not exist (in {Path.cwd()}: paths are relative to the working directory)"
    with pytest.raises(IndexFormatError, match=re.escape(said)):
        IndexedDataset(Path(good).name)


def test_empty_dataset_opens(tmp_path):
    with IndexedDatasetWriter(tmp_path / "empty", np.uint16):
        pass
    dataset = IndexedDataset(tmp_path / "empty")
    assert len(dataset) == 0 and dataset.num_documents == 0 and dataset.num_tokens == 0


MEGATRON_CROSS_READ = textwrap.dedent("""
    import sys, numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    ours, theirs = sys.argv[1], sys.argv[2]
    dataset = IndexedDataset(ours, mmap=True)
    print(len(dataset), dataset.document_indices.tolist(), [dataset[i].tolist() for i in range(len(dataset))])
    builder = IndexedDatasetBuilder(theirs + ".bin", dtype=numpy.int32)
    for doc in ([5, 6, 7], [], [70000, 1]):
        builder.add_document(numpy.array(doc, dtype=numpy.int32), [len(doc)])
    builder.finalize(theirs + ".idx")
""")


def _megatron_python() -> str | None:
    """An interpreter with megatron-core: this one, or the one in LOOM_MEGATRON_PYTHON."""
    candidate = os.environ.get("LOOM_MEGATRON_PYTHON")
    if candidate:
        return candidate
    try:
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def test_megatron_core_reads_ours_and_we_read_theirs(good, tmp_path):
    python = _megatron_python()
    if python is None:
        pytest.skip("megatron-core not installed (set LOOM_MEGATRON_PYTHON to an interpreter that has it)")
    theirs = tmp_path / "theirs"
    result = subprocess.run(
        [python, "-c", MEGATRON_CROSS_READ, str(good), str(theirs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ours = IndexedDataset(good)
    expected = f"{len(ours)} {ours.document_indices.tolist()} {[ours[i].tolist() for i in range(len(ours))]}"
    assert result.stdout.strip().splitlines()[-1] == expected
    dataset = IndexedDataset(theirs)
    assert dataset.dtype == np.int32 and list(dataset.document_indices) == [0, 1, 2, 3]
    assert [dataset[i].tolist() for i in range(3)] == [[5, 6, 7], [], [70000, 1]]


MEGATRON_WRITES = textwrap.dedent("""
    import json, sys, numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    documents, folder = json.loads(sys.argv[1]), sys.argv[2]
    for name in ("uint16", "int32"):
        dtype = getattr(numpy, name)
        for part, docs in (("a", documents[:3]), ("b", documents[3:])):
            builder = IndexedDatasetBuilder(f"{folder}/{name}-{part}.bin", dtype=dtype)
            for sequences in docs:
                builder.add_document(numpy.array(sum(sequences, []), dtype=dtype), [len(s) for s in sequences])
            builder.finalize(f"{folder}/{name}-{part}.idx")
        merged = IndexedDatasetBuilder(f"{folder}/{name}-merged.bin", dtype=dtype)
        for part in ("a", "b"):
            merged.add_index(f"{folder}/{name}-{part}")
        merged.finalize(f"{folder}/{name}-merged.idx")
""")


def test_our_files_are_megatron_cores_byte_for_byte(tmp_path):
    """The same documents written by megatron-core's IndexedDatasetBuilder and by loom's writer, in uint16 and int32,
    documents of several sequences and empty ones among them, and two datasets merged (add_index): the same .bin and
    .idx bytes. The cross-read above shows each reads the other; this, that nothing else differs."""
    python = _megatron_python()
    if python is None:
        pytest.skip("megatron-core not installed (set LOOM_MEGATRON_PYTHON to an interpreter that has it)")
    generator = np.random.default_rng(3)
    documents = [
        [generator.integers(0, 60_000, int(n)).tolist() for n in generator.integers(0, 40, generator.integers(1, 4))]
        for _ in range(6)
    ] + [[[]], [[7]]]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    result = subprocess.run(
        [python, "-c", MEGATRON_WRITES, json.dumps(documents), str(theirs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for dtype in (np.uint16, np.int32):
        name = np.dtype(dtype).name
        for part, docs in (("a", documents[:3]), ("b", documents[3:])):
            with IndexedDatasetWriter(tmp_path / f"{name}-{part}", dtype) as writer:
                for sequences in docs:
                    for sequence in sequences:
                        writer.add_sequence(np.array(sequence, dtype=dtype))
                    writer.end_document()
        with IndexedDatasetWriter(tmp_path / f"{name}-merged", dtype) as writer:
            for part in ("a", "b"):
                writer.add_index(tmp_path / f"{name}-{part}")
        for part in ("a", "b", "merged"):
            for suffix in (".bin", ".idx"):
                ours, megatrons = tmp_path / f"{name}-{part}{suffix}", theirs / f"{name}-{part}{suffix}"
                assert ours.read_bytes() == megatrons.read_bytes(), ours.name


def test_a_dataset_file_given_for_its_prefix_is_named_as_such(good):
    """--data.paths ds.bin said "ds.bin.idx does not exist"."""
    for suffix in (".bin", ".idx"):
        with pytest.raises(IndexFormatError, match=f"is a file of the dataset; give its prefix {good}$"):
            IndexedDataset(f"{good}{suffix}")

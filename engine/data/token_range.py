"""The range of token ids a dataset holds, computed once per .bin and cached, so every launcher can refuse
data tokenized with another vocabulary before a rank starts.

Without this check a .bin whose ids exceed model.vocab_size fails with an IndexError at tp = 1 and, worse,
trains "successfully" at tp > 1: the vocabulary-parallel embedding masks ids outside every rank's shard,
so the model sees zeros and the loss sits at ln(V). The .idx format (Megatron's) has no field for the range,
so it is cached as JSON beside the dataset's sample-index cache (or in data.cache_dir).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from loom.engine.atomic import write_text_atomically
from loom.engine.config import ConfigError
from loom.engine.data.indexed import IndexedDataset, default_cache_dir

CHUNK_BYTES = 256 << 20
SLOW_SCAN_BYTES = 2 << 30


def _cache_file(dataset: IndexedDataset, cache_dir: Path | None) -> Path:
    stat = dataset.bin_path.stat()
    identity = f"{dataset.bin_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{dataset.idx_path.stat().st_size}"
    folder = cache_dir if cache_dir is not None else default_cache_dir(dataset.prefix)
    return folder / f"token-range-{hashlib.sha256(identity.encode()).hexdigest()[:24]}.json"


def _scan(dataset: IndexedDataset) -> tuple[int, int]:
    if not dataset.num_tokens:
        return 0, -1
    tokens = np.memmap(dataset.bin_path, dtype=dataset.dtype, mode="r")
    if tokens.nbytes > SLOW_SCAN_BYTES:
        print(f"checking the token ids of {dataset.bin_path} ({tokens.nbytes / 2**30:.1f} GiB) once; cached after")
    step = max(1, CHUNK_BYTES // dataset.dtype.itemsize)
    chunks = [tokens[start : start + step] for start in range(0, len(tokens), step)]
    return min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)


def token_id_range(dataset: IndexedDataset, cache_dir: Path | None = None) -> tuple[int, int]:
    """(smallest, largest) token id in the dataset's .bin ((0, -1) when empty); cached, recomputed when the
    file changes. A cache that cannot be written (a read-only dataset folder) only costs the scan next time."""
    cache = _cache_file(dataset, cache_dir)
    try:
        saved = json.loads(cache.read_text())
        return int(saved["smallest_token_id"]), int(saved["largest_token_id"])
    except (OSError, ValueError, KeyError):
        pass
    smallest, largest = _scan(dataset)
    record = {"bin": os.fspath(dataset.bin_path), "smallest_token_id": smallest, "largest_token_id": largest}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(cache, json.dumps(record))
    except OSError:
        pass
    return smallest, largest


def check_dataset_token_ids(dataset: IndexedDataset, vocab_size: int, cache_dir: str | None = None) -> None:
    """Refuse, in one line, a dataset holding a token id the model's vocabulary does not have."""
    if dataset.dtype.kind == "u" and np.iinfo(dataset.dtype).max < vocab_size:
        return  # every id the dtype can hold fits the vocabulary
    smallest, largest = token_id_range(dataset, Path(cache_dir) if cache_dir else None)
    if smallest < 0:
        raise ConfigError(f"dataset {dataset.prefix} holds a negative token id ({smallest}); it is not token data")
    if largest >= vocab_size:
        raise ConfigError(
            f"dataset {dataset.prefix} holds token id {largest}, but model.vocab_size = {vocab_size}: it was "
            f"tokenized with a larger vocabulary (another tokenizer?); rebuild it with this model's tokenizer, or "
            f"set --model.vocab_size {largest + 1} if the model really has that many"
        )


def check_ids_within_tokenizer(paths: list[str], pieces: int, tokenizer: str, cache_dir: str | None = None) -> None:
    """Refuse a dataset holding a token id beyond `tokenizer`'s `pieces`: it was built with another tokenizer. The
    manifests' sha256 catch that for loom's datasets; this catches it for one without a manifest (Megatron-LM's,
    or a .bin/.idx copied without it), whose ids the model would otherwise train on as this tokenizer's."""
    for prefix in paths:
        largest = token_id_range(IndexedDataset(prefix), Path(cache_dir) if cache_dir else None)[1]
        if largest >= pieces:
            raise ConfigError(
                f"dataset {prefix} holds token id {largest}, but data.tokenizer {tokenizer} has {pieces} pieces: it "
                "was built with another tokenizer; give that one (or rebuild the dataset with this one)"
            )


def check_token_ids(paths: list[str], vocab_size: int, cache_dir: str | None = None) -> None:
    """check_dataset_token_ids for every dataset prefix in `paths`."""
    for prefix in paths:
        check_dataset_token_ids(IndexedDataset(prefix), vocab_size, cache_dir)

"""Training and validation batches for one rank: datasets from the config, and a resumable iterator.

The order of samples in the global batch is fixed by the seed (inside GPTDataset); each DP rank
reads its contiguous share of every global batch and cuts it into micro-batches, so the set of
samples per step never depends on the layout. The iterator's position (consumed samples) is all
the state it has. TP and PP ranks of one replica read the same samples straight from the mmap.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from loom.engine.config import LoomConfig
from loom.engine.data.blended import BlendedDataset
from loom.engine.data.gpt_dataset import GPTDataset, split_document_ranges
from loom.engine.data.indexed import DatasetError, IndexedDataset
from loom.engine.parallel.context import split_sequence

# Blended datasets draw up to this fraction more than their weight from each source.
_BLEND_MARGIN = 1.005


def _split_dataset(
    indexed: IndexedDataset,
    split_index: int,
    num_samples: int,
    config: LoomConfig,
    is_builder: bool,
    agree: Callable[[Exception | None], None] | None,
) -> GPTDataset | None:
    start, end = split_document_ranges(indexed.num_documents, config.data.split)[split_index]
    if end <= start:
        return None
    # Splits are by document; a document may span several sequences, which GPTDataset calls documents.
    sequences = np.arange(indexed.document_indices[start], indexed.document_indices[end], dtype=np.int64)
    cache_dir = Path(config.data.cache_dir) if config.data.cache_dir else None
    return GPTDataset(
        indexed,
        sequences,
        num_samples,
        config.train.seq_length,
        config.train.seed,  # every split uses the same seed, as megatron-core does
        cache_dir=cache_dir,
        is_builder=is_builder,
        agree=agree,
    )


def agree_across_ranks(failure: Exception | None) -> None:
    """GPTDataset's `agree` for the ranks of a launch: wait for every rank, then raise on each the first rank's
    failure, naming that rank and its host (a rank whose node does not share data.cache_dir failed alone, and
    rank 0 waited out parallel.timeout_minutes)."""
    failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if failure is None else (str(failure), socket.gethostname()))
    first = next((rank for rank, seen in enumerate(failures) if seen is not None), None)
    if first is None:
        return
    message, host = failures[first]
    raise DatasetError(f"rank {first} on {host}: {message}")


def build_dataset(
    config: LoomConfig,
    split_index: int,
    num_samples: int,
    is_builder: bool,
    agree: Callable[[Exception | None], None] | None,
):
    """Dataset for split 0 (train), 1 (valid) or 2 (test) with `num_samples` samples, or None if empty.

    The first rank builds index caches while the others wait in `agree` (GPTDataset says how).
    """
    paths = config.data.paths
    weights = config.data.weights or [1.0] * len(paths)
    total = sum(weights)
    parts = []
    for prefix, weight in zip(paths, weights):
        share = num_samples if len(paths) == 1 else math.ceil(weight / total * num_samples * _BLEND_MARGIN) + 1
        parts.append(_split_dataset(IndexedDataset(prefix), split_index, share, config, is_builder, agree))
    if len(parts) == 1:
        return parts[0]
    if any(p is None for p in parts):
        return None
    return BlendedDataset(parts, weights, num_samples)


def build_datasets(
    config: LoomConfig,
    with_train: bool,
    is_builder: bool,
    agree: Callable[[Exception | None], None] | None,
    resumed_at: tuple[int, int] | None = None,
):
    """(train, valid) datasets of a run as training reads them: train.steps global batches of training
    samples (None when not `with_train`), and train.eval_iters of validation samples when the run
    evaluates (None otherwise). `loom data index` calls it offline with is_builder and no agree.
    `resumed_at`: (step, consumed samples) of the checkpoint the run resumes from."""
    t = config.train
    check_splits(config, with_train)
    train = build_dataset(config, 0, training_samples(config, resumed_at), is_builder, agree) if with_train else None
    valid = None
    if evaluates(config, with_train):
        valid = build_dataset(config, 1, t.eval_iters * t.global_batch_size, is_builder, agree)
    return train, valid


def repeated_data(dataset, split: str = "training") -> list[str]:
    """For each dataset of `dataset` (a GPTDataset, or a blend of them, of the named split) read more than once:
    how many times, as a phrase (Megatron says so too; a small dataset was otherwise read again and again unsaid,
    and a small validation split averaged the same samples several times in each evaluation)."""
    if dataset is None:
        return []
    if isinstance(dataset, BlendedDataset):
        parts = zip(dataset.datasets, np.bincount(dataset.dataset_index, minlength=len(dataset.datasets)))
    else:
        parts = [(dataset, dataset.num_samples)]
    return [
        f"{part.indexed.prefix} {read / part.epoch.samples:.1f} times ({int(read):,} samples of the "
        f"{part.epoch.samples:,} an epoch of its {split} split holds; each epoch shuffled anew)"
        for part, read in parts
        if read > part.epoch.samples
    ]


def training_samples(config: LoomConfig, resumed_at: tuple[int, int] | None = None) -> int:
    """The training samples a run reads: train.steps global batches; resumed from a checkpoint that took larger
    batches (another train.global_batch_size before), its consumed samples and the steps left at today's batch."""
    t = config.train
    samples = t.steps * t.global_batch_size
    if resumed_at is not None:
        step, consumed = resumed_at
        samples = max(samples, consumed + max(0, t.steps - step) * t.global_batch_size)
    return samples


def evaluates(config: LoomConfig, with_train: bool) -> bool:
    """Whether the run reads validation samples: a training run that evaluates, or an evaluation."""
    return bool(config.train.eval_interval) or not with_train


def check_splits(config: LoomConfig, with_train: bool) -> None:
    """Refuse a data.split that leaves a dataset no training documents (when training) or no validation
    documents (when the run evaluates); cheap, so launchers call it before any rank starts."""
    for prefix in config.data.paths:
        documents = IndexedDataset(prefix).num_documents
        ranges = split_document_ranges(documents, config.data.split)
        (train_start, train_end), (valid_start, valid_end) = ranges[0], ranges[1]
        if with_train and train_end <= train_start:
            raise DatasetError(f"{prefix}: the training split {config.data.split!r} leaves it no documents")
        if evaluates(config, with_train) and valid_end <= valid_start:
            weights = [float(w) for w in config.data.split.split(",")]
            more = "a larger" if weights[1] > 0 else "a"  # a share it has already rounds to no document here
            advice = "" if not with_train else ", or turn evaluation off with --train.eval_interval 0"
            raise DatasetError(
                f"data.split = {config.data.split!r} leaves {prefix} ({documents:,} documents) no validation "
                f"documents: give the second weight {more} share (e.g. '90,10,0'){advice}"
            )


class BatchIterator:
    """Yields, per step, this DP rank's micro-batches (tokens, labels) of the next global batch.

    `batch_size_at(consumed_samples)` gives each step's global batch (constant, or ramping up). Under context
    parallelism (`cp` > 1) each CP rank keeps its two chunks of every sequence (engine/parallel/context.py).
    """

    def __init__(
        self,
        dataset,
        batch_size_at: Callable[[int], int],
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        cp_rank: int = 0,
        cp_size: int = 1,
        seq_length: int = 0,
    ):
        self.dataset, self.batch_size_at = dataset, batch_size_at
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.consumed_samples = consumed_samples
        # Counted, not derived from the samples: a run resumed at another train.seq_length keeps its earlier tokens.
        self.seq_length = seq_length
        self.consumed_tokens = consumed_samples * seq_length

    def next_step(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        global_batch = self.batch_size_at(self.consumed_samples)
        per_rank = global_batch // self.dp_size
        first = self.consumed_samples + self.dp_rank * per_rank
        self.consumed_samples += global_batch
        self.consumed_tokens += global_batch * self.seq_length
        microbatches = []
        for start in range(first, first + per_rank, self.micro_batch_size):
            samples = np.stack([self.dataset[i] for i in range(start, start + self.micro_batch_size)])
            batch = torch.from_numpy(samples.astype(np.int64))
            if device.type == "cuda":  # from pageable memory the copy can make the host wait for the GPU's queue
                batch = batch.pin_memory()
            batch = batch.to(device, non_blocking=True)
            tokens, labels = batch[:, :-1], batch[:, 1:]
            if self.cp_size > 1:
                tokens, labels = (split_sequence(t, self.cp_size, self.cp_rank, dim=1) for t in (tokens, labels))
            microbatches.append((tokens, labels))
        return microbatches

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_tokens}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.consumed_tokens = int(state.get("consumed_tokens", self.consumed_samples * self.seq_length))

"""BlendedDataset: several datasets mixed with exact weights, in megatron-core's order.

Megatron's rule: sample i comes from the dataset whose error, weight * max(i, 1) - samples drawn
from it so far, is largest (ties to the lowest index), with weights normalised in float64. Every
prefix of the blend is then as close to the weights as whole samples allow.

The rule is a sequential recurrence; a Python loop over it costs about half a second per million
samples. `blend_indices` computes the identical sequence in numpy by cutting the samples into
segments and running all segments in lock step: each segment starts from an estimate of the draw
counts a few dozen steps before its start (the greedy forgets where it started within a few
steps), and a segment is accepted only when its counts at its first sample equal the counts the
previous, already exact, segment ended with. Segments that fail are re-run from that exact state,
so the result is exact by induction, whatever the estimate. This module must not read tokens
itself: it only maps a sample number to (dataset, sample in that dataset).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from loom.engine.data.indexed import DatasetError

MAX_DATASETS = int(np.iinfo(np.int16).max)
_SEGMENT = 512
_WARMUP = 64
_MAX_PASSES = 4
# Below this many samples the plain loop beats the lock-step segments' fixed cost.
_LOOP_BELOW = 8192


def normalise_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights divided by their sum in float64, exactly as megatron-core does."""
    if len(weights) == 0:
        raise ValueError("blending needs at least one weight")
    if any(not (math.isfinite(w) and w > 0) for w in weights):
        raise DatasetError(f"blending weights must be positive finite numbers, got {list(weights)}")
    array = np.asarray(weights, dtype=np.float64)
    return array / np.sum(array)


def _estimate_counts(weights: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Largest-remainder apportionment of `steps` draws: within a draw or so of the greedy's counts."""
    ideal = np.outer(steps.astype(np.float64), weights)
    counts = np.floor(ideal).astype(np.int64)
    missing = steps - counts.sum(axis=1)
    rank = np.argsort(np.argsort(counts - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    counts += rank < missing[:, None]
    return counts


def _run_greedy(
    weights: np.ndarray, counts: np.ndarray, first_steps: np.ndarray, length: int, record: bool
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Advance every row of `counts` (in place) by `length` greedy draws; row r starts at first_steps[r].

    The error is computed with the same float64 operations as megatron-core's C++ loop, and argmax
    keeps the first maximum, matching its strict `>`; that is what makes the sequences identical.
    """
    rows = np.arange(len(counts))
    choices = np.empty((len(counts), length), np.int16) if record else None
    drawn = np.empty((len(counts), length), np.int64) if record else None
    for t in range(length):
        scale = np.maximum(first_steps + t, 1).astype(np.float64)
        picked = np.argmax(weights[None, :] * scale[:, None] - counts, axis=1)
        if record:
            choices[:, t] = picked
            drawn[:, t] = counts[rows, picked]
        counts[rows, picked] += 1
    return choices, drawn


def _greedy_loop(weights: np.ndarray, counts: list[int], first_step: int, length: int) -> tuple[list, list]:
    """The rule itself, one sample at a time: the fallback when segments keep disagreeing."""
    w = weights.tolist()
    choices, drawn = [], []
    for i in range(first_step, first_step + length):
        scale = float(max(i, 1))
        errors = [w[d] * scale - counts[d] for d in range(len(w))]
        best = errors.index(max(errors))
        choices.append(best)
        drawn.append(counts[best])
        counts[best] += 1
    return choices, drawn


def blend_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of the first `size` samples of the blend."""
    w = normalise_weights(weights)
    if len(w) > MAX_DATASETS:
        raise ValueError(f"at most {MAX_DATASETS} datasets can be blended, got {len(w)}")
    if size <= _LOOP_BELOW:
        choices, drawn = _greedy_loop(w, [0] * len(w), 0, max(size, 0))
        return np.asarray(choices, dtype=np.int16), np.asarray(drawn, dtype=np.int64)
    segments = -(-size // _SEGMENT)
    starts = np.arange(segments, dtype=np.int64) * _SEGMENT
    begin = np.zeros((segments, len(w)), dtype=np.int64)
    if segments > 1:
        warm = _estimate_counts(w, starts[1:] - _WARMUP)
        _run_greedy(w, warm, starts[1:] - _WARMUP, _WARMUP, record=False)
        begin[1:] = warm
    end = begin.copy()
    choices, drawn = _run_greedy(w, end, starts, _SEGMENT, record=True)
    for attempt in range(_MAX_PASSES + 1):
        wrong = np.flatnonzero(np.any(begin[1:] != end[:-1], axis=1)) + 1
        if len(wrong) == 0:
            return choices.reshape(-1)[:size].copy(), drawn.reshape(-1)[:size].copy()
        if attempt == _MAX_PASSES:
            break
        # The first wrong segment follows an exact one, so each pass fixes at least one more.
        begin[wrong] = end[wrong - 1]
        state = begin[wrong].copy()
        choices[wrong], drawn[wrong] = _run_greedy(w, state, starts[wrong], _SEGMENT, record=True)
        end[wrong] = state
    return _finish_sequentially(w, size, begin, end, choices, drawn)


def _finish_sequentially(
    w: np.ndarray, size: int, begin: np.ndarray, end: np.ndarray, choices: np.ndarray, drawn: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    first_wrong = int(np.flatnonzero(np.any(begin[1:] != end[:-1], axis=1))[0]) + 1
    start = first_wrong * _SEGMENT
    tail_choices, tail_drawn = _greedy_loop(w, end[first_wrong - 1].tolist(), start, size - start)
    dataset_index = choices.reshape(-1)[:size].copy()
    sample_index = drawn.reshape(-1)[:size].copy()
    dataset_index[start:] = tail_choices
    sample_index[start:] = tail_drawn
    return dataset_index, sample_index


class BlendedDataset:
    """`blend[i]` is `datasets[dataset_index[i]][dataset_sample_index[i]]`."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        if len(datasets) != len(weights):
            raise DatasetError(f"{len(weights)} blending weights for {len(datasets)} datasets; give one per dataset")
        if size < 0:
            raise ValueError(f"a blend needs a non-negative size, got {size}")
        self.datasets, self.weights, self.size = datasets, list(weights), size
        self.dataset_index, self.dataset_sample_index = blend_indices(weights, size)
        needed = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, dataset in enumerate(datasets):
            if needed[d] > len(dataset):
                raise DatasetError(
                    f"the blend draws {needed[d]} samples from dataset {d} but it has {len(dataset)}; "
                    f"build it with more samples"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.size <= i < self.size:
            raise IndexError(f"sample {i} outside a blend of {self.size}")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

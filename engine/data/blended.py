"""BlendedDataset: several datasets mixed with exact weights, in megatron-core's order.

Megatron's rule: sample i comes from the dataset whose error, weight * max(i, 1) - samples drawn
from it so far, is largest (ties to the lowest index), with weights normalised in float64. Every
prefix of the blend is then as close to the weights as whole samples allow.

The rule is a sequential recurrence; a Python loop over it costs about half a second per million
samples. `blend_indices` computes the identical sequence in numpy by cutting the samples into
segments of 128 and running all segments in lock step, one dataset at a time over all segments (so
each numpy call works on a long array): each segment starts from an estimate of the draw counts a
few dozen steps before its start (the greedy forgets where it started within a few steps), and a
segment is accepted only when its counts at its first sample equal the counts the previous, already
exact, segment ended with. Segments that fail are re-run from that exact state (in lock step for a
few passes, then one by one: a dataset with a tiny weight can leave long runs of wrong estimates),
so the result is exact by induction, whatever the estimate. This module must not read tokens
itself: it only maps a sample number to (dataset, sample in that dataset).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from loom.engine.data.indexed import DatasetError

MAX_DATASETS = int(np.iinfo(np.int16).max)
_SEGMENT = 128
_WARMUP = 32
_MAX_PASSES = 4
# Below this many samples the plain loop beats the lock-step segments' fixed cost.
_LOOP_BELOW = 2048


def normalise_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights divided by their sum in float64, exactly as megatron-core does (a zero weight is allowed)."""
    if len(weights) == 0:
        raise ValueError("blending needs at least one weight")
    if any(not (math.isfinite(w) and w >= 0) for w in weights) or not any(w > 0 for w in weights):
        raise DatasetError(f"blending weights must be non-negative finite numbers, one positive, got {list(weights)}")
    array = np.asarray(weights, dtype=np.float64)
    return array / np.sum(array)


def _estimate_counts(weights: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Largest-remainder apportionment of `steps` draws, (datasets, rows) as float64: within a draw or so
    of the greedy's counts."""
    ideal = np.outer(steps.astype(np.float64), weights)
    counts = np.floor(ideal)
    missing = steps - counts.sum(axis=1)
    rank = np.argsort(np.argsort(counts - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    counts += rank < missing[:, None]
    return np.ascontiguousarray(counts.T)


def _run_greedy(
    weights: np.ndarray, counts: np.ndarray, first_steps: np.ndarray, length: int, record: bool
) -> np.ndarray | None:
    """Advance every column of `counts` (datasets × rows, float64, in place) by `length` greedy draws;
    column r starts at step first_steps[r]. Returns the choices (length × rows) when `record`.

    Datasets are compared one at a time over whole rows, so every numpy call runs on a long
    contiguous array. The error is computed with the same float64 operations as megatron-core's C++
    loop (weight * max(step, 1) - count), and a later dataset wins only when strictly greater, as
    its `>`; that is what makes the sequences identical. The winner is then the largest d that beat
    the running best, kept with a max over small integers (a masked copy costs ten times more).
    Counts are exact in float64 (below 2**53)."""
    rows, pick_type = counts.shape[1], _pick_type(len(weights))
    choices = np.empty((length, rows), pick_type) if record else None
    first = first_steps.astype(np.float64)
    at_zero = np.flatnonzero(first_steps <= 0)
    scale, best, error = np.empty(rows), np.empty(rows), np.empty(rows)
    greater = np.empty(rows, bool)
    picked, candidate = np.empty(rows, pick_type), np.empty(rows, pick_type)
    for t in range(length):
        np.add(first, t, out=scale)
        if len(at_zero):
            scale[at_zero] = np.maximum(scale[at_zero], 1.0)
        np.multiply(scale, weights[0], out=best)
        best -= counts[0]
        picked.fill(0)
        for d in range(1, len(weights)):
            np.multiply(scale, weights[d], out=error)
            error -= counts[d]
            np.greater(error, best, out=greater)
            np.maximum(best, error, out=best)
            np.multiply(greater.view(np.uint8), d, out=candidate, dtype=pick_type)
            np.maximum(picked, candidate, out=picked)
        for d in range(len(weights)):
            np.equal(picked, d, out=greater)
            counts[d] += greater
        if record:
            choices[t] = picked
    return choices


def _pick_type(datasets: int) -> type:
    return np.uint8 if datasets <= 256 else np.uint16


def _greedy_loop(weights: np.ndarray, counts: list[int], first_step: int, length: int) -> list[int]:
    """The rule itself, one sample at a time: short blends, and the fallback when segments keep disagreeing."""
    w = weights.tolist()
    choices = []
    for i in range(first_step, first_step + length):
        scale = float(max(i, 1))
        errors = [w[d] * scale - counts[d] for d in range(len(w))]
        best = errors.index(max(errors))
        choices.append(best)
        counts[best] += 1
    return choices


def _sample_numbers(dataset_index: np.ndarray, datasets: int) -> np.ndarray:
    """For each sample, how many earlier samples came from its dataset (its index in that dataset)."""
    numbers = np.empty(len(dataset_index), np.int64)  # every sample is one dataset's: all are written
    for d in range(datasets):
        chosen = dataset_index == d
        numbers[chosen] = np.arange(np.count_nonzero(chosen))  # a boolean mask beats flatnonzero + scatter
    return numbers


def blend_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of the first `size` samples of the blend."""
    w = normalise_weights(weights)
    if len(w) > MAX_DATASETS:
        raise ValueError(f"at most {MAX_DATASETS} datasets can be blended, got {len(w)}")
    if size <= _LOOP_BELOW:
        dataset_index = np.asarray(_greedy_loop(w, [0] * len(w), 0, max(size, 0)), dtype=np.int16)
    else:
        dataset_index = _blend_in_segments(w, size)
    return dataset_index, _sample_numbers(dataset_index, len(w))


def _blend_in_segments(w: np.ndarray, size: int) -> np.ndarray:
    segments = -(-size // _SEGMENT)
    starts = np.arange(segments, dtype=np.int64) * _SEGMENT
    begin = np.zeros((len(w), segments))
    if segments > 1:
        warm_from = np.maximum(starts[1:] - _WARMUP, 0)
        warm = _estimate_counts(w, warm_from)
        _run_greedy(w, warm, warm_from, _WARMUP, record=False)
        begin[:, 1:] = warm
    end = begin.copy()
    choices = _run_greedy(w, end, starts, _SEGMENT, record=True)
    for _ in range(_MAX_PASSES):
        wrong = _wrong_segments(begin, end)
        if len(wrong) == 0:
            break
        # The first wrong segment follows an exact one, so each pass fixes at least one more.
        begin[:, wrong] = end[:, wrong - 1]
        state = begin[:, wrong].copy()
        choices[:, wrong] = _run_greedy(w, state, starts[wrong], _SEGMENT, record=True)
        end[:, wrong] = state
    _fix_one_by_one(w, begin, end, choices, _wrong_segments(begin, end))
    return choices.T.reshape(-1)[:size].astype(np.int16)


def _wrong_segments(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Segments that did not start where their predecessor ended (segment 0 starts exact)."""
    return np.flatnonzero(np.any(begin[:, 1:] != end[:, :-1], axis=0)) + 1


def _fix_one_by_one(w: np.ndarray, begin: np.ndarray, end: np.ndarray, choices: np.ndarray, wrong: np.ndarray) -> None:
    """Re-run the wrong segments in order with the plain loop, each from its exact predecessor.

    A dataset with a tiny weight (drawn once in hundreds of segments) can leave a run of segments
    whose estimates agree with each other but not with the truth, which the lock-step passes fix one
    segment per pass. Here a fixed segment's successor is checked next, and the walk jumps to the next
    segment known to be wrong once they agree again: segments after that whose predecessor did not
    change are still right."""
    pending = iter(wrong.tolist())
    segment = next(pending, None)
    while segment is not None:
        counts = [int(c) for c in end[:, segment - 1]]
        begin[:, segment] = counts
        choices[:, segment] = _greedy_loop(w, counts, segment * _SEGMENT, _SEGMENT)
        end[:, segment] = counts
        following = segment + 1
        if following < begin.shape[1] and np.any(begin[:, following] != end[:, segment]):
            segment = following
            continue
        segment = next((s for s in pending if s > segment), None)


class BlendedDataset:
    """`blend[i]` is `datasets[dataset_index[i]][dataset_sample_index[i]]`."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        if len(datasets) != len(weights):
            raise DatasetError(f"{len(weights)} blending weights for {len(datasets)} datasets; give one per dataset")
        if size < 0:
            raise ValueError(f"a blend needs a non-negative size, got {size}")
        if any(not (math.isfinite(w) and w > 0) for w in weights):
            # blend_indices follows megatron-core for a zero weight too, but a dataset listed with weight 0
            # in a training config is a mistake (megatron-core may still draw from it on a tie).
            raise DatasetError(f"blending weights must be positive finite numbers, got {list(weights)}")
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

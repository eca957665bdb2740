"""BlendedDataset: several datasets mixed with exact weights, in megatron-core's order.

Megatron's rule: sample i comes from the dataset whose error, weight * max(i, 1) - samples drawn
from it so far, is largest (ties to the lowest index), with weights normalised in float64. Every
prefix of the blend is then as close to the weights as whole samples allow.

The rule is a sequential recurrence; a Python loop over it costs about half a second per million
samples. `blend_indices` computes the identical sequence in numpy by cutting the samples into
segments of 64 and running many segments in lock step, one dataset at a time over all of them (so
each numpy call works on a long array; a group of 16,384 segments keeps those arrays in the CPU's
cache). Each segment starts from an estimate of the draw counts a few steps before its start (the
greedy forgets where it started within a few steps), and is accepted only when its counts at its
first sample equal the counts the previous, already exact, segment ended with. Segments that fail
are re-run from that exact state (in lock step while many are wrong, then one by one: a dataset with
a tiny weight can carry a wrong draw through many segments), so the result is exact by induction,
whatever the estimate. Each step reads every segment's pick and its number in that dataset in one
gather, so the sample numbers cost no second pass. This module must not read tokens itself: it only
maps a sample number to (dataset, sample in that dataset).

Measured against megatron-core's C++ helper in one process (tools/bench/dataset_index.py), 1M samples:
0.85-0.94x its time for 2-4 datasets, 1.2x for 8, 1.45x for 16. The cost per dataset is what numpy
costs per element (four float and two byte passes per dataset and step over every segment's row,
~2 ns per sample and dataset against the C++ loop's ~1.5 ns); the Python loop takes 90x. Slow case:
datasets drawn less than once in hundreds of segments (weights below ~1e-4 beside large ones) leave
long runs of segments whose estimates agree with each other but not with the truth, fixed one segment
per pass: lognormal(0, 3) weights over 16 datasets (smallest 1e-6) take 8x the helper's time (0.25 s
per 1M samples), one weight of 1e-7 beside 1e-4 and 0.1-0.4 16x, weights spread from 1e-9 to 0.17 32x
(0.9 s). Propagating a repaired segment's correction along the run after it breaks right segments: the
runs are not shifted copies of the truth.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from loom.engine.data.indexed import DatasetError

MAX_DATASETS = int(np.iinfo(np.int16).max)
_SEGMENT = 64
_WARMUP = 4
# Steps into a re-run segment after which its state is compared with the first run's at that step:
# equal means the rest of the segment was right, so only these steps are recorded again.
_CHECKPOINT = 8
# Steps of picks gathered before they are written out (see _advance).
_BLOCK = 16
# Segments run in lock step at once: above this the working arrays leave the cache and each call slows.
_ROWS = 16384
# Lock-step passes over the wrong segments: a pass costs about as much as re-running _PASS_FROM
# segments one by one and fixes at least the first of every run of wrong ones, so passes go on while
# that many are wrong (a long run of wrong segments takes a pass per segment, up to _MAX_PASSES).
_PASS_FROM = 16
_MAX_PASSES = 256
# Up to this many datasets the estimate ranks remainders pairwise, above by sorting.
_RANK_PAIRWISE_UP_TO = 32
# Datasets whose errors one call computes: more means fewer calls, too many push the rows out of the cache.
_CHUNK = 4
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
    ideal = np.multiply.outer(weights, steps.astype(np.float64))
    counts = np.floor(ideal)
    remainder = np.subtract(ideal, counts, out=ideal)
    missing = steps - counts.sum(axis=0)
    datasets, rows = counts.shape
    if datasets > _RANK_PAIRWISE_UP_TO:
        order = np.argsort(-remainder, axis=0, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(datasets)[:, None], axis=0)
        counts += rank < missing
        return counts
    # A dataset's rank among the remainders (ties to the lower index) by pairwise comparison: D*D passes
    # over the rows cost less than sorting many D-long rows.
    missing = missing.astype(np.int16)
    rank, beaten, gets = np.empty(rows, np.int16), np.empty(rows, bool), np.empty(rows, bool)
    for d in range(datasets):
        rank.fill(0)
        for other in range(datasets):
            if other != d:
                (np.greater if other > d else np.greater_equal)(remainder[other], remainder[d], out=beaten)
                np.add(rank, beaten.view(np.uint8), out=rank, casting="unsafe")
        np.less(rank, missing, out=gets)
        counts[d] += gets
    return counts


def _advance(
    weights: np.ndarray,
    counts: np.ndarray,
    first_steps: np.ndarray,
    steps: range,
    out: tuple[np.ndarray, np.ndarray, slice | np.ndarray] | None = None,
) -> None:
    """Advance every column of `counts` (datasets x rows, float64, in place) over `steps`, offsets from
    each row's first step: row r draws sample first_steps[r] + offset. With `out` = (dataset_index,
    sample_index, where), both (segments x _SEGMENT) and `where` naming the segments the rows are,
    each row's picks and the numbers they draw are written at [where, offset].

    Datasets are compared one at a time over whole rows, so every numpy call runs on a long
    contiguous array. The error is computed with the same float64 operations as megatron-core's C++
    loop (weight * max(step, 1) - count), and a later dataset wins only when strictly greater, as
    its `>`; that is what makes the sequences identical. The winner is then the largest d that beat
    the running best, kept with a max over small integers (a masked copy costs ten times more).
    Counts are exact in float64 (below 2**53)."""
    datasets, rows = counts.shape
    pick_type = _pick_type(datasets)
    flat = counts.reshape(-1)
    first = first_steps.astype(np.float64)
    at_zero = np.flatnonzero(first_steps == 0)
    row_offsets = np.arange(rows, dtype=np.intp)
    scale = np.empty(rows)
    greater = np.empty(rows, bool)
    candidate = np.empty(rows, pick_type)
    position = np.empty(rows, np.intp)
    errors = np.empty((datasets, rows))
    # Errors are computed a few datasets per call (fewer calls than one per dataset), each group just
    # before it is compared, so the rows stay in the cache however many datasets there are.
    groups = [
        (weights[low : low + _CHUNK, None], counts[low : low + _CHUNK], errors[low : low + _CHUNK], low)
        for low in range(0, datasets, _CHUNK)
    ]
    best = errors[0]  # the running maximum overwrites dataset 0's error, which is not needed again
    bytewise = pick_type is np.uint8  # then dataset 1's comparison is written as the picks themselves
    # Picks and numbers go out in blocks of steps: a block fills whole cache lines of each output row,
    # where writing one step at a time would touch a line per row per step.
    block = min(_BLOCK, len(steps))
    picks, numbers = np.empty((block, rows), pick_type), np.empty((block, rows))
    for t in steps:
        j = (t - steps.start) % block
        np.add(first, t, out=scale)
        if t == 0 and len(at_zero):
            scale[at_zero] = 1.0  # max(step, 1): only a row's step 0 can be below 1
        picked = picks[j]
        if datasets == 1 or not bytewise:
            picked.fill(0)
        for column, drawn_so_far, part, low in groups:
            np.multiply(column, scale, out=part)
            np.subtract(part, drawn_so_far, out=part)
            for d in range(max(low, 1), low + len(part)):
                if d == 1 and bytewise:
                    np.greater(errors[1], best, out=picked.view(bool))
                else:
                    np.greater(errors[d], best, out=greater)
                    np.multiply(greater.view(np.uint8), d, out=candidate, dtype=pick_type)
                    np.maximum(picked, candidate, out=picked)
                if d < datasets - 1:
                    np.maximum(best, errors[d], out=best)
        # The picked count sits at picked * rows + row of the flattened counts: one gather reads every
        # row's sample number and one unbuffered add counts the draw.
        np.copyto(position, picked)
        position *= rows
        position += row_offsets
        np.take(flat, position, out=numbers[j], mode="clip")
        np.add.at(flat, position, 1.0)
        if out is not None and (j == block - 1 or t == steps.stop - 1):
            dataset_index, sample_index, where = out
            written = slice(t - j, t + 1)
            dataset_index[where, written] = picks[: j + 1].T
            sample_index[where, written] = numbers[: j + 1].T


def _pick_type(datasets: int) -> type:
    return np.uint8 if datasets <= 256 else np.uint16


def _greedy_loop(weights: np.ndarray, counts: list[int], first_step: int, length: int) -> tuple[list[int], list[int]]:
    """The rule itself, one sample at a time: short blends, and the fallback when segments keep disagreeing.
    Returns each sample's dataset and its number in that dataset; `counts` is advanced in place."""
    w = weights.tolist()
    choices, numbers = [], []
    for i in range(first_step, first_step + length):
        scale = float(max(i, 1))
        errors = [w[d] * scale - counts[d] for d in range(len(w))]
        best = errors.index(max(errors))
        choices.append(best)
        numbers.append(counts[best])
        counts[best] += 1
    return choices, numbers


def blend_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of the first `size` samples of the blend."""
    w = normalise_weights(weights)
    if len(w) > MAX_DATASETS:
        raise ValueError(f"at most {MAX_DATASETS} datasets can be blended, got {len(w)}")
    if size <= _LOOP_BELOW:
        choices, numbers = _greedy_loop(w, [0] * len(w), 0, max(size, 0))
        return np.asarray(choices, dtype=np.int16), np.asarray(numbers, dtype=np.int64)
    return _blend_in_segments(w, size)


def _blend_in_segments(w: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    segments = -(-size // _SEGMENT)
    starts = np.arange(segments, dtype=np.int64) * _SEGMENT
    dataset_index = np.empty((segments, _SEGMENT), np.int16)
    sample_index = np.empty((segments, _SEGMENT), np.int64)
    begin, checkpoint, end = (np.empty((len(w), segments)) for _ in range(3))
    # Segments go through in groups small enough for a group's working rows to stay in the CPU's cache.
    for first in range(0, segments, _ROWS):
        group = slice(first, min(first + _ROWS, segments))
        warm_from = np.maximum(starts[group] - _WARMUP, 0)
        state = _estimate_counts(w, warm_from)
        _advance(w, state, warm_from, range(_WARMUP))
        if first == 0:
            state[:, 0] = 0.0  # segment 0 starts from nothing drawn, exactly
        begin[:, group] = state
        out = (dataset_index, sample_index, group)
        _advance(w, state, starts[group], range(_CHECKPOINT), out)
        checkpoint[:, group] = state
        _advance(w, state, starts[group], range(_CHECKPOINT, _SEGMENT), out)
        end[:, group] = state
    for _ in range(_MAX_PASSES):
        wrong = _wrong_segments(begin, end)
        if len(wrong) < _PASS_FROM:
            break
        # The first wrong segment follows an exact one, so each pass fixes at least one more.
        begin[:, wrong] = end[:, wrong - 1]
        _rerun(w, starts, begin, checkpoint, end, dataset_index, sample_index, wrong)
    _fix_one_by_one(w, begin, end, dataset_index, sample_index, _wrong_segments(begin, end))
    return dataset_index.reshape(-1)[:size], sample_index.reshape(-1)[:size]


def _rerun(
    w: np.ndarray,
    starts: np.ndarray,
    begin: np.ndarray,
    checkpoint: np.ndarray,
    end: np.ndarray,
    dataset_index: np.ndarray,
    sample_index: np.ndarray,
    segments: np.ndarray,
) -> None:
    """Run `segments` again from their `begin`. One whose state after _CHECKPOINT steps equals the last
    run's has the rest of its steps, and its end, right already (a greedy that starts a few draws off
    usually rejoins the true sequence within a few steps), so only the others run on."""
    state = begin[:, segments].copy()
    _advance(w, state, starts[segments], range(_CHECKPOINT), (dataset_index, sample_index, segments))
    diverged = np.flatnonzero(np.any(state != checkpoint[:, segments], axis=0))
    if len(diverged) == 0:
        return
    segments, state = segments[diverged], np.ascontiguousarray(state[:, diverged])
    checkpoint[:, segments] = state
    _advance(w, state, starts[segments], range(_CHECKPOINT, _SEGMENT), (dataset_index, sample_index, segments))
    end[:, segments] = state


def _wrong_segments(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Segments that did not start where their predecessor ended (segment 0 starts exact)."""
    return np.flatnonzero(np.any(begin[:, 1:] != end[:, :-1], axis=0)) + 1


def _fix_one_by_one(
    w: np.ndarray,
    begin: np.ndarray,
    end: np.ndarray,
    dataset_index: np.ndarray,
    sample_index: np.ndarray,
    wrong: np.ndarray,
) -> None:
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
        dataset_index[segment], sample_index[segment] = _greedy_loop(w, counts, segment * _SEGMENT, _SEGMENT)
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

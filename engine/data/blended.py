"""BlendedDataset: several datasets mixed with exact weights (Megatron's greedy error-minimising order).

Sample i comes from the dataset whose share is furthest behind its weight at that point,
weight * max(i, 1) - drawn so far (ties to the lowest index), so every prefix of the blend is as
close to the weights as whole samples allow, and the order is deterministic.
"""

from __future__ import annotations

import numpy as np


def blend_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for `size` samples."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"blending weights must be positive, got {weights}")
    total = float(sum(weights))
    normalised = [w / total for w in weights]
    drawn = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    candidates = range(len(weights))
    for i in range(size):
        scale = max(i, 1)
        chosen = max(candidates, key=lambda d: (normalised[d] * scale - drawn[d], -d))
        dataset_index[i] = chosen
        sample_index[i] = drawn[chosen]
        drawn[chosen] += 1
    return dataset_index, sample_index


class BlendedDataset:
    def __init__(self, datasets: list, weights: list[float], size: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(weights)} blending weights for {len(datasets)} datasets")
        self.datasets, self.size = datasets, size
        self.dataset_index, self.dataset_sample_index = blend_indices(weights, size)
        for d, dataset in enumerate(datasets):
            needed = int(np.count_nonzero(self.dataset_index == d))
            if needed > len(dataset):
                raise ValueError(f"blend needs {needed} samples from dataset {d} but it has {len(dataset)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]

"""Union-find over document indices in one int64 array, joined a batch of pairs at a time.

numpy throughout: no Python loop per pair.

Every link points from a larger index to a smaller one, so the root of a cluster is always its
first document in input order: the one dedup keeps. Memory is 8 bytes per document whatever the
number of pairs; pairs arrive in batches (one LSH bucket, one k-means cluster) and are not kept.
This module must not know where pairs come from.
"""

from __future__ import annotations

import numpy as np


class UnionFind:
    """Clusters of `size` documents; `union(a, b)` joins pairs, `representatives()` names each one's root."""

    def __init__(self, size: int):
        self.parent = np.arange(size, dtype=np.int64)

    def find(self, nodes: np.ndarray) -> np.ndarray:
        """Roots of `nodes`, by pointer jumping (all nodes at once); compresses the paths it walks."""
        nodes = np.asarray(nodes, dtype=np.int64)
        roots = self.parent[nodes]
        while True:
            grand = self.parent[roots]
            if np.array_equal(grand, roots):
                break
            roots = grand
        self.parent[nodes] = roots
        return roots

    def union(self, a: np.ndarray, b: np.ndarray) -> None:
        """Join every pair (a[i], b[i])."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        while len(a):
            root_a, root_b = self.find(a), self.find(b)
            apart = root_a != root_b
            if not apart.any():
                return
            a, b, root_a, root_b = a[apart], b[apart], root_a[apart], root_b[apart]
            low, high = np.minimum(root_a, root_b), np.maximum(root_a, root_b)
            # Several pairs may hook the same root in one round; the smallest target wins and the
            # others are retried next round against the merged roots, so no pair is lost.
            np.minimum.at(self.parent, high, low)

    def representatives(self) -> np.ndarray:
        """For every document, the first document of its cluster (itself when it is kept)."""
        while True:
            grand = self.parent[self.parent]
            if np.array_equal(grand, self.parent):
                return self.parent
            self.parent = grand

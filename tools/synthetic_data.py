"""A small learnable token corpus written as .bin/.idx: documents from a fixed random Markov chain.

Real structure (unlike uniform noise) makes the loss fall, so training curves are informative
when layouts are compared.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loom.engine.data.indexed import IndexedDatasetWriter


def write_markov_dataset(prefix: Path, vocab_size: int, num_documents: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    # Each token has a handful of likely successors: a sparse, learnable transition table.
    successors = rng.integers(0, vocab_size, size=(vocab_size, 4))
    with IndexedDatasetWriter(prefix, np.dtype(np.uint16)) as writer:
        for _ in range(num_documents):
            length = int(rng.integers(20, 400))
            tokens = np.empty(length, dtype=np.int64)
            tokens[0] = rng.integers(0, vocab_size)
            choices = rng.integers(0, 4, size=length)
            for i in range(1, length):
                tokens[i] = successors[tokens[i - 1], choices[i]]
            writer.add_document(tokens)
    return str(prefix)

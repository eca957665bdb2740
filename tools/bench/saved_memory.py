"""What autograd holds for backward, measured: the bytes of the distinct storages saved by a training step
(weights excluded), now and at their peak. The planner's activation model is checked against it
(tests/test_plan_bytes.py) and tools/bench/context_memory.py measures context parallelism with it. Use as
`torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda held: held.tensor)`.
"""

from __future__ import annotations

import torch


class SavedForBackward:
    """Bytes of the distinct storages autograd holds for backward (weights excluded), now and at their peak:
    a storage counts from its first save until autograd drops the last of its saves."""

    def __init__(self, weights: set[int]):
        self.weights, self.saves, self.nbytes, self.now, self.peak = weights, {}, {}, 0, 0

    def pack(self, tensor):
        return _Saved(self, tensor)


class _Saved:
    def __init__(self, ledger: SavedForBackward, tensor: torch.Tensor):
        self.ledger, self.tensor = ledger, tensor
        storage = tensor.untyped_storage()
        self.key = storage.data_ptr() if storage.data_ptr() not in ledger.weights and storage.nbytes() else None
        if self.key is None:
            return
        if not ledger.saves.get(self.key):
            ledger.nbytes[self.key] = storage.nbytes()
            ledger.now += storage.nbytes()
            ledger.peak = max(ledger.peak, ledger.now)
        ledger.saves[self.key] = ledger.saves.get(self.key, 0) + 1

    def __del__(self):
        if self.key is not None:
            self.ledger.saves[self.key] -= 1
            if not self.ledger.saves[self.key]:
                self.ledger.now -= self.ledger.nbytes.pop(self.key)

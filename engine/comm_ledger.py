"""A ledger of what a training step sends between ranks (`train.comm_ledger`, a debug option).

Every collective and point-to-point transfer passes torch's dispatcher as a c10d op, whichever loom
module issued it (TP mappings, the pipeline's p2p, the gradient buffer, the optimizer's all-gather, the
loss sum); a dispatch mode sees them all, with their tensors and process group, without a hook in each
caller. Each op is entered under the name of the group it ran on (tp, pp, dp, ...; `ParallelState`
knows which group is which), its name without c10d's suffixes, and the dtype it moved.

`bytes` is the size of the whole message a collective is about, the quantity the usual cost formulas
take: an all-reduce's tensor, an all-gather's *output*, a reduce-scatter's *input*, a send's or
receive's tensor. A ring all-reduce of B bytes puts 2 (n - 1) / n × B on each rank's link; an all-gather
or reduce-scatter (n - 1) / n × B. Sequence parallelism is the tp group's all-gathers and
reduce-scatters; tensor parallelism without it only all-reduces there.

Under a dispatch mode every tensor op goes through Python, so a recorded step is slower; the ledger is
for checking, not for timing. It records eager steps: the compiled blocks' TP collectives are the functional
ones (`_c10d_functional`, engine/parallel/mappings.py), which it does not count.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from loom.engine.metrics import drop_rows_after

OP_NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
}
"""c10d's dispatcher names -> the collective they implement."""

MESSAGE_ARGUMENT = {"all_gather": 0, "reduce_scatter": 1, "all_to_all": 1}
"""Which tensor argument is the whole message (the gathered output, the input to scatter, what an all-to-all sends
from this rank); others: the first."""


def _tensor_bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(value) if torch.is_tensor(t))


def _first_tensor(value) -> torch.Tensor | None:
    return next((t for t in torch.utils._pytree.tree_leaves(value) if torch.is_tensor(t)), None)


class CommLedger(TorchDispatchMode):
    """Counts (group, op, dtype) -> [calls, bytes] for the ops run while it is active."""

    def __init__(self, groups: dict[str, dist.ProcessGroup | None]):
        super().__init__()
        # A group that serves two roles (the model group is the tp group when pp = 1) keeps its first name.
        self.names: dict[int, str] = {}
        for name, group in groups.items():
            if group is not None:
                self.names.setdefault(id(group), name)
        self.entries: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def _group(self, args, kwargs) -> dist.ProcessGroup | None:
        for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.ScriptObject) and "ProcessGroup" in str(leaf._type()):
                return dist.ProcessGroup.unbox(leaf)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        group = self._group(args, kwargs) if func.namespace == "c10d" else None
        if group is not None and group.size() > 1:  # a group of one moves nothing
            op = OP_NAMES.get(func.__name__.split(".")[0], func.__name__.split(".")[0])
            message = args[MESSAGE_ARGUMENT.get(op, 0)]
            first = _first_tensor(message)
            dtype = str(first.dtype).removeprefix("torch.") if first is not None else ""
            key = (self.names.get(id(group), f"group:{group.group_name}"), op, dtype)
            self.calls[key] += 1
            self.entries[key] += 0 if op == "barrier" else _tensor_bytes(message)
        return func(*args, **kwargs)

    def rows(self) -> list[dict]:
        """This ledger's entries, sorted by group and op, then cleared."""
        rows = [
            {"group": group, "op": op, "dtype": dtype, "count": count, "bytes": self.entries[(group, op, dtype)]}
            for (group, op, dtype), count in sorted(self.calls.items())
        ]
        self.calls.clear()
        self.entries.clear()
        return rows


def ledger_path(run_dir: str | Path, rank: int) -> Path:
    """Where `rank`'s ledger of a run lives: RUN_DIR/comm_ledger/rank_NNNNN.jsonl."""
    return Path(run_dir) / "comm_ledger" / f"rank_{rank:05d}.jsonl"


class StepLedgerWriter:
    """One JSON line per training step in RUN_DIR/comm_ledger/rank_NNNNN.jsonl: {"step", "calls": [...]}."""

    def __init__(
        self, run_dir: str | Path, rank: int, groups: dict[str, dist.ProcessGroup | None], resume_step: int = 0
    ):
        """From `resume_step` on: the rows of steps trained again are dropped, as metrics.jsonl's are (else a resumed
        ledger held steps 4-6 twice, and its bytes summed against the planner's counted them twice); rank 0 also
        removes the files of ranks this layout no longer has."""
        self.ledger = CommLedger(groups)
        self.path = ledger_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            drop_rows_after(self.path, resume_step)
        if rank == 0:
            world = dist.get_world_size()
            for other in sorted(self.path.parent.glob("rank_*.jsonl")):
                if int(other.stem.removeprefix("rank_")) >= world:
                    other.unlink()
                    print(f"comm ledger: removed {other}, of a rank this layout of {world} does not have", flush=True)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        with self.ledger:
            yield
        with self.path.open("a") as file:
            file.write(json.dumps({"step": step, "calls": self.ledger.rows()}) + "\n")


def read_ledger(run_dir: str | Path, rank: int) -> list[dict]:
    """The rows StepLedgerWriter wrote for `rank`, one per step."""
    return [json.loads(line) for line in ledger_path(run_dir, rank).read_text().splitlines()]

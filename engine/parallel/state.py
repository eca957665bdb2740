"""The rank layout and the process groups of one run, held in an explicit object.

Ranks are ordered TP fastest, then CP, then DP, then PP (Megatron's order), so a TP group is a block of
consecutive ranks and stays inside a node, and a CP group (the ring of context parallelism) sits next to it.
`layout_groups` is the one place that says which ranks form which group; `ParallelState` creates those groups
with torch.distributed and is passed to whoever needs it. No module-level process groups.

The ranks that hold the same weights are the DP x CP ranks of a (tp, pp) coordinate: gradients are summed over
them and ZeRO shards over them (the `grad` group); with cp = 1 it is the DP group.

Expert parallelism (ep > 1) divides the DP ranks further, as Megatron does: blocks of ep consecutive DP ranks (an
`ep` group; ep rank = dp rank mod ep) each hold 1/ep of every expert block's experts and send tokens to one another;
the ranks holding the same experts, those of a (tp, pp) coordinate with the same ep rank, over every CP rank, are
an `expert_grad` group: the experts' gradients are summed, and ZeRO shards them, over it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _warm_up(group: dist.ProcessGroup) -> None:
    """One collective every member joins. A group's first call must not be a batch_isend_irecv that only
    some ranks join (undefined under NCCL, which sets up its communicator lazily on that first call); the
    pipeline's first call is exactly that."""
    if dist.get_world_size(group) == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1) -> int:
    """Global rank of the given coordinates."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def coordinates_of(rank: int, tp: int, dp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(tp_rank, dp_rank, pp_rank, cp_rank) of a global rank."""
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp), (rank // tp) % cp


def layout_groups(tp: int, dp: int, pp: int, cp: int = 1, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every process group of a tp x cp x dp x pp layout (dp divided into ep-sized blocks), as lists of global
    ranks.

    `embedding` groups join the first and last pipeline stage of a pipeline (for tied embeddings); `grad` groups
    are the DP x CP ranks holding the same weights; `ep` and `expert_grad` groups (module docstring) exist with
    ep > 1.
    """
    groups: dict[str, list[list[int]]] = {
        "tp": [],
        "cp": [],
        "dp": [],
        "grad": [],
        "pp": [],
        "embedding": [],
        "ep": [],
        "expert_grad": [],
    }

    def at(t: int, c: int, d: int, p: int) -> int:
        return rank_of(t, d, p, tp, dp, c, cp)

    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                groups["tp"].append([at(t, c, d, p) for t in range(tp)])
            for t in range(tp):
                groups["cp"].append([at(t, c, d, p) for c in range(cp)])
        for t in range(tp):
            for c in range(cp):
                groups["dp"].append([at(t, c, d, p) for d in range(dp)])
            groups["grad"].append([at(t, c, d, p) for d in range(dp) for c in range(cp)])
            if ep > 1:
                for c in range(cp):
                    groups["ep"] += [[at(t, c, d, p) for d in range(k, k + ep)] for k in range(0, dp, ep)]
                for e in range(ep):
                    groups["expert_grad"].append([at(t, c, d, p) for d in range(e, dp, ep) for c in range(cp)])
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                pipeline = [at(t, c, d, p) for p in range(pp)]
                groups["pp"].append(pipeline)
                groups["embedding"].append(sorted({pipeline[0], pipeline[-1]}))
    return groups


@dataclass
class ParallelState:
    """This rank's coordinates and the groups it belongs to."""

    rank: int
    world_size: int
    tp_size: int
    dp_size: int
    pp_size: int
    vp_size: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    embedding_group: dist.ProcessGroup | None
    pp_ranks: tuple[int, ...] = ()
    cp_size: int = 1
    cp_group: dist.ProcessGroup | None = None
    grad_group: dist.ProcessGroup | None = None
    """DP x CP: the ranks holding the same weights (gradients summed, ZeRO sharded); the DP group when cp = 1."""
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None
    """ep > 1: the DP ranks among which each expert block's experts are divided (module docstring)."""
    expert_grad_group: dist.ProcessGroup | None = None
    """ep > 1: the ranks holding the same experts (their gradients summed, ZeRO sharded); else the grad group."""

    @property
    def tp_rank(self) -> int:
        return coordinates_of(self.rank, self.tp_size, self.dp_size, self.cp_size)[0]

    @property
    def dp_rank(self) -> int:
        return coordinates_of(self.rank, self.tp_size, self.dp_size, self.cp_size)[1]

    @property
    def pp_rank(self) -> int:
        return coordinates_of(self.rank, self.tp_size, self.dp_size, self.cp_size)[2]

    @property
    def cp_rank(self) -> int:
        return coordinates_of(self.rank, self.tp_size, self.dp_size, self.cp_size)[3]

    @property
    def grad_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def grad_rank(self) -> int:
        """This rank's place in the grad group (DP major, CP minor, as the group lists them)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """Which 1/ep of each expert block's experts this rank holds."""
        return self.dp_rank % self.ep_size

    @property
    def expert_grad_size(self) -> int:
        return self.dp_size // self.ep_size * self.cp_size

    @property
    def expert_grad_rank(self) -> int:
        """This rank's place in the expert_grad group (DP major, CP minor)."""
        return self.dp_rank // self.ep_size * self.cp_size + self.cp_rank

    @classmethod
    def create(
        cls,
        tp: int,
        dp: int,
        pp: int = 1,
        vp: int = 1,
        timeout: datetime.timedelta | None = None,
        cp: int = 1,
        ep: int = 1,
    ) -> ParallelState:
        """Create every group of the layout; all ranks must call this together, in the same order.
        `timeout` bounds each collective; pass the default group's (new groups otherwise get torch's
        30-minute default, whatever init_process_group was given)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if tp * cp * dp * pp != world or dp % ep:
            raise ValueError(f"layout tp={tp} cp={cp} dp={dp} ep={ep} pp={pp} does not match world size {world}")
        mine: dict[str, dist.ProcessGroup | None] = {}
        pp_ranks: tuple[int, ...] = ()
        for kind, rank_lists in layout_groups(tp, dp, pp, cp, ep).items():
            if kind in ("grad", "cp") and cp == 1:
                continue  # the DP group itself; no ring
            for ranks in rank_lists:
                group = dist.new_group(ranks, timeout=timeout) if world > 1 else dist.group.WORLD
                if rank in ranks:
                    mine[kind] = group
                    if kind == "pp":
                        pp_ranks = tuple(ranks)
        for group in {id(g): g for g in mine.values() if g is not None}.values():
            _warm_up(group)
        return cls(
            rank=rank,
            world_size=world,
            tp_size=tp,
            dp_size=dp,
            pp_size=pp,
            vp_size=vp,
            tp_group=mine["tp"],
            dp_group=mine["dp"],
            pp_group=mine["pp"],
            embedding_group=mine.get("embedding"),
            pp_ranks=pp_ranks,
            cp_size=cp,
            cp_group=mine.get("cp"),
            grad_group=mine.get("grad", mine["dp"]),
            ep_size=ep,
            ep_group=mine.get("ep"),
            expert_grad_group=mine.get("expert_grad", mine.get("grad", mine["dp"])),
        )

    def named_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """Every group this rank is in, by role; a group serving two roles appears under both (tp first)."""
        groups = {
            "tp": self.tp_group,
            "pp": self.pp_group,
            "dp": self.dp_group,
            "embedding": self.embedding_group,
            "world": dist.group.WORLD,
        }
        if self.cp_size > 1:
            groups.update(cp=self.cp_group, grad=self.grad_group)
        if self.ep_size > 1:
            groups.update(ep=self.ep_group, expert_grad=self.expert_grad_group)
        return groups

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size} "
            + (f"cp {self.cp_rank}/{self.cp_size} " if self.cp_size > 1 else "")
            + f"dp {self.dp_rank}/{self.dp_size} "
            + (f"ep {self.ep_rank}/{self.ep_size} " if self.ep_size > 1 else "")
            + f"pp {self.pp_rank}/{self.pp_size}"
        )

"""Run the op lists of every pipeline rank on paper: deadlock, timing, bubble and memory.

The model of execution is the executor's: compute takes its cost; an Exchange is posted when the
rank reaches it and completes once every transfer in it has met its counterpart (the matching
send or receive, posted by the peer in its own current Exchange), at the latest posting time.
If at some point no rank can move, the schedule deadlocks. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.engine.pipeline.schedules import Compute, Op, Transfer


class Deadlock(RuntimeError):
    pass


@dataclass
class Timeline:
    """Start and end of every compute op per rank, and derived figures."""

    spans: list[list[tuple[Compute, float, float]]]
    makespan: float
    busy: float
    """Compute time of the busiest rank."""

    @property
    def bubble_fraction(self) -> float:
        """Idle time over ideal compute time."""
        return (self.makespan - self.busy) / self.busy


def _key(t: Transfer) -> tuple:
    return (t.tensor, t.microbatch, t.virtual_stage)


def simulate(schedules: list[list[Op]], forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Execute all ranks' op lists; raise Deadlock if they cannot all finish."""
    pp = len(schedules)
    pc = [0] * pp
    clock = [0.0] * pp
    posted_at: list[float | None] = [None] * pp
    spans: list[list[tuple[Compute, float, float]]] = [[] for _ in range(pp)]
    matched: dict[tuple, float] = {}
    while any(pc[r] < len(schedules[r]) for r in range(pp)):
        moved = False
        for rank in range(pp):
            while pc[rank] < len(schedules[rank]) and isinstance(op := schedules[rank][pc[rank]], Compute):
                cost = forward_cost if op.kind == "F" else backward_cost
                spans[rank].append((op, clock[rank], clock[rank] + cost))
                clock[rank] += cost
                pc[rank] += 1
                moved = True
            if pc[rank] < len(schedules[rank]) and posted_at[rank] is None:
                posted_at[rank] = clock[rank]
        for rank in range(pp):
            if pc[rank] >= len(schedules[rank]) or posted_at[rank] is None:
                continue
            done_at = _exchange_ready(rank, schedules, pc, posted_at, matched)
            if done_at is not None:
                clock[rank] = done_at
                pc[rank] += 1
                posted_at[rank] = None
                moved = True
        if not moved:
            stuck = {r: schedules[r][pc[r]] for r in range(pp) if pc[r] < len(schedules[r])}
            raise Deadlock(f"no rank can move; waiting: {stuck}")
    busy = max(sum(end - start for _, start, end in rank_spans) for rank_spans in spans)
    return Timeline(spans, max(clock), busy)


def _exchange_ready(rank: int, schedules, pc, posted_at, matched: dict) -> float | None:
    """When this rank's posted Exchange completes, or None while a counterpart is not posted yet.

    A transfer meets its counterpart when both ranks have posted the Exchanges holding them; the
    meeting is remembered, since the faster side moves on before the slower one looks.
    """
    exchange = schedules[rank][pc[rank]]
    done_at = posted_at[rank]
    for t in exchange.transfers:
        mine = (rank, t.direction, *_key(t))
        if mine not in matched:
            peer = t.peer
            if pc[peer] >= len(schedules[peer]) or posted_at[peer] is None:
                return None
            peer_op = schedules[peer][pc[peer]]
            want = ("recv" if t.direction == "send" else "send", *_key(t))
            if not any((u.direction, *_key(u)) == want and u.peer == rank for u in peer_op.transfers):
                return None
            met = max(posted_at[rank], posted_at[peer])
            matched[mine] = matched[(peer, *want)] = met
        done_at = max(done_at, matched[mine])
    return done_at


def peak_in_flight(ops: list[Op]) -> int:
    """Most (microbatch, chunk) forwards whose backward has not run yet, i.e. activations held."""
    live, peak = 0, 0
    for op in ops:
        if isinstance(op, Compute):
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
    return peak

"""Pipeline schedules on paper, for every P in 1..8, V in 1..4, M in P..4P the schedule accepts:
no deadlock, each (microbatch, chunk) forward before its backward exactly once, the ideal bubble
(P-1)/(V*M) with backward = 2 x forward, and the activation memory the theory predicts."""

import pytest

from loom.engine.pipeline.schedules import (
    Compute,
    Exchange,
    ScheduleError,
    build_all,
    check_schedule,
    warmup_forwards,
)
from loom.engine.pipeline.simulate import Deadlock, peak_in_flight, simulate


def accepted():
    for pp in range(1, 9):
        for vp in range(1, 5):
            for m in range(pp, 4 * pp + 1):
                try:
                    check_schedule(pp, vp, m)
                except ScheduleError:
                    continue
                yield pp, vp, m


CASES = list(accepted())


def test_the_grid_is_covered():
    assert len(CASES) == 200
    assert (8, 4, 32) in CASES and (4, 2, 12) in CASES and (3, 1, 7) in CASES


@pytest.mark.parametrize("pp, vp, m", CASES)
def test_schedule(pp, vp, m):
    schedules = build_all(pp, vp, m)
    for rank, ops in enumerate(schedules):
        computes = [op for op in ops if isinstance(op, Compute)]
        seen_forward = set()
        for op in computes:
            key = (op.microbatch, op.chunk)
            if op.kind == "F":
                assert key not in seen_forward
                seen_forward.add(key)
            else:
                assert key in seen_forward, f"rank {rank}: backward of {key} before its forward"
        assert (
            sorted((o.microbatch, o.chunk) for o in computes if o.kind == "F")
            == sorted((o.microbatch, o.chunk) for o in computes if o.kind == "B")
            == sorted((mb, c) for mb in range(m) for c in range(vp))
        )
        # every send is received exactly once, by the right peer
        for ex in (op for op in ops if isinstance(op, Exchange)):
            for t in ex.transfers:
                counterpart = [
                    u
                    for peer_op in schedules[t.peer]
                    if isinstance(peer_op, Exchange)
                    for u in peer_op.transfers
                    if (u.tensor, u.microbatch, u.virtual_stage) == (t.tensor, t.microbatch, t.virtual_stage)
                    and u.direction != t.direction
                    and u.peer == rank
                ]
                assert len(counterpart) == 1
    timeline = simulate(schedules, forward_cost=1.0, backward_cost=2.0)  # raises Deadlock
    assert timeline.bubble_fraction == pytest.approx((pp - 1) / (vp * m), abs=1e-9)
    for rank, ops in enumerate(schedules):
        expected = pp - rank if vp == 1 else min(warmup_forwards(rank, pp, vp, m) + 1, vp * m)
        assert peak_in_flight(ops) == min(expected, m * vp)


@pytest.mark.parametrize("pp, vp, m", [c for c in CASES if c[2] in (c[0], 2 * c[0])])
def test_forward_only_schedule_for_evaluation(pp, vp, m):
    schedules = build_all(pp, vp, m, forward_only=True)
    for ops in schedules:
        forwards = [(op.microbatch, op.chunk) for op in ops if isinstance(op, Compute)]
        assert sorted(forwards) == sorted((mb, c) for mb in range(m) for c in range(vp))
    simulate(schedules)  # raises Deadlock


def test_simulator_detects_deadlock():
    schedules = build_all(2, 1, 2)
    # Swap rank 1's two exchanges around its first forward: it would wait for an activation before asking for it.
    schedules[1] = list(reversed(schedules[1]))
    with pytest.raises(Deadlock):
        simulate(schedules)


@pytest.mark.parametrize(
    "pp, vp, m, message",
    [
        (4, 2, 6, "the interleaved schedule needs microbatches divisible by pp = 4, got 6; valid: 4, 8, 12, 16"),
        (1, 2, 4, "virtual stages (vp > 1) need a pipeline (pp > 1)"),
        (2, 1, 0, "must be positive"),
    ],
)
def test_rejected_combinations_name_valid_choices(pp, vp, m, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_schedule(pp, vp, m)

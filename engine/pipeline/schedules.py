"""Pipeline schedules as data: for each pipeline rank, the ordered list of operations it runs.

One truth drives the executor, the simulator and the plots. Compute operations are
Forward/Backward of (microbatch, chunk); chunk c on rank r holds virtual stage c*P + r. The
communication around them is derived, not hand-written: a forward receives its input from the
previous virtual stage and sends its output to the next; a backward receives its output gradient
from the next and sends its input gradient to the previous. All communication between two
consecutive compute units forms one batch (posted together, waited together), which is how
Megatron pairs send_forward with recv_backward so that no schedule deadlocks. A unit is one op,
except in the interleaved steady state: a forward and a backward back to back, then one batch.

Schedules: no pipelining (P = 1, plain gradient accumulation), 1F1B (PipeDream-flush: warm-up
forwards, one-forward-one-backward, cool-down) and interleaved 1F1B with V chunks per rank
(Megatron: microbatches taken in groups of P per chunk, so M must be a multiple of P).
This module is pure: no torch, no process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loom.errors import LoomError


class ScheduleError(LoomError):
    """A (P, V, M) combination the schedule does not accept; the message names the valid choices."""


@dataclass(frozen=True)
class Compute:
    kind: Literal["F", "B"]
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Transfer:
    """One tensor crossing a pipeline boundary: the activation ("act") or its gradient ("grad")."""

    direction: Literal["send", "recv"]
    tensor: Literal["act", "grad"]
    microbatch: int
    virtual_stage: int
    """The virtual stage that produces the tensor (for "grad", the stage whose input it is the gradient of)."""
    peer: int
    """Pipeline rank on the other end."""


@dataclass(frozen=True)
class Exchange:
    """Transfers posted together and waited together."""

    transfers: tuple[Transfer, ...]


Op = Compute | Exchange


def check_schedule(pp: int, vp: int, microbatches: int) -> None:
    if pp < 1 or vp < 1 or microbatches < 1:
        raise ScheduleError("pipeline size, virtual stages and microbatches must be positive")
    if vp > 1 and pp == 1:
        raise ScheduleError("virtual stages (vp > 1) need a pipeline (pp > 1)")
    if vp > 1 and microbatches % pp:
        valid = ", ".join(str(pp * k) for k in range(1, 5))
        raise ScheduleError(
            f"the interleaved schedule needs microbatches divisible by pp = {pp}, got "
            f"{microbatches}; valid: {valid}, ... (microbatches = global batch / (micro batch * dp))"
        )


def _virtual_order(k: int, pp: int, vp: int, backward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of this rank's k-th forward or backward in Megatron's grouping."""
    group, within = divmod(k, pp * vp)
    chunk = within // pp
    if backward:
        chunk = vp - 1 - chunk
    return group * pp + within % pp, chunk


def warmup_forwards(rank: int, pp: int, vp: int, microbatches: int) -> int:
    """Forwards this rank runs before its first backward, as megatron-core's `get_pp_rank_microbatches`.

    There is no special case for microbatches == pp: older Megatron-LM ran every forward first
    there, megatron-core (0.16) does not, and the last ranks then hold (vp - 1) * pp + 1
    activations instead of all vp * pp."""
    total = microbatches * vp
    if vp == 1:
        return min(pp - rank - 1, microbatches)
    return min((pp - rank - 1) * 2 + (vp - 1) * pp, total)


def compute_units(
    rank: int, pp: int, vp: int, microbatches: int, forward_only: bool = False
) -> list[tuple[Compute, ...]]:
    """This rank's forwards and backwards in schedule order, grouped into units that run with no
    communication between them: single ops, except the interleaved steady state, where Megatron
    runs a forward and a backward back to back and then exchanges all four tensors at once.
    `forward_only` (evaluation) keeps just the forwards, in the same order."""
    check_schedule(pp, vp, microbatches)
    total = microbatches * vp
    if forward_only:
        return [(Compute("F", *_virtual_order(k, pp, vp, False)),) for k in range(total)]
    warmup = warmup_forwards(rank, pp, vp, microbatches)
    units: list[tuple[Compute, ...]] = [(Compute("F", *_virtual_order(k, pp, vp, False)),) for k in range(warmup)]
    for k in range(total - warmup):
        forward = Compute("F", *_virtual_order(k + warmup, pp, vp, False))
        backward = Compute("B", *_virtual_order(k, pp, vp, True))
        units += [(forward, backward)] if vp > 1 else [(forward,), (backward,)]
    units += [(Compute("B", *_virtual_order(k, pp, vp, True)),) for k in range(total - warmup, total)]
    return units


def _transfers_before(op: Compute, rank: int, pp: int, vp: int) -> list[Transfer]:
    stage = op.chunk * pp + rank
    if op.kind == "F" and stage > 0:
        return [Transfer("recv", "act", op.microbatch, stage - 1, (rank - 1) % pp)]
    if op.kind == "B" and stage < pp * vp - 1:
        return [Transfer("recv", "grad", op.microbatch, stage + 1, (rank + 1) % pp)]
    return []


def _transfers_after(op: Compute, rank: int, pp: int, vp: int) -> list[Transfer]:
    stage = op.chunk * pp + rank
    if op.kind == "F" and stage < pp * vp - 1:
        return [Transfer("send", "act", op.microbatch, stage, (rank + 1) % pp)]
    if op.kind == "B" and stage > 0:
        return [Transfer("send", "grad", op.microbatch, stage, (rank - 1) % pp)]
    return []


def build_schedule(rank: int, pp: int, vp: int, microbatches: int, forward_only: bool = False) -> list[Op]:
    """The full op list of one pipeline rank: compute operations with exchanges between them."""
    ops: list[Op] = []
    pending: list[Transfer] = []
    for unit in compute_units(rank, pp, vp, microbatches, forward_only):
        pending += [t for op in unit for t in _transfers_before(op, rank, pp, vp)]
        if pending:
            ops.append(Exchange(tuple(pending)))
        ops.extend(unit)
        pending = [t for op in unit for t in _transfers_after(op, rank, pp, vp)]
    if pending:
        ops.append(Exchange(tuple(pending)))
    return ops


def build_all(pp: int, vp: int, microbatches: int, forward_only: bool = False) -> list[list[Op]]:
    return [build_schedule(r, pp, vp, microbatches, forward_only) for r in range(pp)]

"""Point-to-point transfers between pipeline stages: one Exchange is posted as one batch and waited.

Every tensor that crosses a stage boundary has a shape known in advance (the micro-batch's
hidden states, sequence-sharded under sequence parallelism), so receive buffers are allocated
before the data arrives. Within an Exchange, transfers are ordered by (tensor, microbatch,
virtual stage) on both ends, so backends that match messages by order (NCCL) pair them right.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.engine.pipeline.schedules import Exchange, Transfer


def transfer_key(t: Transfer) -> tuple[str, int, int]:
    return (t.tensor, t.microbatch, t.virtual_stage)


def run_exchange(
    exchange: Exchange,
    outgoing: dict[tuple, torch.Tensor],
    pp_ranks: tuple[int, ...],
    pp_group,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[tuple, torch.Tensor]:
    """Send the tensors of `outgoing` named by the Exchange's sends; return what its receives got."""
    ops, received = [], {}
    for t in sorted(exchange.transfers, key=transfer_key):
        key = transfer_key(t)
        peer = pp_ranks[t.peer]
        if t.direction == "send":
            ops.append(dist.P2POp(dist.isend, outgoing.pop(key).contiguous(), peer, group=pp_group))
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, peer, group=pp_group))
            received[key] = buffer
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received

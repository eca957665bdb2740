"""Pipeline bubble, measured: P CPU ranks run the real schedules, exchanges and executor over layers
with a fixed synthetic cost (a sleep: forward f, backward 2f per layer, so ranks do not compete
for cores), and the step time is compared with the ideal schedule time from the simulator.
Interleaving (V = 2) must shrink the bubble against V = 1 at the same P and M.

    python tools/bench/pipeline.py [--pp 4 --microbatches 8 --layers 8 --layer-ms 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.engine.parallel.rendezvous import free_port
from loom.engine.parallel.state import ParallelState
from loom.engine.pipeline.executor import PipelineExecutor
from loom.engine.pipeline.schedules import build_all, build_schedule
from loom.engine.pipeline.simulate import simulate

SHAPE = (16, 1, 8)  # (sequence, micro-batch, hidden): tiny, so communication is negligible


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepChunk(torch.nn.Module):
    def __init__(self, layers: int, layer_s: float, first: bool, last: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(SHAPE[-1]))
        self.layers, self.layer_s, self.first, self.last = layers, layer_s, first, last

    def forward(self, tokens, labels, hidden=None):
        x = self.weight.expand(SHAPE) * 1.0 if self.first else hidden
        x = _Sleep.apply(x, self.layers * self.layer_s, 2 * self.layers * self.layer_s)
        return x.sum(dim=-1).t() if self.last else x


def _rank(rank: int, pp: int, vp: int, microbatches: int, layers: int, layer_s: float, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    state = ParallelState.create(tp=1, dp=1, pp=pp, vp=vp)
    per_chunk = layers // (pp * vp)
    chunks = [SleepChunk(per_chunk, layer_s, c * pp + rank == 0, c * pp + rank == pp * vp - 1) for c in range(vp)]
    executor = PipelineExecutor(chunks, state, SHAPE, torch.device("cpu"), contextlib.nullcontext)
    ops = build_schedule(rank, pp, vp, microbatches)
    batches = [(torch.zeros(1, 1, dtype=torch.long), None)] * microbatches
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        executor.run(ops, batches, tokens_in_batch=1)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put(min(times))
    dist.destroy_process_group()


def measure(pp: int, vp: int, microbatches: int, layers: int, layer_s: float) -> float:
    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(pp, vp, microbatches, layers, layer_s, port, results), nprocs=pp)
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layer-ms", type=float, default=20.0)
    args = parser.parse_args()
    layer_s = args.layer_ms / 1000
    compute = args.microbatches * 3 * layer_s * args.layers / args.pp  # per rank, no bubble
    print(
        f"pp={args.pp} microbatches={args.microbatches} layers={args.layers}, forward {args.layer_ms} ms "
        f"and backward {2 * args.layer_ms} ms per layer; bubble-free step {compute * 1000:.0f} ms"
    )
    bubbles = {}
    for vp in (1, 2):
        per_chunk = args.layers / (args.pp * vp)
        ideal = simulate(build_all(args.pp, vp, args.microbatches), per_chunk * layer_s, 2 * per_chunk * layer_s)
        measured = measure(args.pp, vp, args.microbatches, args.layers, layer_s)
        bubbles[vp] = measured / compute - 1
        print(
            f"vp={vp}: ideal step {ideal.makespan * 1000:7.1f} ms (bubble {ideal.bubble_fraction:.3f}), "
            f"measured {measured * 1000:7.1f} ms (bubble {bubbles[vp]:.3f}), measured/ideal "
            f"{measured / ideal.makespan:.3f}"
        )
    print(
        f"interleaving shrinks the measured bubble by {bubbles[1] / bubbles[2]:.2f}x "
        f"(theory {2:.2f}x: (P-1)/M -> (P-1)/(2M))"
    )


if __name__ == "__main__":
    main()

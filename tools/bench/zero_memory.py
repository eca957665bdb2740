"""ZeRO 0/1/2/3 and CPU offload, measured: bytes per parameter a rank holds (parameters, gradients,
master weights and optimizer state, on the device and on the host) at DP = 1, 2, 4, 8, beside the
ZeRO paper's formulas for bf16 parameters, fp32 gradients, fp32 master weights and Adam moments:
ZeRO 0 18, ZeRO 1 6 + 12/DP, ZeRO 2 2 + 16/DP, ZeRO 3 18/DP (plus, during the step, the weights it
holds gathered: two blocks and those outside the blocks, which the planner counts); offloaded, the 12 (or
12/DP) bytes of master weights and moments leave the device for the host, beside a 4 (or 4/DP) byte fp32 copy
of the reduced gradients the host's step reads. Also the step time of each choice against
ZeRO 1 at the same DP, measured in the same run (ZeRO 3 all-gathers every block twice per micro-batch).

Every DP size trains configs/tiny.toml (bf16, AdamW, 8 micro-batches per step) on gloo ranks, each
variant after the other in the same processes; each rank reports what it holds, read off the
tensors themselves, and the slowest rank's time decides a step.

    python tools/bench/zero_memory.py [--steps 4] [--dp 1 2 4 8]

On this machine the "device" is the CPU, so offload's measured cost is its extra copies and
synchronisation only; on a GPU it adds the PCIe traffic (4 B/param of gradients down, 2 B/param of
weights up per step) and the host's Adam, which a GPU's step would otherwise run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.engine.config_io import load_config
from loom.engine.parallel.rendezvous import free_port
from loom.engine.train import Trainer

VARIANTS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu")]
"""(optim.zero, optim.offload)"""


def formula_bytes_per_param(zero: int, offload: str, dp: int) -> tuple[float, float]:
    """(device, host) bytes per parameter for bf16 AdamW with fp32 gradients (ZeRO paper, Table 1); offloaded, the
    host holds the optimizer state and an fp32 copy of the reduced gradients of the same shard, which it steps with."""
    weights = 2 / dp if zero == 3 else 2
    grads = 4 / dp if zero >= 2 else 4
    state = 12 / dp if zero else 12
    host_grads = 4 / dp if zero else 4
    return (weights + grads + (0 if offload == "cpu" else state), state + host_grads if offload == "cpu" else 0)


def _rank(rank, world, port, dataset, run_dir, steps, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for zero, offload in VARIANTS:
        config = load_config(
            "tiny",
            {
                "data": {"paths": [dataset], "tokenizer": None},
                "optim": {"zero": zero, "offload": offload},
                "train": {
                    "steps": steps,
                    "run_dir": f"{run_dir}/zero{zero}-{offload}",
                    "tensorboard": False,
                    "eval_interval": 0,
                    "precision": "bf16",
                    "global_batch_size": 16,
                    "micro_batch_size": 2,
                },
            },
        )
        with contextlib.redirect_stdout(None):  # each rank's kernel line, once per variant
            trainer = Trainer(config)
        seconds = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            trainer.train_step()
            seconds.append(time.perf_counter() - start)
        count = sum(p.numel() for p in trainer.params)
        sharded = trainer.optimizer.sharded_params
        params = sharded.stored_bytes() if sharded else sum(p.numel() * p.element_size() for p in trainer.params)
        grads = sum(buffer.stored_bytes() for buffer in trainer.grad_buffers)
        state, device_state = trainer.optimizer.state_bytes(), trainer.optimizer.device_state_bytes()
        host = state - device_state + trainer.optimizer.host_gradient_bytes()
        results.put((zero, offload, rank, count, params + grads + device_state, host, seconds[1:]))
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()


def measure(dp: int, dataset: str, run_dir: str, steps: int) -> dict:
    """{(zero, offload): (device B/param, host B/param, seconds per step)}, bytes of the rank holding the most."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(dp, free_port(), dataset, run_dir, steps, results), nprocs=dp)
    rows = [results.get() for _ in range(dp * len(VARIANTS))]
    measured = {}
    for zero, offload in VARIANTS:
        mine = [r for r in rows if (r[0], r[1]) == (zero, offload)]
        count = mine[0][3]
        slowest_per_step = [max(step) for step in zip(*(r[6] for r in mine), strict=True)]
        measured[(zero, offload)] = (
            max(r[4] for r in mine) / count,
            max(r[5] for r in mine) / count,
            statistics.median(slowest_per_step),
        )
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per variant (the first is not timed)")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    from loom.tools.synthetic_data import write_markov_dataset

    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_markov_dataset(Path(tmp) / "markov", vocab_size=4096, num_documents=200)
        print("bytes per parameter on the rank holding the most (measured | formula), step time vs ZeRO 1 at that DP")
        print(
            f"{'DP':<3} {'zero':<5} {'offload':<8} {'device B/param':>16} {'formula':>8} {'host B/param':>13} "
            f"{'formula':>8} {'s/step':>8} {'vs zero1':>9}"
        )
        for dp in args.dp:
            measured = measure(dp, dataset, str(Path(tmp) / f"dp{dp}"), args.steps)
            zero1_seconds = measured[(1, "none")][2]
            for (zero, offload), (device, host, seconds) in measured.items():
                want_device, want_host = formula_bytes_per_param(zero, offload, dp)
                print(
                    f"{dp:<3} {zero:<5} {offload:<8} {device:16.3f} {want_device:8.3f} {host:13.3f} {want_host:8.3f} "
                    f"{seconds:8.3f} {seconds / zero1_seconds:8.2f}x",
                    flush=True,
                )
        print("measured and formula differ only by the padding of each gradient bucket to a multiple of DP")


if __name__ == "__main__":
    main()

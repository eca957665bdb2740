"""ZeRO-1 memory, measured: bytes per parameter a rank holds for gradients, master weights and
optimizer state, at DP = 1, 2, 4, 8, next to Megatron's 6 + 12/DP (bf16 parameters, fp32
gradients, fp32 master weights and Adam moments sharded by the distributed optimizer).

Every DP size trains one step of configs/tiny.toml (bf16, AdamW) on gloo ranks; each rank
reports what it holds, read off the tensors themselves.

    python tools/bench/zero1_memory.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.engine.config_io import load_config
from loom.engine.parallel.rendezvous import free_port
from loom.engine.train import Trainer


def _rank(rank, world, port, dataset, run_dir, zero1, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = load_config(
        "tiny",
        {
            "data": {"paths": [dataset], "tokenizer": None},
            "optim": {"zero1": zero1},
            "train": {
                "steps": 1,
                "run_dir": run_dir,
                "tensorboard": False,
                "eval_interval": 0,
                "precision": "bf16",
                "global_batch_size": 16,
                "micro_batch_size": 2,
            },
        },
    )
    trainer = Trainer(config)
    trainer.train_step()
    params = sum(p.numel() for p in trainer.params)
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.params)
    grad_bytes = trainer.grads.data.numel() * trainer.grads.data.element_size()
    results.put((rank, params, param_bytes, grad_bytes, trainer.optimizer.state_bytes()))
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, dataset: str, run_dir: str) -> tuple:
    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, port, dataset, run_dir, world > 1, results), nprocs=world)
    rows = [results.get() for _ in range(world)]
    return max(rows, key=lambda r: r[4])  # the rank holding the most


def main() -> None:
    from loom.tools.synthetic_data import write_markov_dataset

    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_markov_dataset(Path(tmp) / "markov", vocab_size=4096, num_documents=200)
        print("DP  params     bf16 param  fp32 grad  master+Adam  total B/param  Megatron 6+12/DP  state vs DP=1")
        base = None
        for dp in (1, 2, 4, 8):
            _, params, p_bytes, g_bytes, state = measure(dp, dataset, str(Path(tmp) / f"run{dp}"))
            base = base or state
            total = (p_bytes + g_bytes + state) / params
            print(
                f"{dp:<3} {params:<10,} {p_bytes / params:10.2f} {g_bytes / params:10.2f} {state / params:12.2f} "
                f"{total:14.2f} {6 + 12 / dp:17.2f} {state / base:14.3f} (1/DP = {1 / dp:.3f})"
            )


if __name__ == "__main__":
    main()

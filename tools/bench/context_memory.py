"""Context parallelism, measured: a sequence 4x longer than one rank's activation budget trains on cp 4.

The budget is what one rank holds for backward (activations, tools/bench/saved_memory.py) training
configs/tiny.toml on sequences of S tokens at cp 1. The same model then trains on 4S tokens at cp 1 (over the
budget: what one rank would need) and at cp 2 and 4 (each rank holding 4S / cp of every sequence); each row is
the most any rank held during one step, its ratio to the budget, `loom plan`'s activation bytes for the same
layout, and the step time against cp 1 on the long sequence (same run; on 2 CPU cores the cp ranks share the
cores, and the ring's sends do not hide behind compute).

    python tools/bench/context_memory.py [--seq 512] [--steps 2]
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
from loom.tools.bench.saved_memory import SavedForBackward
from loom.tools.plan_activations import rank_activation_bytes
from loom.tools.plan_bytes import layout_of


def _config(dataset: str, run_dir: str, seq: int, cp: int, steps: int):
    return load_config(
        "tiny",
        {
            "data": {"paths": [dataset], "tokenizer": None},
            "parallel": {"cp": cp},
            "model": {"max_position_embeddings": seq},
            "train": {
                "steps": steps,
                "seq_length": seq,
                "run_dir": run_dir,
                "tensorboard": False,
                "eval_interval": 0,
                "global_batch_size": 1,
                "micro_batch_size": 1,
            },
            "checkpoint": {"save_at_end": False},
        },
    )


def _rank(rank, world, port, dataset, run_dir, seq, cp, steps, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = _config(dataset, f"{run_dir}/seq{seq}-cp{cp}", seq, cp, steps)
    config.resolve_world(world)
    with contextlib.redirect_stdout(None):
        trainer = Trainer(config)
    weights = {q.untyped_storage().data_ptr() for chunk in trainer.chunks for q in chunk.parameters()}
    seconds, peak = [], 0
    for _ in range(steps):
        saved = SavedForBackward(weights)
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda held: held.tensor):
            trainer.train_step()
        seconds.append(time.perf_counter() - start)
        peak = max(peak, saved.peak)
    planned = rank_activation_bytes(
        config, layout_of(config), trainer.state.pp_rank, compiled=trainer.kernels.compiles_blocks
    )
    results.put((rank, peak, planned, seconds[1:] or seconds))
    trainer.close()
    dist.destroy_process_group()


def measure(dataset: str, run_dir: str, seq: int, cp: int, steps: int) -> tuple[int, float, float]:
    """(most bytes any rank held for backward, the planner's bytes, seconds per step of the slowest rank)."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(cp, free_port(), dataset, run_dir, seq, cp, steps, results), nprocs=cp)
    rows = [results.get() for _ in range(cp)]
    slowest = [max(step) for step in zip(*(r[3] for r in rows), strict=True)]
    return max(r[1] for r in rows), max(r[2] for r in rows), statistics.median(slowest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=512, help="the sequence that fills one rank's budget at cp 1")
    parser.add_argument("--steps", type=int, default=2, help="steps per row (the first is not timed)")
    args = parser.parse_args()
    from loom.tools.synthetic_data import write_markov_dataset

    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_markov_dataset(Path(tmp) / "markov", vocab_size=4096, num_documents=200)
        budget, _, _ = measure(dataset, tmp, args.seq, 1, args.steps)
        print(f"one rank's budget: {budget / 2**20:.1f} MiB held for backward at seq {args.seq}, cp 1")
        print(
            f"{'seq':>6} {'cp':>3} {'MiB per rank':>13} {'vs budget':>10} {'planned MiB':>12} "
            f"{'s/step':>8} {'vs cp 1':>8}"
        )
        long = 4 * args.seq
        base_seconds = None
        for cp in (1, 2, 4):
            held, planned, seconds = measure(dataset, tmp, long, cp, args.steps)
            base_seconds = base_seconds or seconds
            print(
                f"{long:>6} {cp:>3} {held / 2**20:13.1f} {held / budget:9.2f}x {planned / 2**20:12.1f} "
                f"{seconds:8.3f} {seconds / base_seconds:7.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Gradient reduction overlapped with backward versus one collective after it, same run.

ZeRO-1 training of a small model at DP = 2 and 4 on gloo CPU ranks: (a) 1 MB buckets whose
reduce-scatter starts from a backward hook as soon as they are final, against (b) a single
bucket reduce-scattered after backward. Prints median step times and their ratio (b / a > 1
means overlap pays). Rounds alternate (a, b) to spread machine noise over both.

    python tools/bench/grad_overlap.py [--steps 8 --rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from loom.engine.config_io import load_config
from loom.tools.train_run import train

MODEL = {"num_layers": 4, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 4, "ffn_hidden_size": 768}


def step_seconds(dataset: str, run_dir: Path, dp: int, overlap: bool, steps: int) -> list[float]:
    config = load_config(
        "tiny",
        {
            "data": {"paths": [dataset], "tokenizer": None},
            "model": MODEL,
            "optim": {"zero": 1},
            "parallel": {"overlap_grad_reduce": overlap, "grad_bucket_mb": 1.0 if overlap else 1e6},
            "train": {
                "steps": steps,
                "run_dir": str(run_dir),
                "log_interval": 1,
                "eval_interval": 0,
                "tensorboard": False,
                "global_batch_size": 4 * dp,
                "micro_batch_size": 2,
                "seq_length": 128,
            },
        },
    )
    config.resolve_world(dp)
    rows = train(config, dp)
    tokens = config.train.global_batch_size * config.train.seq_length
    return [tokens / r["tokens_per_s"] for r in rows[2:]]  # the first steps warm up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from loom.tools.synthetic_data import write_markov_dataset

    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_markov_dataset(Path(tmp) / "markov", vocab_size=4096, num_documents=300)
        for dp in (2, 4):
            times = {True: [], False: []}
            for r in range(args.rounds):
                for overlap in (True, False):
                    times[overlap] += step_seconds(
                        dataset, Path(tmp) / f"dp{dp}-{overlap}-{r}", dp, overlap, args.steps
                    )
            overlapped, after = statistics.median(times[True]), statistics.median(times[False])
            print(
                f"DP={dp}: overlapped bucketed reduce-scatter {overlapped * 1000:.0f} ms/step, one collective "
                f"after backward {after * 1000:.0f} ms/step, ratio {after / overlapped:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Checkpoint save and load throughput against writing and reading the same bytes as one plain file.

A Trainer of a mid-sized model (bf16 weights, fp32 master weights and Adam state) saves a
checkpoint and loads it back through loom's format (per-rank safetensors, sha256, metadata,
atomic rename); the baseline writes the same tensors' bytes to one file with a single write and
reads them back, in the same run. Prints GB/s of each and the ratios.

    python tools/bench/checkpoint.py [--layers 8 --hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from loom.engine.checkpoint.format import find_loadable
from loom.engine.checkpoint.load import load_checkpoint
from loom.engine.checkpoint.save import collect_pieces
from loom.engine.config_io import load_config
from loom.engine.train import Trainer
from loom.tools.bench.harness import single_process_group


def plain_roundtrip(pieces: dict[str, torch.Tensor], path: Path) -> tuple[float, float, int]:
    blob = b"".join(t.view(torch.uint8).numpy().tobytes() for t in pieces.values())
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    read_s = time.perf_counter() - start
    return write_s, read_s, len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    from loom.tools.synthetic_data import write_markov_dataset

    with single_process_group(torch.device("cpu")), tempfile.TemporaryDirectory() as tmp:
        dataset = write_markov_dataset(Path(tmp) / "markov", vocab_size=4096, num_documents=50)
        config = load_config(
            "tiny",
            {
                "data": {"paths": [dataset], "tokenizer": None},
                "model": {
                    "num_layers": args.layers,
                    "hidden_size": args.hidden,
                    "num_heads": 16,
                    "num_kv_heads": 8,
                    "ffn_hidden_size": 4 * args.hidden,
                },
                "train": {
                    "steps": 1,
                    "run_dir": str(Path(tmp) / "run"),
                    "tensorboard": False,
                    "eval_interval": 0,
                    "precision": "bf16",
                    "global_batch_size": 2,
                    "micro_batch_size": 1,
                    "seq_length": 32,
                },
            },
        )
        trainer = Trainer(config)
        trainer.train_step()
        pieces, _, _ = collect_pieces(trainer.training_state())
        plain_write, plain_read, nbytes = plain_roundtrip(pieces, Path(tmp) / "plain.bin")
        start = time.perf_counter()
        saved = trainer.save()
        save_s = time.perf_counter() - start
        start = time.perf_counter()
        directory, metadata = find_loadable(saved)  # includes the sha256 check of every file
        load_checkpoint(trainer.training_state(), directory, metadata)
        load_s = time.perf_counter() - start
        trainer.close()
    gb = nbytes / 1e9
    print(f"checkpoint: {gb:.2f} GB ({args.layers} layers, hidden {args.hidden}; bf16 weights, fp32 master + Adam)")
    print(
        f"save: loom {gb / save_s:.2f} GB/s, one plain file {gb / plain_write:.2f} GB/s, "
        f"ratio {plain_write / save_s:.2f}"
    )
    print(
        f"load: loom {gb / load_s:.2f} GB/s (sha256-verified, resharding path), one plain file "
        f"{gb / plain_read:.2f} GB/s, ratio {plain_read / load_s:.2f}"
    )


if __name__ == "__main__":
    main()

"""GPTDataset index build (and blending) speed: loom's numpy code against megatron-core's C++ helpers.

Builds the document, sample and shuffle indices for synthetic document lengths (default 1,000,000
documents, mean 1000 tokens, seq 2048, exactly 3 epochs) with loom's `build_sample_indices`, best
of N. When megatron-core is available it times, in the same run and on the identical input, its
own steps (document index shuffle, helpers.build_sample_idx, shuffle index) over the same number of
epochs and its C++ blending builder, checks that its sample index of one epoch equals loom's first
epoch for loom's document order, and prints ratios.
megatron-core needs torch, so it may live in another interpreter:

    python -m venv /tmp/mcore-venv
    /tmp/mcore-venv/bin/pip install torch==2.13.0 numpy megatron-core==0.16.1
    python tools/bench/dataset_index.py --megatron-python /tmp/mcore-venv/bin/python

Figures move with machine load: compare only within one run. No asserts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from loom.engine.data.blended import blend_indices
from loom.engine.data.gpt_dataset import build_sample_indices

MEGATRON_SCRIPT = r"""
import json, sys, time, warnings
import numpy
warnings.filterwarnings("ignore")
from megatron.core.datasets import helpers
from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
args = json.loads(sys.argv[1])
lengths = numpy.load(args["lengths"])
documents = numpy.arange(len(lengths), dtype=numpy.int32)
tokens_per_epoch = int(lengths.sum(dtype=numpy.int64))
seq, epochs, seed = args["seq_length"], args["epochs"], args["seed"]
times = []
for _ in range(args["repeats"]):
    start = time.perf_counter()
    rng = numpy.random.RandomState(seed)
    document_index = _build_document_index(documents, epochs, rng, False)
    sample_index = helpers.build_sample_idx(lengths, document_index, seq, epochs, tokens_per_epoch, True, True)
    shuffle_index = _build_shuffle_index(sample_index.shape[0] - 1, sample_index.shape[0] - 1, rng)
    times.append(time.perf_counter() - start)
ours = numpy.load(args["document_index"]).astype(numpy.int32)
same = helpers.build_sample_idx(lengths, ours, seq, 1, tokens_per_epoch, True, True)
numpy.save(args["sample_index_out"], same)
weights = numpy.asarray(args["blend_weights"], dtype=numpy.float64)
weights = weights / weights.sum()
blend_times = []
for _ in range(args["blend_repeats"]):
    dataset_index = numpy.zeros(args["blend_size"], dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(args["blend_size"], dtype=numpy.int64)
    start = time.perf_counter()
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), args["blend_size"],
                                   False)
    blend_times.append(time.perf_counter() - start)
numpy.save(args["blend_out"], dataset_index)
numpy.save(args["blend_samples_out"], dataset_sample_index)
print(json.dumps({"seconds": min(times), "samples": int(sample_index.shape[0] - 1),
                  "blend_seconds": min(blend_times)}))
"""


def blend_repeats(args: argparse.Namespace) -> int:
    """Blending takes milliseconds, so it gets more repeats than the index build to find its best time."""
    return max(args.repeats, 11)


def synthetic_lengths(documents: int, mean_length: float, seed: int) -> np.ndarray:
    """Exponentially distributed document lengths (a few empty ones included), as int32."""
    rng = np.random.default_rng(seed)
    return np.floor(rng.exponential(mean_length + 0.5, size=documents)).astype(np.int32)


def best_of(repeats: int, function, *args) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


def simple_blend(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """megatron-core's blending rule one sample at a time, as the baseline blend_indices replaces."""
    normalised = (np.asarray(weights, dtype=np.float64) / np.sum(np.asarray(weights, dtype=np.float64))).tolist()
    drawn = [0] * len(weights)
    datasets, samples = np.empty(size, np.int16), np.empty(size, np.int64)
    for i in range(size):
        scale = float(max(i, 1))
        errors = [w * scale - n for w, n in zip(normalised, drawn)]
        chosen = errors.index(max(errors))
        datasets[i], samples[i] = chosen, drawn[chosen]
        drawn[chosen] += 1
    return datasets, samples


def default_megatron_python() -> str | None:
    if os.environ.get("LOOM_MEGATRON_PYTHON"):
        return os.environ["LOOM_MEGATRON_PYTHON"]
    return sys.executable if importlib.util.find_spec("megatron") else None


def run_megatron(
    python: str,
    lengths: np.ndarray,
    document_index: np.ndarray,
    args: argparse.Namespace,
    epochs: int,
    blend_weights: list[float],
) -> tuple[dict, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            name: str(Path(tmp) / f"{name}.npy")
            for name in ("lengths", "document_index", "sample_index_out", "blend_out", "blend_samples_out")
        }
        np.save(paths["lengths"], lengths)
        np.save(paths["document_index"], document_index)
        request = {
            **paths,
            "seq_length": args.seq_length,
            "epochs": epochs,
            "seed": args.seed,
            "repeats": args.repeats,
            "blend_weights": blend_weights,
            "blend_size": args.blend_size,
            "blend_repeats": blend_repeats(args),
        }
        result = subprocess.run(
            [python, "-c", MEGATRON_SCRIPT, json.dumps(request)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": ""},
        )
        if result.returncode != 0:
            raise SystemExit(f"megatron-core run failed:\n{result.stderr[-3000:]}")
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        blend = (np.load(paths["blend_out"]), np.load(paths["blend_samples_out"]))
        return figures, np.load(paths["sample_index_out"]), blend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--mean-length", type=float, default=1000.0)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--blend-size", type=int, default=1_000_000)
    parser.add_argument(
        "--megatron-python",
        default=default_megatron_python(),
        help="interpreter with megatron-core installed (default: $LOOM_MEGATRON_PYTHON)",
    )
    args = parser.parse_args()

    lengths = synthetic_lengths(args.documents, args.mean_length, args.seed)
    tokens_per_epoch = int(lengths.sum(dtype=np.int64))
    # Exactly `epochs` whole epochs: loom cuts each epoch on its own, megatron-core one stream of all of them.
    num_samples = args.epochs * ((tokens_per_epoch - 1) // args.seq_length)
    ids = np.arange(args.documents, dtype=np.int64)
    print(
        f"{args.documents:,} documents, {tokens_per_epoch:,} tokens per epoch, seq {args.seq_length}, "
        f"{args.epochs} epochs -> {num_samples:,} samples; best of {args.repeats}"
    )
    ours, (document_index, sample_index, _) = best_of(
        args.repeats, build_sample_indices, lengths, ids, num_samples, args.seq_length, args.seed
    )
    print(f"loom numpy build_sample_indices:        {ours:.3f} s")
    blend_weights = [0.5, 0.3, 0.15, 0.05]
    ours_blend, (blend, blend_samples) = best_of(blend_repeats(args), blend_indices, blend_weights, args.blend_size)
    loop, (loop_blend, loop_samples) = best_of(1, simple_blend, blend_weights, args.blend_size)
    print(
        f"loom blend_indices ({args.blend_size:,} samples, 4 datasets): {ours_blend * 1e3:.1f} ms; the plain Python "
        f"loop {loop:.3f} s (loop / loom {loop / ours_blend:.1f}x, identical: "
        f"{np.array_equal(loop_blend, blend) and np.array_equal(loop_samples, blend_samples)})"
    )

    if not args.megatron_python:
        print("megatron-core not found: pass --megatron-python PATH (see this file's docstring) for the comparison")
        return
    figures, megatron_sample_index, megatron_blend = run_megatron(
        args.megatron_python, lengths, document_index[: args.documents], args, args.epochs, blend_weights
    )
    print(f"megatron-core 0.16 (C++ helpers):       {figures['seconds']:.3f} s ({figures['samples']:,} samples)")
    print(f"ratio megatron-core / loom:             {figures['seconds'] / ours:.2f}x (>1 means loom is faster)")
    print(
        f"same first-epoch sample index as megatron-core for loom's document order: "
        f"{np.array_equal(megatron_sample_index, sample_index[: len(megatron_sample_index)])}"
    )
    print(
        f"megatron-core build_blending_indices:   {figures['blend_seconds'] * 1e3:.1f} ms; "
        f"loom / megatron-core {ours_blend / figures['blend_seconds']:.2f}x; identical datasets and sample "
        f"numbers: {np.array_equal(megatron_blend[0], blend) and np.array_equal(megatron_blend[1], blend_samples)}"
    )


if __name__ == "__main__":
    main()

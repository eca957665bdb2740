"""Semantic dedup recall on long documents: the first 256-token window and its own k-means cluster (how loom
embedded and searched before) against windows pooled and the two nearest clusters (now), in the same run.

Long files of the embedded stdlib corpus (over 3,000 characters, most beyond the model's 256 tokens) get two
copies each: paragraphs in reverse order, and one word in ten changed. Prints the share of each kind of copy
joined with its original, how many distinct originals were merged with each other, documents per second and
where the time goes (embedding vs k-means and pair search).

    python tools/bench/semantic.py [--documents 60 --threshold 0.9]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from loom.data_tools import semantic
from loom.data_tools.corpus import build_stdlib_corpus


def _reordered(text: str) -> str:
    return "\n\n".join([p for p in re.split(r"\n\s*\n", text) if p.strip()][::-1])


def _edited(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), len(words) // 10):
        words[i] = words[i].upper()
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=60, help="long originals (each gets two copies)")
    parser.add_argument("--threshold", type=float, default=0.9)
    args = parser.parse_args()
    embedder = semantic.packaged_embedder(threads=2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_stdlib_corpus(root / "corpus.jsonl", max_docs=6 * args.documents, progress=False)
        records = [json.loads(line)["text"] for line in (root / "corpus.jsonl").read_text().splitlines()]
        originals = [text for text in records if len(text) > 3000][: args.documents]
        rng = random.Random(0)
        texts = originals + [_reordered(t) for t in originals] + [_edited(t, rng) for t in originals]
        n = len(originals)
        print(f"{n} originals of {np.mean([len(t) for t in originals]):,.0f} characters on average, 2 copies each")
        for label, windows, nearest in (
            ("first window, own cluster", 1, 1),
            (f"{semantic.MAX_WINDOWS} windows, {semantic.NEAREST_CLUSTERS} nearest clusters", None, None),
        ):
            start = time.perf_counter()
            representatives, stats = semantic.semantic_representatives(
                texts,
                root / f"staging-{windows}",
                (lambda batch, w=windows: embedder(batch, max_windows=w)) if windows else embedder,
                args.threshold,
                docs_per_cluster=max(8, len(texts) // 8),
                nearest=nearest or semantic.NEAREST_CLUSTERS,
            )
            seconds = time.perf_counter() - start
            joined = [np.mean([representatives[i] == representatives[k * n + i] for i in range(n)]) for k in (1, 2)]
            merged = n - len(set(representatives[:n].tolist()))
            print(
                f"{label:32} reordered {joined[0]:4.0%}  edited {joined[1]:4.0%}  originals merged {merged}  "
                f"{len(texts) / seconds:5.1f} docs/s (embedding {stats['embedding_seconds']} s, "
                f"k-means and pairs {stats['clustering_seconds']} s)"
            )


if __name__ == "__main__":
    main()

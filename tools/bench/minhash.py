"""Near-duplicate detection: loom's MinHash dedup against datasketch's in-memory MinHashLSH, same run.

A generated corpus with known duplicate clusters (tests/near_duplicates.py: copies at word
5-gram Jaccard ~0.87-0.93, plus unrelated documents) is deduplicated at threshold 0.8 by both;
prints documents per second and pairwise precision and recall against the known clusters.

    python tools/bench/minhash.py [--clusters 400 --copies 4 --singletons 800]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from near_duplicates import make_corpus, pair_scores  # noqa: E402

from data_tools.dedup import deduplicate  # noqa: E402
from data_tools.minhash import shingles  # noqa: E402


def run_datasketch(docs: list[dict], threshold: float, num_perm: int) -> tuple[list[int], float]:
    from datasketch import MinHash, MinHashLSH

    start = time.perf_counter()
    lsh, representative = MinHashLSH(threshold=threshold, num_perm=num_perm), []
    for i, doc in enumerate(docs):
        sketch = MinHash(num_perm=num_perm)
        sketch.update_batch([s.encode("utf-8") for s in shingles(doc["text"])])
        matches = lsh.query(sketch)
        representative.append(min(matches) if matches else i)
        lsh.insert(i, sketch)
    return [representative[r] for r in representative], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=400)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--singletons", type=int, default=800)
    parser.add_argument("--threshold", type=float, default=0.8)
    args = parser.parse_args()
    docs, truth = make_corpus(args.clusters, args.copies, args.singletons)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "corpus.jsonl"
        source.write_text("".join(json.dumps(d) + "\n" for d in docs))
        start = time.perf_counter()
        deduplicate([source], Path(tmp) / "out", method="minhash", threshold=args.threshold)
        loom_s = time.perf_counter() - start
        position = {d["id"]: i for i, d in enumerate(docs)}
        predicted = list(range(len(docs)))
        for line in (Path(tmp) / "out" / "removed" / "removed.jsonl").read_text().splitlines():
            record = json.loads(line)
            predicted[position[record["id"]]] = position[record["duplicate_of"]]
    ds_predicted, ds_s = run_datasketch(docs, args.threshold, 128)
    print(f"{len(docs)} documents, {args.clusters} clusters of {args.copies}, threshold {args.threshold}, 128 permutations")
    for name, labels, seconds in (("loom minhash (1 process, end to end)", predicted, loom_s),
                                  ("datasketch MinHashLSH (in memory)", ds_predicted, ds_s)):
        precision, recall = pair_scores(truth, labels)
        print(f"{name:40} {len(docs) / seconds:8.0f} docs/s  precision {precision:.3f}  recall {recall:.3f}")
    print(f"speed ratio loom / datasketch: {ds_s / loom_s:.2f}")


if __name__ == "__main__":
    main()

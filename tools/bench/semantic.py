"""Semantic dedup recall and precision: the first 256-token window and its own k-means cluster (how loom embedded
and searched before) against windows pooled and the two nearest clusters (now), in the same run.

The first --documents non-empty files of the embedded stdlib corpus are the originals (most longer than the
model's 256 tokens). A quarter of them, drawn among those of three paragraphs or more, get two copies each:
paragraphs in reverse order, and one word in ten replaced by a word drawn from the whole corpus (an edit the
uncased model cannot ignore, unlike a change of case). Prints, for each cosine threshold (one embedding per
way, reused), the share of each kind of copy joined with its original, the precision of the removals (removed
documents whose kept one is their own original or copy) and how many of the wrong removals lie in the kept
document's folder (stdlib's families of templated files: codecs, fixers, tests) or share half its word 5-grams
(near-duplicates the corpus itself holds); then documents per second
and where the time goes: tokenising (CPU), the encoder, k-means and pair search.

    python tools/bench/semantic.py [--documents 120 --thresholds 0.9 0.92 0.95 --device cpu|cuda --model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from loom.data_tools import semantic
from loom.data_tools.corpus import build_stdlib_corpus
from loom.data_tools.minhash import jaccard, shingle_hashes


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _reordered(text: str) -> str:
    return "\n\n".join(_paragraphs(text)[::-1])


def _edited(text: str, vocabulary: list[str], rng: random.Random) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), len(words) // 10):
        words[i] = rng.choice(vocabulary)
    return " ".join(words)


def _corpus(root: Path, documents: int) -> tuple[list[str], list[int], list[str]]:
    """Texts (originals, then reordered copies, then edited copies), the original each one comes from, and the
    originals' folders."""
    build_stdlib_corpus(root / "corpus.jsonl", max_docs=2 * documents, progress=False)
    records = [json.loads(line) for line in (root / "corpus.jsonl").read_text().splitlines()]
    records = [record for record in records if record["text"].strip()][:documents]
    originals = [record["text"] for record in records]
    rng = random.Random(0)
    copied = sorted(rng.sample([i for i, t in enumerate(originals) if len(_paragraphs(t)) >= 3], documents // 4))
    vocabulary = [word for text in originals for word in text.split()]
    texts = (
        originals
        + [_reordered(originals[i]) for i in copied]
        + [_edited(originals[i], vocabulary, rng) for i in copied]
    )
    return texts, list(range(len(originals))) + copied + copied, [record["id"].rsplit("/", 1)[0] for record in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=120, help="originals (a quarter of them get two copies)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.9, 0.92, 0.95], help="cosine thresholds")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--model-dir", type=Path, default=None, help="a copy of the packaged model's folder")
    args = parser.parse_args()
    if args.model_dir:
        embedder = semantic.PackagedEmbedder(args.model_dir, args.threads, args.device)
    else:
        embedder = semantic.packaged_embedder(args.threads, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        texts, family, folders = _corpus(root, args.documents)
        family = np.asarray(family)
        originals, copies = int(np.sum(family == np.arange(len(family)))), (len(texts) - args.documents) // 2
        windows = embedder._tokenizer(
            texts,
            truncation=True,
            max_length=embedder.max_tokens,
            stride=semantic.WINDOW_OVERLAP,
            return_overflowing_tokens=True,
        )["overflow_to_sample_mapping"]
        windows_per_text = np.bincount(windows, minlength=len(texts))
        long_share = np.mean(windows_per_text[:originals] > 1)
        print(
            f"{originals} originals ({long_share:.0%} longer than {embedder.max_tokens} tokens), {copies} reordered "
            f"and {copies} edited copies; {embedder.device}, {args.threads} CPU threads"
        )
        for label, max_windows, nearest in (
            ("first window, own cluster", 1, 1),
            (
                f"{semantic.MAX_WINDOWS} windows, {semantic.NEAREST_CLUSTERS} nearest clusters",
                semantic.MAX_WINDOWS,
                semantic.NEAREST_CLUSTERS,
            ),
        ):
            embed = _EmbedOnce(embedder, max_windows)
            for number, threshold in enumerate(args.thresholds):
                start, tokenized_before = time.perf_counter(), embedder.tokenizing_seconds
                embed.replay()
                representatives, stats = semantic.semantic_representatives(
                    texts,
                    root / f"staging-{max_windows}-{number}",
                    embed,
                    threshold,
                    docs_per_cluster=max(8, len(texts) // 8),
                    nearest=nearest,
                )
                if number == 0:
                    seconds = time.perf_counter() - start
                    tokenizing = embedder.tokenizing_seconds - tokenized_before
                    encoder = stats["embedding_seconds"] - tokenizing
                    encoded = int(np.minimum(windows_per_text, max_windows).sum())
                    print(
                        f"{label}: {len(texts) / seconds:.1f} docs/s: tokenising {tokenizing:.2f} s, encoder "
                        f"{encoder:.2f} s ({encoded} windows, {encoded / encoder:.1f}/s), k-means and pairs "
                        f"{stats['clustering_seconds']} s"
                    )
                quality = _quality(texts, family, folders, originals, copies, representatives)
                print(f"  cosine {threshold:.2f}  {quality}")


class _EmbedOnce:
    """The embedder on the first pass over the corpus; the same vectors, batch by batch, on later passes."""

    def __init__(self, embedder: semantic.PackagedEmbedder, max_windows: int) -> None:
        self.embedder, self.max_windows = embedder, max_windows
        self.recorded: list[np.ndarray] = []
        self.replaying: Iterator[np.ndarray] | None = None

    def replay(self) -> None:
        self.replaying = iter(self.recorded) if self.recorded else None

    def __call__(self, batch: list[str]) -> np.ndarray:
        if self.replaying is not None:
            return next(self.replaying)
        self.recorded.append(self.embedder(batch, max_windows=self.max_windows))
        return self.recorded[-1]


def _quality(
    texts: list[str],
    family: np.ndarray,
    folders: list[str],
    originals: int,
    copies: int,
    representatives: np.ndarray,
) -> str:
    joined = representatives[originals:] == representatives[family[originals:]]
    removed = np.flatnonzero(representatives != np.arange(len(texts)))
    wrong = removed[family[representatives[removed]] != family[removed]]
    precision = 1 - len(wrong) / len(removed) if len(removed) else 1.0
    near = sum(_shingle_jaccard(texts[document], texts[representatives[document]]) >= 0.5 for document in wrong)
    same_folder = sum(folders[family[document]] == folders[family[representatives[document]]] for document in wrong)
    merged = originals - len(set(representatives[:originals].tolist()))
    return (
        f"recall: reordered {joined[:copies].mean():4.0%}  edited {joined[copies:].mean():4.0%}  "
        f"precision {precision:.3f} ({len(wrong)} wrong of {len(removed)} removed; of them {same_folder} in the "
        f"kept one's folder, {near} sharing half its word 5-grams; originals merged {merged})"
    )


def _shingle_jaccard(first: str, second: str) -> float:
    """Jaccard similarity of two texts' word 5-grams, hashed as `loom data dedup --method minhash` hashes them."""
    hashes, counts = shingle_hashes([first, second])
    return jaccard(hashes[: counts[0]], hashes[counts[0] :])


if __name__ == "__main__":
    main()

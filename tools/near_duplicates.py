"""A corpus with known near-duplicate clusters: copies of a base document, each changed by `edits`
operations of one kind (word replacements, insertions, or swaps of neighbouring words; the kind
cycles over the copies). With 300 words and 2 edits a copy's word 5-gram Jaccard is ~0.93 to its
base and ~0.87 to another copy; with 6 edits they sit near a 0.8 threshold (median ~0.83 to the base).
Unrelated documents are mixed in. Used by the MinHash tests and tools/bench/minhash.py."""

from __future__ import annotations

import numpy as np

from loom.data_tools.minhash import shingles


def make_corpus(
    clusters: int, copies: int, singletons: int, words: int = 300, edits: int = 2, seed: int = 0
) -> tuple[list[dict], list[int]]:
    """(documents, cluster id of each document); singletons get their own cluster ids."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(50_000)])
    docs, labels = [], []
    for cluster in range(clusters):
        base = list(vocabulary[rng.integers(0, len(vocabulary), words)])
        for copy in range(copies):
            text = list(base)
            for _ in range(edits if copy else 0):
                position, word = int(rng.integers(0, words - 1)), vocabulary[rng.integers(0, len(vocabulary))]
                if copy % 3 == 1:
                    text[position] = word
                elif copy % 3 == 2:
                    text.insert(position, word)
                else:
                    text[position], text[position + 1] = text[position + 1], text[position]
            docs.append(" ".join(text))
            labels.append(cluster)
    for single in range(singletons):
        docs.append(" ".join(vocabulary[rng.integers(0, len(vocabulary), words)]))
        labels.append(clusters + single)
    order = rng.permutation(len(docs))
    return ([{"id": f"d{i}", "text": docs[j]} for i, j in enumerate(order)], [labels[j] for j in order])


def exact_truth(docs: list[dict], clusters: list[int], threshold: float) -> tuple[list[int], list[float]]:
    """(label of each document's connected component over the pairs whose exact Jaccard of word 5-gram string
    sets reaches the threshold, the Jaccard of every pair within a generated cluster). Pairs across generated
    clusters are not compared: random 5-grams of a 50,000-word vocabulary never match."""
    sets = [shingles(d["text"]) for d in docs]
    members: dict[int, list[int]] = {}
    for doc, cluster in enumerate(clusters):
        members.setdefault(cluster, []).append(doc)
    parent, similarities = list(range(len(docs))), []

    def root(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for group in members.values():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                similarity = len(sets[a] & sets[b]) / len(sets[a] | sets[b])
                similarities.append(similarity)
                if similarity >= threshold:
                    ra, rb = root(a), root(b)
                    parent[max(ra, rb)] = min(ra, rb)
    return [root(doc) for doc in range(len(docs))], similarities


def pair_scores(truth: list[int], predicted: list[int]) -> tuple[float, float]:
    """Pairwise precision and recall of a predicted clustering against the true one."""

    def pairs(labels):
        groups = {}
        for doc, label in enumerate(labels):
            groups.setdefault(label, []).append(doc)
        return {(a, b) for members in groups.values() for i, a in enumerate(members) for b in members[i + 1 :]}

    true_pairs, found = pairs(truth), pairs(predicted)
    precision = len(true_pairs & found) / len(found) if found else 1.0
    recall = len(true_pairs & found) / len(true_pairs) if true_pairs else 1.0
    return precision, recall

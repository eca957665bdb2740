"""Exact deduplication against a reference written here: first occurrence of each normalised text kept."""

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from data_tools.dedup import deduplicate
from data_tools.jsonl import InputError

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    {"id": "a", "text": "The quick  brown fox.", "url": "u1"},
    {"id": "b", "text": "the quick brown fox.\n", "url": "u2"},  # same after case and whitespace folding
    {"id": "c", "text": "Something else", "url": "u3"},
    {"id": "d", "text": "ＴＨＥ QUICK BROWN FOX.", "url": "u4"},  # full-width letters: same after NFKC
    {"id": "e", "text": "Something else", "url": "u5"},
    {"id": "f", "text": "unique", "url": "u6"},
]


def reference(docs):
    key = lambda t: " ".join(unicodedata.normalize("NFKC", t).casefold().split())  # noqa: E731
    first, kept, removed = {}, [], []
    for doc in docs:
        k = key(doc["text"])
        if k in first:
            removed.append({**doc, "duplicate_of": first[k]})
        else:
            first[k] = doc["id"]
            kept.append(doc)
    return kept, removed


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_exact_dedup_matches_reference(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DOCS) + "not json\n{\"id\": 9}\n")
    stats = deduplicate([source], tmp_path / "out")
    kept, removed = reference(DOCS)
    assert read(tmp_path / "out/kept.jsonl") == kept  # every field kept, id included
    assert read(tmp_path / "out/removed/removed.jsonl") == removed
    assert read(tmp_path / "out/clusters.jsonl") == [{"kept": "a", "removed": ["b", "d"], "size": 3},
                                                     {"kept": "c", "removed": ["e"], "size": 2}]
    assert stats["input_documents"] == stats["kept"] + stats["removed"] == 6
    assert stats["input"]["bad_lines"] == 2
    assert json.loads((tmp_path / "out/stats.json").read_text())["clusters"] == 2


def test_no_documents_leaves_no_output(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("{\"body\": \"x\"}\n")
    with pytest.raises(InputError, match="no documents with a string 'text' field"):
        deduplicate([source], tmp_path / "out")
    assert not any(p.is_file() for p in (tmp_path / "out").rglob("*"))


def test_cli_refuses_methods_not_built_yet(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(DOCS[0]) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "launch.cli", "data", "dedup", "--input", str(source), "--output",
                             str(tmp_path / "out"), "--method", "semantic"], capture_output=True, text=True, env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --method semantic is not available yet; use one of exact, minhash"


def test_minhash_signatures_equal_datasketch():
    datasketch = pytest.importorskip("datasketch")
    from data_tools.minhash import permutations, shingles, signature

    text = "the quick brown fox jumps over the lazy dog and runs far away from here"
    reference = datasketch.MinHash(num_perm=128, seed=1)
    for shingle in shingles(text):
        reference.update(shingle.encode("utf-8"))
    assert np.array_equal(signature(text, *permutations(128)), reference.hashvalues)


def test_minhash_finds_known_clusters(tmp_path):
    from near_duplicates import make_corpus, pair_scores

    docs, truth = make_corpus(clusters=60, copies=4, singletons=120)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(d) + "\n" for d in docs))
    stats = deduplicate([source], tmp_path / "out", method="minhash", threshold=0.8)
    removed = read(tmp_path / "out/removed/removed.jsonl")
    position = {d["id"]: i for i, d in enumerate(docs)}
    predicted = list(range(len(docs)))
    for record in removed:
        predicted[position[record["id"]]] = position[record["duplicate_of"]]
    precision, recall = pair_scores(truth, predicted)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall)
    assert stats["kept"] + stats["removed"] == len(docs) and (stats["bands"], stats["rows"]) != (0, 0)

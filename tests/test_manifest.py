"""manifest.json: every data command records its inputs and outputs with sizes and sha256, so lineage chains."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from loom.data_tools.build import build_indexed_dataset
from loom.data_tools.clean import clean_corpus
from loom.data_tools.corpus import build_stdlib_corpus
from loom.data_tools.dedup import deduplicate
from loom.data_tools.manifest import manifest_path
from loom.data_tools.tokenizer import train_tokenizer


def described(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_every_step_writes_a_manifest_that_chains(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    build_stdlib_corpus(corpus, max_docs=12, progress=False)
    clean_corpus([corpus], tmp_path / "clean", pipeline="code", progress=False)
    deduplicate([tmp_path / "clean/kept.jsonl"], tmp_path / "dedup")
    kept = tmp_path / "dedup/kept.jsonl"
    train_tokenizer([kept], tmp_path / "tok", vocab_size=512)
    build_indexed_dataset([kept], tmp_path / "tok.model", tmp_path / "data", progress=False)

    steps = {
        "loom data corpus": (tmp_path / "corpus.jsonl.manifest.json", [], [corpus]),
        "loom data clean": (tmp_path / "clean/manifest.json", [corpus], None),
        "loom data dedup": (tmp_path / "dedup/manifest.json", [tmp_path / "clean/kept.jsonl"], None),
        "loom data tokenizer": (
            tmp_path / "tok.manifest.json",
            [kept],
            [tmp_path / "tok.model", tmp_path / "tok.vocab"],
        ),
        "loom data build": (
            tmp_path / "data.manifest.json",
            [kept, tmp_path / "tok.model"],
            [tmp_path / "data.bin", tmp_path / "data.idx"],
        ),
    }
    for command, (path, inputs, outputs) in steps.items():
        manifest = load(path)
        assert manifest["command"] == command
        assert [{"bytes": i["bytes"], "sha256": i["sha256"]} for i in manifest["inputs"]] == list(
            map(described, inputs)
        )
        assert [i["path"] for i in manifest["inputs"]] == list(map(str, inputs))
        if outputs is not None:
            assert [{k: o[k] for k in ("bytes", "sha256")} for o in manifest["outputs"]] == list(
                map(described, outputs)
            )
        assert manifest["software"]["loom"] and manifest["software"]["python"]
        assert manifest["created"].endswith("Z") and manifest["seconds"] >= 0
        assert manifest["counts"] and isinstance(manifest["parameters"], dict)

    # Folder manifests name their outputs relative to the folder, and the hashes match the files.
    clean = load(tmp_path / "clean/manifest.json")
    for output in clean["outputs"]:
        assert described(tmp_path / "clean" / output["path"]) == {k: output[k] for k in ("bytes", "sha256")}
    assert "kept.jsonl" in [o["path"] for o in clean["outputs"]]
    assert clean["parameters"]["steps"][0]["type"] == "unicode_repair"
    assert (
        load(tmp_path / "data.manifest.json")["counts"]["documents"]
        == clean["counts"]["kept"] - load(tmp_path / "dedup/manifest.json")["counts"]["removed"]
    )
    assert load(tmp_path / "tok.manifest.json")["parameters"]["vocab_size"] == 512


def test_manifest_locations():
    assert manifest_path("out/dir", is_folder=True) == Path("out/dir/manifest.json")
    assert manifest_path("out/prefix", is_folder=False) == Path("out/prefix.manifest.json")

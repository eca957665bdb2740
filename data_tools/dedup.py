"""`loom data dedup`: drop exact (normalised-text hash) or near (MinHash + LSH) duplicate documents.

Two passes over the input: the first decides, for every document, which document it duplicates
(itself when it is kept: the first of its cluster); the second writes the decisions, so memory
holds only hashes or signatures, never texts. Exact normalisation is Unicode NFKC, case folding,
whitespace runs collapsed. Outputs in D: kept.jsonl (every field kept), removed/removed.jsonl
(each with `duplicate_of`, the id of the kept document), clusters.jsonl (one line per group),
stats.json (input = kept + removed, plus bad input lines), manifest.json (lineage, written last). Each file
appears only when complete.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_tools import minhash
from data_tools.atomic import atomic_path
from data_tools.jsonl import InputError, JsonlStats, check_inputs, iter_jsonl
from data_tools.manifest import write_manifest

_WHITESPACE = re.compile(r"\s+")
METHODS = ("exact", "minhash")


def normalise(text: str) -> str:
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_digest(text: str) -> bytes:
    """16 bytes of SHA-256 of the normalised text: collisions are negligible below ~10^18 documents."""
    return hashlib.sha256(normalise(text).encode("utf-8")).digest()[:16]


def exact_representatives(texts: Iterator[str]) -> list[int]:
    first_seen: dict[bytes, int] = {}
    return [first_seen.setdefault(text_digest(text), i) for i, text in enumerate(texts)]


def minhash_representatives(texts: Iterator[str], threshold: float, num_perm: int) -> tuple[list[int], dict]:
    a, b = minhash.permutations(num_perm)
    signatures = np.stack([minhash.signature(text, a, b) for text in texts])
    bands, rows = minhash.optimal_bands(threshold, num_perm)
    return minhash.cluster(signatures, threshold, bands, rows), {"bands": bands, "rows": rows, "num_perm": num_perm}


def _texts(paths, text_key: str, stats: JsonlStats, ids: list[str]) -> Iterator[str]:
    for position, record in enumerate(tqdm(iter_jsonl(paths, text_key, stats), desc="dedup", unit="doc",
                                           mininterval=1.0)):
        ids.append(str(record.get("id", f"doc-{position}")))
        yield record[text_key]


def deduplicate(inputs: Iterable[str | Path], output: str | Path, method: str = "exact", text_key: str = "text",
                threshold: float = 0.8, num_perm: int = 128) -> dict:
    """Write kept and removed documents and the duplicate clusters to `output`; returns the stats."""
    if method not in METHODS:
        raise InputError(f"--method {method} is not available yet; use one of {', '.join(METHODS)}")
    paths, output, stats, ids = check_inputs(inputs), Path(output), JsonlStats(), []
    start, started, extra = time.perf_counter(), time.time(), {}
    texts = _texts(paths, text_key, stats, ids)
    if method == "exact":
        representative = exact_representatives(texts)
    else:
        representative, extra = minhash_representatives(texts, threshold, num_perm)
    if not representative:
        raise InputError(f"no documents with a string {text_key!r} field in {', '.join(map(str, paths))}")
    kept = _write_decisions(paths, output, text_key, representative, ids)
    clusters: dict[int, list[str]] = {}
    for doc, rep in enumerate(representative):
        if doc != rep:
            clusters.setdefault(rep, []).append(ids[doc])
    groups = [{"kept": ids[rep], "removed": members, "size": len(members) + 1} for rep, members in clusters.items()]
    with atomic_path(output / "clusters.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(g, ensure_ascii=False) + "\n" for g in groups))
    seconds = time.perf_counter() - start
    result = {"method": method, **({"threshold": threshold, **extra} if method == "minhash" else {}),
              "input_documents": len(representative), "kept": kept, "removed": len(representative) - kept,
              "clusters": len(groups), "largest_cluster": max((g["size"] for g in groups), default=1),
              "seconds": round(seconds, 2), "docs_per_s": round(len(representative) / seconds, 1),
              "input": stats.as_dict()}
    with atomic_path(output / "stats.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    written = [output / "kept.jsonl", output / "removed" / "removed.jsonl", output / "clusters.jsonl",
               output / "stats.json"]
    write_manifest(output, command="loom data dedup", inputs=paths, outputs=written,
                   parameters={"method": method, "text_key": text_key,
                               **({"threshold": threshold, "num_perm": num_perm, **extra} if method == "minhash" else {})},
                   counts={k: result[k] for k in ("input_documents", "kept", "removed", "clusters")},
                   started=started, is_folder=True)
    return result


def _write_decisions(paths, output: Path, text_key: str, representative: list[int], ids: list[str]) -> int:
    kept = 0
    with atomic_path(output / "kept.jsonl") as kept_tmp, \
            atomic_path(output / "removed" / "removed.jsonl") as removed_tmp, \
            open(kept_tmp, "w", encoding="utf-8") as kept_out, open(removed_tmp, "w", encoding="utf-8") as removed_out:
        for doc, record in enumerate(iter_jsonl(paths, text_key, JsonlStats())):
            if representative[doc] == doc:
                kept_out.write(json.dumps(record, ensure_ascii=False) + "\n")
                kept += 1
            else:
                record = {**record, "duplicate_of": ids[representative[doc]]}
                removed_out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return kept

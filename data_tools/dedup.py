"""`loom data dedup --method exact`: drop documents whose normalised text was seen before.

Normalisation (Unicode NFKC, case folding, whitespace runs collapsed, ends stripped) makes copies
that differ only in layout or case collide. The first occurrence of each text is kept; every later
one goes to removed/ with the id of the document it duplicates, so nothing is lost and every
decision can be checked. Outputs in D: kept.jsonl, removed/removed.jsonl, clusters.jsonl (one
line per group of duplicates), stats.json (input = kept + removed, plus bad input lines). Each
file appears only when complete. MinHash and semantic deduplication are not built yet.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from data_tools.atomic import atomic_path
from data_tools.jsonl import InputError, JsonlStats, check_inputs, iter_jsonl

_WHITESPACE = re.compile(r"\s+")
METHODS = ("exact", "minhash", "semantic")


def normalise(text: str) -> str:
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_digest(text: str) -> bytes:
    """16 bytes of SHA-256 of the normalised text: collisions are negligible below ~10^18 documents."""
    return hashlib.sha256(normalise(text).encode("utf-8")).digest()[:16]


def _document_id(record: dict, position: int) -> str:
    return str(record.get("id", f"doc-{position}"))


def dedup_exact(inputs: Iterable[str | Path], output: str | Path, text_key: str = "text") -> dict:
    """Write kept and removed documents and the duplicate clusters to `output`; returns the stats."""
    paths, output = check_inputs(inputs), Path(output)
    stats, first_seen, clusters = JsonlStats(), {}, {}
    kept = removed = 0
    with atomic_path(output / "kept.jsonl") as kept_tmp, \
            atomic_path(output / "removed" / "removed.jsonl") as removed_tmp, \
            open(kept_tmp, "w", encoding="utf-8") as kept_out, open(removed_tmp, "w", encoding="utf-8") as removed_out:
        records = iter_jsonl(paths, text_key, stats)
        for position, record in enumerate(tqdm(records, desc="dedup", unit="doc", mininterval=1.0)):
            digest, doc_id = text_digest(record[text_key]), _document_id(record, position)
            if digest not in first_seen:
                first_seen[digest], clusters[digest] = doc_id, []
                kept_out.write(json.dumps(record, ensure_ascii=False) + "\n")
                kept += 1
            else:
                removed_out.write(json.dumps({**record, "duplicate_of": first_seen[digest]}, ensure_ascii=False)
                                  + "\n")
                clusters[digest].append(doc_id)
                removed += 1
        if stats.documents == 0:  # raised inside the block, so no output is left behind
            raise InputError(f"no documents with a string {text_key!r} field in {', '.join(map(str, paths))}")
    groups = [{"kept": first_seen[d], "removed": ids, "size": len(ids) + 1} for d, ids in clusters.items() if ids]
    with atomic_path(output / "clusters.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(g, ensure_ascii=False) + "\n" for g in groups))
    result = {"method": "exact", "input_documents": stats.documents, "kept": kept, "removed": removed,
              "clusters": len(groups), "largest_cluster": max((g["size"] for g in groups), default=1),
              "input": stats.as_dict()}
    with atomic_path(output / "stats.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    return result

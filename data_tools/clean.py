"""`loom data clean`: repair and filter JSONL documents through a TOML pipeline; nothing is lost silently.

The parent streams documents in chunks to workers (data_tools/parallel.py), which run the pipeline
(data_tools/pipeline.py) and send back, per document, the output record or the step and rule
that rejected it; the parent writes them in input order. Outputs in D:

    kept.jsonl                 kept documents, every input field kept, text repaired (with
                               --split-by-language: kept/<lang>/kept.jsonl instead)
    rejected/<step>.jsonl      each rejected document as it came in, plus rejected_by, reason, detail
    stats.json                 counts: documents = kept + rejected; lines = documents + bad + blank
    manifest.json              inputs with hashes, the pipeline, counts (written last)

Files are written under D/.staging-<pid>/ and moved into place only when the whole input is done,
so an interrupted run leaves the previous complete output (or none). This module must not define
filters; those live in text_repair.py, quality_filters.py, line_filters.py and language.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import IO, Iterable, Iterator

from loom.data_tools.atomic import atomic_path
from loom.data_tools.jsonl import InputError, JsonlStats, check_inputs, iter_jsonl
from loom.data_tools.manifest import write_manifest
from loom.data_tools.parallel import chunked, imap_ordered
from loom.data_tools.pipeline import (
    apply_steps,
    built_steps,
    load_pipeline_spec,
    resolve_pipeline_path,
)
from loom.data_tools.progress import Progress

CHUNK_DOCUMENTS = 256
CHUNK_CHARACTERS = 4 << 20
KEPT_NAME = "kept.jsonl"
# Labels every document without rejecting any: what --split-by-language adds when the pipeline has no language step.
LABEL_LANGUAGE_STEP = {"type": "language", "name": "language_label", "languages": [], "min_score": 0.0}


def clean_chunk(spec: list[dict], records: list[dict], text_key: str) -> list[tuple]:
    """Run the pipeline over a chunk in a worker: [(record, (step, rule, detail) or None)] in order."""
    steps = built_steps(spec)
    outcomes = []
    for record in records:
        output, rejection = apply_steps(steps, record, text_key)
        outcomes.append((output, None if rejection is None else (rejection[0], *rejection[1])))
    return outcomes


def _chunks(records: Iterable[dict], text_key: str, sizes: list[int]) -> Iterator[list[dict]]:
    """Records in chunks; the UTF-8 size of each chunk's texts is appended to `sizes` (for MB/s)."""
    for chunk in chunked(records, CHUNK_DOCUMENTS, CHUNK_CHARACTERS, lambda record: len(record[text_key])):
        sizes.append(sum(len(record[text_key].encode("utf-8", "surrogatepass")) for record in chunk))
        yield chunk


class _StagedOutputs:
    """JSONL files opened on first write under a staging folder, moved into the output folder on commit."""

    def __init__(self, output: Path):
        self.output = output
        self.staging = output / f".staging-{os.getpid()}"
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self._files: dict[str, IO[str]] = {}

    def write(self, relative: str, record: dict) -> None:
        out = self._files.get(relative)
        if out is None:
            path = self.staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            out = self._files[relative] = open(path, "w", encoding="utf-8", buffering=1 << 20)
        out.write(json.dumps(record, ensure_ascii=False) + "\n")

    def _close(self) -> None:
        for out in self._files.values():
            out.close()

    def commit(self) -> list[Path]:
        """Replace the previous run's kept/rejected files with these; returns the final paths."""
        self._close()
        for old in (self.output / KEPT_NAME, self.output / "kept", self.output / "rejected"):
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)
        final = []
        for relative in sorted(self._files):
            target = self.output / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.staging / relative, target)
            final.append(target)
        shutil.rmtree(self.staging)
        return final

    def abort(self) -> None:
        self._close()
        shutil.rmtree(self.staging, ignore_errors=True)


def _kept_path(record: dict, split_by_language: bool) -> str:
    if not split_by_language:
        return KEPT_NAME
    return f"kept/{record.get('language') or 'und'}/{KEPT_NAME}"


def _prepare_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise InputError(f"--output {output} is a file; clean writes a folder")
    (output / "stats.json").unlink(missing_ok=True)
    (output / "manifest.json").unlink(missing_ok=True)


def clean_corpus(
    inputs: Iterable[str | Path],
    output: str | Path,
    pipeline: str | Path = "default",
    workers: int = 1,
    text_key: str = "text",
    split_by_language: bool = False,
    *,
    progress: bool = True,
) -> dict:
    """Clean every document of `inputs` into the folder `output`; returns the stats written to stats.json."""
    started, start = time.time(), time.perf_counter()
    paths, output = check_inputs(inputs), Path(output)
    pipeline_path = resolve_pipeline_path(pipeline)
    spec = load_pipeline_spec(pipeline_path)
    if split_by_language and not any(step["type"] == "language" for step in spec):
        spec = [*spec, LABEL_LANGUAGE_STEP]
    step_names = [name for name, _ in built_steps(spec)]
    _prepare_output(output)
    stats, sizes = JsonlStats(), []
    rejected_by = {name: Counter() for name in step_names}
    kept_by_language: Counter = Counter()
    kept = 0
    outputs = _StagedOutputs(output)
    try:
        with Progress("clean", progress) as bar:
            chunks = _chunks(iter_jsonl(paths, text_key, stats), text_key, sizes)
            for position, outcomes in enumerate(
                imap_ordered(clean_chunk, ((spec, chunk, text_key) for chunk in chunks), workers)
            ):
                for record, rejection in outcomes:
                    if rejection is None:
                        kept += 1
                        if "language" in record:
                            kept_by_language[record["language"]] += 1
                        outputs.write(_kept_path(record, split_by_language), record)
                    else:
                        step, rule, detail = rejection
                        rejected_by[step][rule] += 1
                        outputs.write(
                            f"rejected/{step}.jsonl", {**record, "rejected_by": step, "reason": rule, "detail": detail}
                        )
                bar.update(len(outcomes), sizes[position], kept=kept)
        if stats.documents == 0:
            raise InputError(
                f"no documents with a string {text_key!r} field in {', '.join(map(str, paths))}; nothing written"
            )
        written = outputs.commit()
    except BaseException:
        outputs.abort()
        raise
    seconds = time.perf_counter() - start
    result = {
        "pipeline": str(pipeline_path),
        "steps": step_names,
        "documents": stats.documents,
        "kept": kept,
        "rejected": stats.documents - kept,
        "bad_lines": stats.bad_lines,
        "blank_lines": stats.blank_lines,
        "lines": stats.lines,
        "rejected_by": {
            name: {"documents": sum(rules.values()), "rules": dict(rules.most_common())}
            for name, rules in rejected_by.items()
        },
        **({"kept_by_language": dict(kept_by_language.most_common())} if kept_by_language else {}),
        "input_mb": round(sum(sizes) / 1e6, 2),
        "seconds": round(seconds, 2),
        "docs_per_s": round(stats.documents / seconds, 1),
        "mb_per_s": round(sum(sizes) / 1e6 / seconds, 2),
        "input": stats.as_dict(),
    }
    with atomic_path(output / "stats.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    write_manifest(
        output,
        command="loom data clean",
        inputs=paths,
        outputs=[*written, output / "stats.json"],
        parameters={
            "pipeline": str(pipeline_path),
            "steps": spec,
            "text_key": text_key,
            "workers": workers,
            "split_by_language": split_by_language,
        },
        counts={k: result[k] for k in ("documents", "kept", "rejected", "bad_lines", "blank_lines")},
        started=started,
        is_folder=True,
    )
    return result

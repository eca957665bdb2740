"""`loom data clean`: repair and filter JSONL documents through a TOML pipeline; nothing is lost silently.

The parent streams documents in chunks to workers (data_tools/parallel.py), which run the pipeline
(data_tools/pipeline.py) and send back, per document, the output record or the step and rule
that rejected it; the parent writes them in input order. Outputs in D:

    kept.jsonl                 kept documents, every input field kept, text repaired (with
                               --split-by-language: kept/<lang>/kept.jsonl instead)
    rejected/<step>.jsonl      each rejected document as it came in, plus rejected_by, reason, detail
    rejected/bad_lines.jsonl   each input line that is not a document: file, line, reason, detail, raw
    stats.json                 counts: documents = kept + rejected; lines = documents + bad + blank
    manifest.json              inputs with hashes, the pipeline, counts (written last)

Files are written under D/.staging-<host>-<pid>/ (engine/atomic.staging_folder: the next run removes one a
killed run left) and moved into place only when the whole input is done, so an interrupted run leaves the previous
complete output (or none). This module must not define
filters; those live in text_repair.py, quality_filters.py, line_filters.py and language.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

from loom.data_tools.atomic import atomic_path, staging_folder
from loom.data_tools.failures import reported_failures
from loom.data_tools.jsonl import (
    BAD_LINES_NAME,
    InputError,
    JsonlStats,
    check_inputs,
    count_lines,
    estimated_input_bytes,
    iter_jsonl,
    no_documents,
)
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
        self.staging = staging_folder(output)
        self._files: dict[str, IO[str]] = {}
        self._committed: list[Path] = []

    def write(self, relative: str, record: dict) -> None:
        self.open(relative).write(json.dumps(record, ensure_ascii=False) + "\n")

    def open(self, relative: str) -> IO[str]:
        """The staged file `relative`, created (empty) on first use."""
        out = self._files.get(relative)
        if out is None:
            path = self.staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            out = self._files[relative] = open(path, "w", encoding="utf-8", buffering=1 << 20)
        return out

    def _close(self) -> None:
        for out in self._files.values():
            out.close()

    def _discard(self) -> None:
        for out in self._files.values():
            try:
                out.close()
            except OSError:
                pass  # on a full disk the close's flush fails again; the file is closed anyway and removed

    def commit(self) -> list[Path]:
        """Replace the previous run's kept/rejected files with these; returns the final paths."""
        self._close()
        for old in (self.output / KEPT_NAME, self.output / "kept", self.output / "rejected"):
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)
        for relative in sorted(self._files):
            target = self.output / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.staging / relative, target)
            self._committed.append(target)
        shutil.rmtree(self.staging)
        return list(self._committed)

    def abort(self) -> None:
        """Remove everything this run wrote, committed files included (they would look finished without
        their stats and manifest); never raises, so the error that caused the abort is the one reported."""
        self._discard()
        shutil.rmtree(self.staging, ignore_errors=True)
        for path in self._committed:
            with suppress(OSError):
                path.unlink(missing_ok=True)
                for folder in path.parents:
                    if folder == self.output:
                        break
                    folder.rmdir()  # raises, and so stops, at the first folder that still holds files


def _kept_path(record: dict, split_by_language: bool) -> str:
    if not split_by_language:
        return KEPT_NAME
    return f"kept/{record.get('language') or 'und'}/{KEPT_NAME}"


def _prepare_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise InputError(f"--output {output} is a file; clean writes a folder")
    (output / "stats.json").unlink(missing_ok=True)
    (output / "manifest.json").unlink(missing_ok=True)


@dataclass
class _Tally:
    """What a run has seen so far: input counts, kept documents, rejections by step and rule."""

    step_names: list[str]
    stats: JsonlStats = field(default_factory=JsonlStats)
    sizes: list[int] = field(default_factory=list)  # UTF-8 bytes of each chunk's texts, for MB/s
    kept: int = 0
    kept_by_language: Counter = field(default_factory=Counter)
    rejected_by: dict[str, Counter] = field(init=False)

    def __post_init__(self) -> None:
        self.rejected_by = {name: Counter() for name in self.step_names}

    def write(self, outcomes: list[tuple], outputs: _StagedOutputs, split_by_language: bool) -> None:
        """Write one chunk's kept and rejected documents, in order, and count them."""
        for record, rejection in outcomes:
            if rejection is None:
                self.kept += 1
                if "language" in record:
                    self.kept_by_language[record["language"]] += 1
                outputs.write(_kept_path(record, split_by_language), record)
            else:
                step, rule, detail = rejection
                self.rejected_by[step][rule] += 1
                rejected = {**record, "rejected_by": step, "reason": rule, "detail": detail}
                outputs.write(f"rejected/{step}.jsonl", rejected)

    def result(self, pipeline_path: Path, seconds: float) -> dict:
        """The stats.json of the run."""
        documents, input_mb = self.stats.documents, sum(self.sizes) / 1e6
        return {
            "pipeline": str(pipeline_path),
            "steps": self.step_names,
            "documents": documents,
            "kept": self.kept,
            "rejected": documents - self.kept,
            "bad_lines": self.stats.bad_lines,
            "blank_lines": self.stats.blank_lines,
            "repaired_utf8": self.stats.repaired_utf8,
            "lines": self.stats.lines,
            "rejected_by": {
                name: {"documents": sum(rules.values()), "rules": dict(rules.most_common())}
                for name, rules in self.rejected_by.items()
            },
            **({"kept_by_language": dict(self.kept_by_language.most_common())} if self.kept_by_language else {}),
            "input_mb": round(input_mb, 2),
            "seconds": round(seconds, 2),
            "docs_per_s": round(documents / seconds, 1),
            "mb_per_s": round(input_mb / seconds, 2),
            "input": self.stats.as_dict(),
        }


def _clean_into(
    outputs: _StagedOutputs,
    paths: list[Path],
    spec: list[dict],
    tally: _Tally,
    text_key: str,
    workers: int,
    split_by_language: bool,
    progress: bool,
) -> None:
    """Run the pipeline over every document of `paths` into the staged outputs, with a progress bar."""
    with Progress("clean", progress, total=count_lines(paths)) as bar:
        records = iter_jsonl(paths, text_key, tally.stats, lambda bad: outputs.write(f"rejected/{BAD_LINES_NAME}", bad))
        chunks = _chunks(records, text_key, tally.sizes)
        with closing(imap_ordered(clean_chunk, ((spec, chunk, text_key) for chunk in chunks), workers)) as cleaned:
            for position, outcomes in enumerate(cleaned):
                tally.write(outcomes, outputs, split_by_language)
                bar.update(len(outcomes), tally.sizes[position], kept=tally.kept)


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
    tally = _Tally([name for name, _ in built_steps(spec)])
    with reported_failures(output, estimated_input_bytes(paths)):
        _prepare_output(output)
        outputs = _StagedOutputs(output)
        try:
            _clean_into(outputs, paths, spec, tally, text_key, workers, split_by_language, progress)
            if tally.stats.documents == 0:
                raise InputError(f"{no_documents(text_key, paths)}; nothing written")
            if not split_by_language:  # the next stage reads it: present, even when empty
                outputs.open(KEPT_NAME)
            written = outputs.commit()
            result = tally.result(pipeline_path, time.perf_counter() - start)
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
        except BaseException:
            outputs.abort()
            (output / "stats.json").unlink(missing_ok=True)
            raise
    return result

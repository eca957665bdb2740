"""manifest.json: the lineage of what a data command wrote (inputs with sizes and sha256, parameters, counts).

Folder outputs (clean, dedup) get OUTPUT/manifest.json; file and prefix outputs (corpus, tokenizer,
build) get `<output>.manifest.json` beside them, so several steps can share one folder. Outputs
are hashed too, so one step's output hash matches the next step's input hash. The manifest is
written atomically and last: its presence says the step finished. This module must not know what
any command does; callers pass their parameters and counts.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Iterable

from loom.data_tools.atomic import atomic_path
from loom.engine.data.tokenizer_json import settings_of

MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 1 << 22
# Libraries whose version changes what a data step produces.
_RECORDED_PACKAGES = ("numpy", "sentencepiece", "ftfy", "py3langid", "datasketch")
_REPO = Path(__file__).resolve().parent.parent


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(paths: Iterable[str | Path], root: Path | None = None) -> list[dict]:
    """[{path, bytes, sha256}] for each file; paths are relative to root when given."""
    described = []
    for path in map(Path, paths):
        shown = path.relative_to(root).as_posix() if root is not None else str(path)
        described.append({"path": shown, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    return described


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The loom checkout's commit, when loom runs from a git work tree."""
    if not (_REPO / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def software() -> dict:
    versions = {name: _version(name) for name in _RECORDED_PACKAGES}
    return {
        "loom": _version("loom") or "unknown",
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        **{k: v for k, v in versions.items() if v},
    }


def _timestamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def manifest_path(output: str | Path, is_folder: bool) -> Path:
    """Where the manifest of an output goes: inside a folder, or beside a file or prefix."""
    output = Path(output)
    return output / MANIFEST_NAME if is_folder else output.with_name(f"{output.name}.{MANIFEST_NAME}")


def write_manifest(
    output: str | Path,
    *,
    command: str,
    inputs: Iterable[str | Path],
    outputs: Iterable[str | Path],
    parameters: dict,
    counts: dict,
    started: float,
    is_folder: bool,
) -> Path:
    """Write the manifest of one finished step (started: its time.time() at start); returns its path."""
    output = Path(output)
    root = output if is_folder else None
    manifest = {
        "command": command,
        "created": _timestamp(time.time()),
        "started": _timestamp(started),
        "seconds": round(time.time() - started, 2),
        "software": software(),
        "parameters": parameters,
        "inputs": describe_files(inputs),
        "outputs": describe_files(sorted(map(Path, outputs)), root),
        "counts": counts,
    }
    path = manifest_path(output, is_folder)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    return path


def remove_dataset(prefix: str | Path) -> None:
    """Remove a .bin/.idx dataset and its manifest, as a writer that failed before its manifest was written: a
    dataset without its manifest (or beside an older one) would look finished, and the rerun be refused."""
    from loom.engine.data.indexed import index_paths

    for path in (*reversed(index_paths(prefix)), manifest_path(prefix, is_folder=False)):
        path.unlink(missing_ok=True)


def read_manifest(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _dataset_manifest(prefix: str | Path) -> dict | None:
    """The manifest of dataset `prefix` when `loom data build` or `loom data merge` wrote it; None otherwise (a
    dataset from elsewhere, or no readable manifest)."""
    try:
        manifest = read_manifest(manifest_path(prefix, is_folder=False))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("command") not in ("loom data build", "loom data merge"):
        return None
    return manifest


def built_with_tokenizer(prefix: str | Path) -> tuple[str, str] | None:
    """(path, sha256) of the tokenizer dataset `prefix` was built with, as its manifest (`loom data build`'s, or a
    merge's of datasets that all recorded it) says; None where none says (a dataset from elsewhere)."""
    manifest = _dataset_manifest(prefix)
    try:
        parameters = manifest["parameters"]
        if manifest["command"] == "loom data merge":
            return str(parameters["tokenizer"]), parameters["tokenizer_sha256"]
        tokenizer = parameters["tokenizer"]
        [sha256] = [entry["sha256"] for entry in manifest["inputs"] if entry["path"] == str(tokenizer)]
    except (ValueError, KeyError, TypeError):  # None, or a manifest without these facts
        return None
    return str(tokenizer), sha256


def tokenizer_settings(tokenizer: str | Path) -> list[Path]:
    """The settings file beside tokenizer.json `tokenizer` (which tokens are bos and eos) when there is one, which a
    dataset's manifest lists among its inputs; [] for a SentencePiece model, which carries its own."""
    settings = settings_of(tokenizer)
    return [settings] if settings is not None and settings.is_file() else []


def _recorded_end_of_document(prefix: str) -> int | None:
    """The id that ends each document of dataset `prefix`, as `loom data build --append-eod` (or a merge of datasets
    that all recorded the same) recorded it; None when it recorded none (built without it, or before loom did)."""
    try:
        recorded = _dataset_manifest(prefix)["parameters"].get("eod_id")
    except (KeyError, TypeError, AttributeError):  # None, or a manifest without these facts
        return None
    return recorded if isinstance(recorded, int) else None


def common_end_of_document(prefixes: list[str]) -> int | None:
    """The id that ends each document of every dataset `prefixes`, which their merge records; None where one of them
    recorded none. Refuses datasets whose documents end with different ids (the tokenizer's eos setting changed
    between their builds): merged, the model would learn one of them as text."""
    from loom.data_tools.jsonl import InputError

    recorded = {prefix: _recorded_end_of_document(prefix) for prefix in prefixes}
    first_with: dict[int, str] = {}  # each recorded id, and the first dataset that ends its documents with it
    for prefix, eod in recorded.items():
        if eod is not None:
            first_with.setdefault(eod, prefix)
    if len(first_with) > 1:
        (first_eod, first_prefix), (other_eod, other_prefix) = list(first_with.items())[:2]
        raise InputError(
            f"{first_prefix} ends each document with token {first_eod} and {other_prefix} with token {other_eod} "
            "(the tokenizer's eos setting changed between the builds): merged, one of them would have no "
            "end-of-document id the model knows; rebuild them with the same tokenizer settings"
        )
    return None if None in recorded.values() else next(iter(first_with), None)


def _check_same_end_of_document(prefixes: list[str], tokenizer: str | Path) -> None:
    """Refuse tokenizer.json `tokenizer` (the one the datasets `prefixes` were built with) when the eos its settings
    file names now is another id than the one that ends each document of one of them (an edit elsewhere in the file,
    a chat template, changes nothing a dataset holds). The tokenizer is read once, and only if a dataset asks."""
    from loom.data_tools.jsonl import InputError
    from loom.engine.data.tokenizer_json import open_tokenizer

    settings = settings_of(tokenizer)
    if settings is None:
        return
    eos = None
    for prefix in prefixes:
        recorded = _recorded_end_of_document(prefix)
        if recorded is None:
            continue
        eos = open_tokenizer(tokenizer).eos_id() if eos is None else eos
        if eos != recorded:
            raise InputError(
                f"dataset {prefix} ends each document with token {recorded}, the eos of {tokenizer} when it was "
                f"built, but {settings} now names {'no eos' if eos < 0 else f'token {eos}'} as eos; restore the "
                "settings it was built with, or rebuild the dataset"
            )


def built_with_eod(prefix: str | Path) -> bool | None:
    """Whether dataset `prefix` ends each document with the end-of-document id (`loom data build --append-eod`,
    or a merge of datasets that all did or all did not), as its manifest says; None where none says."""
    manifest = _dataset_manifest(prefix)
    try:
        value = manifest["parameters"].get("append_eod")
    except (KeyError, TypeError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def check_same_tokenizer(prefixes: list[str], tokenizer: str | Path | None = None) -> tuple[str, str] | None:
    """Refuse datasets built with different tokenizers, or with another tokenizer than `tokenizer`: their token
    ids mean other text (a model would train on noise, a preview decode garbage). Returns the tokenizer every
    dataset records ((path, sha256)), or None if some record none."""
    from loom.data_tools.jsonl import InputError

    recorded = {prefix: found for prefix in prefixes if (found := built_with_tokenizer(prefix)) is not None}
    if tokenizer is not None and recorded and Path(tokenizer).is_file():
        given = sha256_file(tokenizer)
        for prefix, (path, sha256) in recorded.items():
            if sha256 != given and Path(path).resolve() == Path(tokenizer).resolve():
                raise InputError(
                    f"tokenizer {tokenizer} has changed since dataset {prefix} was built with it (its sha256 differs; "
                    "a `loom data tokenizer --overwrite` keeps the old one in replaced/<time>/); rebuild the dataset "
                    "with it, or give the one it was built with"
                )
            if sha256 != given:
                raise InputError(
                    f"dataset {prefix} was built with tokenizer {path}, not {tokenizer} (their sha256 differ); give "
                    "the tokenizer the dataset was built with"
                )
        _check_same_end_of_document(list(recorded), tokenizer)
    if len({sha256 for _, sha256 in recorded.values()}) > 1:
        shown = ", ".join(f"{prefix} ({path})" for prefix, (path, _) in recorded.items())
        raise InputError(f"the datasets were built with different tokenizers: {shown}; their token ids do not mix")
    return next(iter(recorded.values())) if len(recorded) == len(set(prefixes)) else None

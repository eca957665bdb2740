"""Cleaning pipelines: the registry of step types and the TOML pipeline files.

A pipeline is an ordered list of steps. A step looks at one Document and either changes it
(repairs, line removal, a language label) or returns a Rejected saying which rule removed it and
what it measured. Pipelines are written as TOML, one `[[step]]` table per step:

    [[step]]
    type = "gopher_quality"   # a key of step_types()
    name = "quality"          # optional: how reports call it (default: the type)
    for_languages = ["en"]    # optional: only documents a `language` step before it labelled so
    min_words = 50            # any field of the step's dataclass

The named pipelines ship in data_tools/pipelines/NAME.toml. This module must not read or write
corpora; clean.py does. Steps know only data_tools/document.py, never this registry, so the
imports run one way: pipeline -> filters -> document.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
from pathlib import Path
from typing import Any

from loom.data_tools.document import Document, Rejected, Step
from loom.data_tools.jsonl import InputError

PIPELINES_DIR = Path(__file__).resolve().parent / "pipelines"


def _registry() -> dict[str, type]:
    # Imported here so that `pipeline` stays importable without ftfy or py3langid installed.
    from loom.data_tools import language, line_filters, quality_filters, text_repair

    types = {}
    for module in (text_repair, quality_filters, line_filters, language):
        for cls in module.STEPS:
            types[cls.type_name] = cls
    return types


@functools.lru_cache(maxsize=1)
def step_types() -> dict[str, type]:
    """Every step type by the name pipeline files use."""
    return _registry()


def _check_value(type_name: str, key: str, value: Any, default: Any) -> Any:
    """The parameter value converted to the default's type, or a one-line InputError."""
    if isinstance(default, bool) or default is None:
        ok = isinstance(value, bool) if isinstance(default, bool) else True
    elif isinstance(default, (int, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if isinstance(default, float) and ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, list)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise InputError(f"step {type_name!r}: {key} = {value!r} should be like {default!r}")
    if isinstance(default, (int, float)) and not isinstance(default, bool) and not value >= 0:
        raise InputError(f"step {type_name!r}: {key} = {value!r} must be >= 0 (counts, lengths and fractions all are)")
    return value


@dataclasses.dataclass
class ForLanguages:
    """A step that judges only documents labelled with one of `languages` and passes the others untouched, as FineWeb
    runs its English rules on English alone (Gopher's stop words and word counts reject every Chinese page)."""

    step: Step
    languages: tuple[str, ...]

    def __call__(self, doc: Document) -> Rejected | None:
        return self.step(doc) if doc.metadata.get("language") in self.languages else None


def _for_languages(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(code, str) for code in value):
        raise InputError(f"step {name!r}: for_languages = {value!r} should be a list of codes like ['en']")
    from loom.data_tools.language import check_language_codes

    try:
        check_language_codes(value)
    except ValueError as error:
        raise InputError(f"step {name!r}: for_languages has {error}") from None
    return tuple(value)


def build_step(spec: dict) -> tuple[str, Step]:
    """(report name, step) for one `[[step]]` table; unknown types or parameters are one-line errors."""
    spec = dict(spec)
    type_name = spec.pop("type", None)
    languages = spec.pop("for_languages", None)
    types = step_types()
    if type_name is None:
        raise InputError(
            f"a pipeline step has no type (its keys: {', '.join(spec) or 'none'}); give each [[step]] a "
            f"type = one of {', '.join(sorted(types))}"
        )
    if type_name not in types:
        raise InputError(f"pipeline step type {type_name!r} is unknown; known: {', '.join(sorted(types))}")
    name = str(spec.pop("name", type_name))
    cls = types[type_name]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    params = {}
    for key, value in spec.items():
        if key not in fields:
            raise InputError(f"step {type_name!r} has no parameter {key!r}; it takes {', '.join(fields) or 'none'}")
        default = fields[key].default
        if default is dataclasses.MISSING and fields[key].default_factory is not dataclasses.MISSING:
            default = fields[key].default_factory()
        params[key] = _check_value(type_name, key, value, default)
    try:
        step = cls(**params)
    except ValueError as error:
        raise InputError(f"step {name!r}: {error}") from None
    return name, step if languages is None else ForLanguages(step, _for_languages(name, languages))


def resolve_pipeline_path(pipeline: str | Path) -> Path:
    """A pipeline file as given, or a shipped one by name (`default`, `code`, `minimal`)."""
    path = Path(pipeline)
    if path.is_file():
        return path
    shipped = PIPELINES_DIR / f"{pipeline}.toml"
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in PIPELINES_DIR.glob("*.toml"))
    raise FileNotFoundError(f"pipeline {pipeline} is neither a file nor a shipped pipeline ({', '.join(names)})")


def load_pipeline_spec(pipeline: str | Path) -> list[dict]:
    """The ordered `[[step]]` tables of a pipeline file, validated by building every step once."""
    path = resolve_pipeline_path(pipeline)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"pipeline {path} is not valid TOML: {error}") from None
    steps = raw.get("step")
    if not isinstance(steps, list) or not steps:
        raise InputError(f"pipeline {path} has no [[step]] tables")
    names = [build_step(spec)[0] for spec in steps]
    if len(set(names)) != len(names):
        raise InputError(f"pipeline {path}: two steps share a name; give one a `name = ...`")
    labelled = False
    for name, spec in zip(names, steps):
        if "for_languages" in spec and not labelled:
            raise InputError(
                f"pipeline {path}: step {name!r} has for_languages, but no `language` step before it labels the "
                "documents; add one (languages = [] keeps every language and only labels)"
            )
        labelled = labelled or spec.get("type") == "language"
    return steps


@functools.lru_cache(maxsize=4)
def _built(spec_json: str) -> tuple[tuple[str, Step], ...]:
    return tuple(build_step(spec) for spec in json.loads(spec_json))


def built_steps(spec: list[dict]) -> tuple[tuple[str, Step], ...]:
    """The steps of a spec, built once per process (a language model is loaded once per worker)."""
    return _built(json.dumps(spec, sort_keys=True))


Outcome = tuple[dict, "tuple[str, Rejected] | None"]


def apply_steps(steps: tuple[tuple[str, Step], ...], record: dict, text_key: str) -> Outcome:
    """(output record, None) if every step kept the document, else (input record, (step name, Rejected))."""
    doc = Document(record[text_key])
    for name, step in steps:
        rejected = step(doc)
        if rejected is not None:
            return {**record, **doc.metadata}, (name, rejected)
    return {**record, text_key: doc.text, **doc.metadata}, None

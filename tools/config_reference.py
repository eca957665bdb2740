"""docs/config.md: every config field with its type, default and docstring, written from engine/config/ (the one
place they live; tests/test_config.py checks the page is current).

    python -m loom.tools.config_reference > docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import typing

from loom.engine.config import LoomConfig, field_default
from loom.engine.names_elsewhere import DATA_BUILD_NAMES, SUBMIT_LAUNCH_NAMES, TRAIN_LAUNCH_NAMES, TRAINING_NAMES

INTRODUCTION = """\
# Configuration reference

Every field of a run's configuration: set it in a TOML file's `[section]`, or on the command line as
`--section.field value` (flags win over the file, the file over these defaults: `loom train --config C.toml
--print-config` shows the result). A run directory's `config.toml` is this configuration, resolved. Written from the
field docstrings in `engine/config/` by `python -m loom.tools.config_reference > docs/config.md`.
"""


def field_docstrings(cls: type) -> dict[str, str]:
    """{field: the string literal written under it in the class body} (the attribute docstrings Python itself does
    not keep), each joined into one paragraph; the class's own docstring under ""."""
    definition = ast.parse(inspect.getsource(cls)).body[0]
    body, docs = definition.body, {"": " ".join((ast.get_docstring(definition) or "").split())}
    for statement, following in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def _type_of(annotation: object) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(str(choice) for choice in typing.get_args(annotation))
    return str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("|", "\\|")


def _default_of(spec: dataclasses.Field) -> str:
    value = field_default(spec)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()  # as TOML writes it
    if isinstance(value, (str, list)):
        return json.dumps(value)  # as TOML writes it
    return repr(value)


def reference() -> str:
    """The page, as markdown."""
    lines = [INTRODUCTION]
    for section in dataclasses.fields(LoomConfig):
        cls = section.default_factory
        hints, docs = typing.get_type_hints(cls), field_docstrings(cls)
        lines += [f"## [{section.name}]", "", *([docs[""], ""] if docs[""] else [])]
        lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for spec in dataclasses.fields(cls):
            if spec.name not in docs:
                raise ValueError(f"{cls.__name__}.{spec.name} has no docstring; write one under it")
            meaning = docs[spec.name].replace("|", "\\|")
            lines.append(
                f"| `{section.name}.{spec.name}` | {_type_of(hints[spec.name])} | `{_default_of(spec)}` | {meaning} |"
            )
        lines.append("")
    return "\n".join(lines + names_elsewhere())


def names_elsewhere() -> list[str]:
    """The page's last part: what Megatron-LM, torchtitan and torchrun call these settings (engine/names_elsewhere.py,
    which loom's errors also answer from)."""
    lines = [
        "## Names from Megatron-LM, torchtitan and torchrun",
        "",
        "loom does not take other engines' spellings, but answers them: `loom train --tensor-model-parallel-size 2`",
        "is refused with `--tensor-model-parallel-size (Megatron-LM) is --parallel.tp in loom`, and a torchtitan TOML",
        "file with a line for each of its settings.",
        "",
        "Scripts for either engine pass only what differs from its defaults, and several of those differ from loom's:",
        "a Megatron-LM GPT-3 recipe (examples/gpt3) that names none of them would train a Llama-shaped model here.",
        "Megatron-LM's -> loom's: learned_absolute positions -> rope; LayerNorm -> rmsnorm; gelu -> swiglu; biases",
        "-> none; tied embeddings -> untied; dropout 0.1 -> 0; fp32 -> bf16; weight decay 0.01 -> 0.1; Adam beta2",
        "0.999 -> 0.95; initial loss scale 2^32 -> 65536; split 969,30,1 -> 98,1,1; linear LR decay -> cosine; min",
        "LR 0 -> 3e-5; global batch micro-batch x dp -> 256. torchtitan's -> loom's: warmup 200 -> 0 steps; linear",
        "decay -> cosine; min LR factor 0 -> min LR 3e-5; global batch local batch x dp -> 256; and its weight decay",
        "reaches norms, loom's never. Megatron-LM's preprocess_data.py appends no end-of-document token unless",
        "--append-eod and names its output PREFIX_text_document; loom data build appends one unless --no-append-eod.",
        "The table, whole:",
        "",
        "| name elsewhere | from | loom | what differs |",
        "| --- | --- | --- | --- |",
    ]
    for names, where in (
        (TRAINING_NAMES, ""),
        (TRAIN_LAUNCH_NAMES, " (loom train)"),
        (SUBMIT_LAUNCH_NAMES, " (loom submit)"),
        (DATA_BUILD_NAMES, " (loom data build)"),
    ):
        for entry in names:
            loom = f"`{entry.loom}`" if entry.loom else "none"
            lines.append(f"| `{entry.name}` | {entry.engine}{where} | {loom} | {entry.note} |")
    return [*lines, ""]


if __name__ == "__main__":
    print(reference(), end="")

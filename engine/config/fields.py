"""What every config section shares: the error users see and the checks its fields run (a Literal type is
the one list of a field's choices)."""

from __future__ import annotations

import dataclasses
import functools
import typing
import unicodedata
from typing import Any, Literal

from loom.errors import LoomError


class ConfigError(LoomError):
    """A user-facing configuration problem; the message is one line saying what to change."""


def is_plain_name(name: str) -> bool:
    """Whether a run name can be a folder's own name (runs/<name>): not empty, `.` or `..`, no path separator and no
    control character (a tab or newline made a folder no shell lists plainly)."""
    return name not in ("", ".", "..") and not any(c in "/\\" or unicodedata.category(c) == "Cc" for c in name)


def field_default(spec: dataclasses.Field) -> Any:
    """A dataclass field's default value (calling its default_factory)."""
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


@functools.cache
def _literal_fields(cls: type) -> dict[str, tuple]:
    """{field: its allowed values} for the fields of config dataclass `cls` typed as a Literal."""
    hints = typing.get_type_hints(cls)
    return {
        spec.name: typing.get_args(hints[spec.name])
        for spec in dataclasses.fields(cls)
        if typing.get_origin(hints[spec.name]) is Literal
    }


def field_choices(cls: type, name: str) -> tuple:
    """The values a Literal-typed config field allows (its type annotation is the one list of them)."""
    return _literal_fields(cls)[name]


def check_choices(config: Any, section: str) -> None:
    """Every Literal-typed field of a config section holds one of its values."""
    for name, choices in _literal_fields(type(config)).items():
        value = getattr(config, name)
        if value not in choices:
            raise ConfigError(f"{section}.{name} = {value!r} is not one of {', '.join(map(str, choices))}")


def check_positive(section: str, **values: Any) -> None:
    """Every value given that is not None is above 0, NaN not (named as section.name in the error)."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{section}.{name} must be positive, got {value}")

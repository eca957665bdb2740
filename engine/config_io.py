"""Reading configs: TOML files and `--section.field value` overrides into a validated LoomConfig.

Values are coerced to each field's declared type with one-line errors (unknown names get a
"did you mean"); the resolved config is written back as TOML for the run directory. The
dataclasses themselves live in engine/config/.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from loom.engine.config import ConfigError, LoomConfig, TrainConfig, is_plain_name
from loom.engine.names_elsewhere import TORCHTITAN, TRAINING_NAMES, Answer, answers

SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(LoomConfig)}
_SECTION_TYPES = {name: typing.get_type_hints(LoomConfig)[name] for name in SECTIONS}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _coerce(where: str, hint: Any, value: Any) -> Any:
    """Turn a TOML value or a command-line string into the field's declared type, or say why not."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(where, inner[0], value)
    if origin is typing.Literal:
        if isinstance(value, bool) and "true" in args:  # TOML's true/false for a field that also has "auto"
            value = "true" if value else "false"
        if value not in args:
            raise ConfigError(f"{where} = {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is list:
        items = value if isinstance(value, list) else [value]
        return [_coerce(where, args[0], v) for v in items]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} expects true or false, got {value!r}")
    if hint is int or hint is float:
        kind = "an integer" if hint is int else "a number"
        if isinstance(value, bool) or (hint is int and isinstance(value, float)):
            raise ConfigError(f"{where} expects {kind}, got {value!r}")
        try:
            number = hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} expects {kind}, got {value!r}") from None
        # Beyond these a value overflows the int64 and float tensors it feeds, or poisons every step (NaN).
        if hint is int and not -(2**63) <= number < 2**63:
            raise ConfigError(f"{where} = {number} is out of range (more than 2**63)")
        if hint is float and not math.isfinite(number):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} expects a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported field type {hint}")


_TORCHTITAN_SECTIONS = {entry.name.split(".")[0] for entry in TRAINING_NAMES if entry.engine == TORCHTITAN}


def _unknown(kind: str, name: str, known: list[str], as_written: list[tuple[str, str | None]]) -> ConfigError:
    """`as_written`: the names as the user wrote them, with their values (torchtitan's names for loom settings)."""
    told = [answer for written in as_written for answer in _answers_for(*written)]
    if told:
        return ConfigError(f"unknown {kind} {name!r}: {'; '.join(answer.clause() for answer in told)}")
    if kind == "config section" and name in _TORCHTITAN_SECTIONS:
        return ConfigError(f"unknown config section {name!r}, torchtitan's; loom's settings: docs/config.md")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"
    return ConfigError(f"unknown {kind} {name!r}{hint}")


def _names_not_loom(raw: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The dotted names in `raw` that are no loom setting (each key of an unknown section, unknown fields), with
    their values as a command line would write them."""
    names = []
    for section_name, values in raw.items():
        known = _field_types(_SECTION_TYPES[section_name]) if section_name in SECTIONS else {}
        if not isinstance(values, dict):
            names += [] if known else [(section_name, _shown(values))]
            continue
        names += [(f"{section_name}.{key}", _shown(value)) for key, value in values.items() if key not in known]
    return names


def _shown(value: Any) -> str | None:
    """A TOML value as its flag would take it (true, 2, a b), or None for a table."""
    if isinstance(value, dict):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def _answers_for(name: str, value: str | None) -> list[Answer]:
    """loom's name for a key of a config file or a dotted flag: torchtitan's name for it, or a loom field outside its
    section (first for a key outside any section: Megatron-LM's flags are no TOML keys)."""
    if "." not in name and (fields := answers([(name, value)], (), loom_fields=True)):
        return fields
    return answers([(name, value)], TRAINING_NAMES, loom_fields=True)


def _several_not_loom(names: list[tuple[str, str | None]], source: str) -> ConfigError:
    """One error for a config with several settings that are not loom's (a torchtitan config, most likely): a line
    for each, with loom's setting where it has one, rather than one at a time over as many runs."""
    known = [f"{section}.{field}" for section, cls in _SECTION_TYPES.items() for field in _field_types(cls)]
    lines = []
    for name, value in names:
        told = _answers_for(name, value)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        lines.append(
            told[0].line() if told else f"  {name}: no loom setting{f'; did you mean {close[0]}?' if close else ''}"
        )
    return ConfigError(
        f"{len(names)} settings in {source} are not loom's; loom's names for them, where it has one (all of its "
        "settings: docs/config.md):\n" + "\n".join(lines)
    )


def config_from_dict(raw: dict[str, Any], source: str = "the config") -> LoomConfig:
    """Build a validated LoomConfig from nested sections (as read from TOML at `source`)."""
    not_loom = _names_not_loom(raw)
    if len(not_loom) > 1:
        raise _several_not_loom(not_loom, source)
    # From here at most one name is not loom's (the one refused below; none for an empty unknown section)
    sections = {}
    for section_name, values in raw.items():
        if section_name not in SECTIONS:
            kind = "config section" if isinstance(values, dict) else "key outside a [section]"
            raise _unknown(kind, section_name, list(SECTIONS), not_loom)
        if not isinstance(values, dict):
            raise ConfigError(f"[{section_name}] must be a table of fields")
        cls = _SECTION_TYPES[section_name]
        hints = _field_types(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in hints:
                raise _unknown(f"field in [{section_name}]", key, list(hints), not_loom)
            kwargs[key] = _coerce(f"{section_name}.{key}", hints[key], value)
        sections[section_name] = cls(**kwargs)
    return LoomConfig(**sections)


def names_a_field(flag: str) -> bool:
    """`--section.field` (or `--section.field=value`) naming one of loom's config fields."""
    section, _, name = flag.removeprefix("--").split("=", 1)[0].partition(".")
    return section in _SECTION_TYPES and name in _field_types(_SECTION_TYPES[section])


def is_override_flag(arg: str) -> bool:
    """`--section.field` or `--section.field=value`: an argument parse_overrides reads as a field to set."""
    return arg.startswith("--") and "." in arg.split("=", 1)[0]


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """Parse `--section.field value [value ...]` into nested raw values (strings, lists for several)."""
    overrides: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        if not is_override_flag(flag):
            raise ConfigError(f"unexpected argument {flag!r}; overrides look like --train.steps 50")
        key = flag[2:]
        if "=" in key:
            key, inline = key.split("=", 1)
            values, i = [inline], i + 1
        else:
            values, i = [], i + 1
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise _unknown("config section", section, list(SECTIONS), [(f"--{key}", " ".join(values) or None)])
        hints = _field_types(_SECTION_TYPES[section])
        if name not in hints:
            raise _unknown(f"field in [{section}]", name, list(hints), [(f"--{key}", " ".join(values) or None)])
        if not values:
            raise ConfigError(f"--{key} needs a value")
        is_list = typing.get_origin(hints[name]) is list or list in [
            typing.get_origin(a) for a in typing.get_args(hints[name])
        ]
        overrides.setdefault(section, {})[name] = (
            values if is_list else (values[0] if len(values) == 1 else _too_many(key, values))
        )
    return overrides


def _too_many(key: str, values: list[str]) -> Any:
    raise ConfigError(f"--{key} takes one value, got {' '.join(values)}")


PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"


def resolve_config_path(path: str | Path) -> Path:
    """A config file as given, else a preset shipped with loom: `tiny`, `tiny.toml` or `configs/tiny.toml`."""
    given = Path(path)
    if given.is_file():
        return given
    if given.is_dir():
        raise ConfigError(f"config {path} is a directory; give a TOML file (e.g. {given / 'config.toml'}) or a preset")
    name = given.name if given.parent == Path("configs") else str(given)
    for candidate in (PRESETS_DIR / name, PRESETS_DIR / f"{name}.toml"):
        if candidate.is_file():
            return candidate
    presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.toml")))
    raise ConfigError(f"config file {path} does not exist (presets: {presets})")


def load_config(path: str | Path | None, overrides: list[str] | dict | None = None) -> LoomConfig:
    """Read a TOML config (a path or a preset name; None starts from defaults), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM, as Windows editors write, too
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    overrides = overrides or {}
    for section, values in overrides.items():
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ConfigError(f"[{section}] must be a table of fields")
        if section == "train" and "name" in values and "run_dir" not in values:
            _forget_derived_run_dir(raw["train"], values["name"])
        raw[section].update(values)
    config = config_from_dict(raw, str(path) if path is not None else "the config")
    config.model_fields_given = frozenset(raw.get("model", {}))
    config.model_fields_flagged = frozenset(overrides.get("model", {}))
    return config


def _forget_derived_run_dir(train: dict[str, Any], new_name: Any) -> None:
    """A run's saved config.toml holds the run_dir its name gave (runs/<name>, made absolute by `loom submit`): fed
    back with --train.name NEW, the new run resumed and rewrote the old one in its folder. A run_dir named after the
    file's own run in a runs/ folder follows the new name there; with any other folder the new name is refused."""
    name, run_dir = train.get("name", TrainConfig.name), train.get("run_dir")
    if not isinstance(run_dir, str) or new_name == name:
        return
    if Path(run_dir).parts[-2:] != ("runs", name):  # a folder chosen for that run: the new name would train there
        raise ConfigError(
            f"the config file sets train.run_dir = {run_dir} (run {name!r}); --train.name {new_name} would train in "
            "that folder, resuming its run: add --train.run_dir DIR for the new run"
        )
    if isinstance(new_name, str) and is_plain_name(new_name):
        train["run_dir"] = str(Path(run_dir).parent / new_name)
    else:
        del train["run_dir"]  # derived from the new name, which TrainConfig then refuses in its own words


def config_to_dict(config: LoomConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)


def config_to_toml(config: LoomConfig) -> str:
    """The fully resolved config as TOML. TOML has no null: a field left unset is a comment, so that it stays None on
    reload and a reader still finds it (`--print-config` lists every field)."""
    lines = []
    for section, values in config_to_dict(config).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}" if value is not None else f"# {key} = (not set)")
        lines.append("")
    return "\n".join(lines)


def _toml_character(c: str) -> str:
    """A character as a TOML basic string holds it: a control character (a newline in a run name) as an escape,
    else config.toml could not be read back."""
    if c in '\\"':
        return "\\" + c
    return c if " " <= c != "\x7f" else f"\\u{ord(c):04x}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(map(_toml_character, value)) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")

"""Config plumbing: CLI flags generated from component dataclasses, TOML files, resolved dumps.

Each component owns one dataclass next to its code (fields carry `metadata={"help": ...}`);
a command groups several under section names, e.g. {"train": TrainConfig, "engine": EngineConfig}.
Precedence: field defaults < TOML file (one table per section) < flags given on the command line.
Field names must be unique across a command's sections, since flags are flat (`--group-size`).

Knows: dataclasses, argparse, TOML. Does not know: what any field means.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message names the culprit."""


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional?) of a field annotation such as `int | None`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Coerce a TOML or string value to the field's type."""
    base, optional = _base_type(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "")):
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    origin = typing.get_origin(base)
    try:
        if origin is tuple:
            (item,) = {a for a in typing.get_args(base) if a is not Ellipsis}
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(item(v) for v in items if v != "")
        if base is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if base is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if base in (int, float, str):
            if isinstance(value, bool) or (base is not str and isinstance(value, str) and not value.strip()):
                raise ValueError(value)
            return base(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cannot read {value!r} as {getattr(base, '__name__', base)}") from None
    raise ConfigError(f"{where}: unsupported field type {tp}")


# Renamed fields: the old name (flag or TOML key) is refused with a message naming the new one.
RENAMED = {"num_steps": "draft_depth", "readme": "results_md", "vllm_drafter": "drafter",
           "num_speculative_tokens": "draft_depth", "spot_train": "adapt_drafter",
           "learner_min_steps": "drafter_min_steps"}


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed {_flag(RENAMED[self.dest])}")


def add_arguments(parser: argparse.ArgumentParser, sections: dict[str, type]) -> None:
    """One flag per field of every section; unset flags stay absent from the namespace."""
    seen: dict[str, str] = {}
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        for f, tp in _fields(cls):
            if f.name in seen:
                raise ConfigError(f"field {f.name!r} is in both [{seen[f.name]}] and [{section}]")
            seen[f.name] = section
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            helptext = f"{f.metadata.get('help', '')} (default: {default})"
            base, _ = _base_type(tp)
            if base is bool:
                group.add_argument(
                    _flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS, help=helptext,
                )
            else:
                choices = f.metadata.get("choices")
                group.add_argument(
                    _flag(f.name), dest=f.name, default=argparse.SUPPRESS, choices=choices,
                    metavar=None if choices else base.__name__.upper() if isinstance(base, type) else "VALUE",
                    help=helptext,
                )
    for old, new in RENAMED.items():
        if new in seen:
            parser.add_argument(_flag(old), dest=old, action=_Renamed, nargs="?", help=argparse.SUPPRESS)


def read_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def resolve(
    sections: dict[str, type],
    args: argparse.Namespace | None = None,
    toml: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Build each section's dataclass from defaults, then TOML tables, then flags."""
    toml = dict(toml or {})
    unknown_sections = set(toml) - set(sections)
    if "spec" in unknown_sections and "speculation" in sections:
        raise ConfigError("config section [spec] was renamed [speculation]")
    if unknown_sections:
        raise ConfigError(f"unknown config section(s) {sorted(unknown_sections)}; valid: {sorted(sections)}")
    given = vars(args) if args is not None else {}
    out = {}
    for section, cls in sections.items():
        table = dict(toml.get(section, {}))
        names = {f.name for f, _ in _fields(cls)}
        extra = set(table) - names
        renamed = sorted(k for k in extra if k in RENAMED)
        if renamed:
            raise ConfigError(f"[{section}] {renamed[0]} was renamed {RENAMED[renamed[0]]}")
        if extra:
            raise ConfigError(f"[{section}] has unknown key(s) {sorted(extra)}; valid: {sorted(names)}")
        kwargs = {}
        for f, tp in _fields(cls):
            if f.name in given:
                kwargs[f.name] = _convert(given[f.name], tp, _flag(f.name))
            elif f.name in table:
                kwargs[f.name] = _convert(table[f.name], tp, f"[{section}] {f.name}")
        try:
            out[section] = cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[{section}]: {e}") from None
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Path):
        v = str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise ConfigError(f"cannot write {v!r} to TOML")


def dump_toml(configs: dict[str, Any]) -> str:
    """The resolved configs as a TOML file that `resolve` reads back (None fields are omitted)."""
    lines = []
    for section, obj in configs.items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)

"""The trainer's config as a TOML file: reading one (checked against the config sections) and writing the
resolved config. The checkpoints, the loop, the model card and the CLI read and write configs through here.

A `[section]` table holds one section's settings; an unknown table or key is an error naming the valid
ones (a typo never passes silently). TOML has no null: `"none"` stands for None.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

from t5core.atomic import write_text_atomic
from trainer.config import TrainConfig

__all__ = [
    "NONE",
    "build_config",
    "config_from_toml_text",
    "config_to_toml",
    "load_toml",
    "save_config",
    "section_types",
    "toml_value",
]

NONE = "none"
"""How a TOML file or a flag writes None."""


def section_types() -> dict[str, type]:
    """Section name -> its dataclass, in the order of `TrainConfig`."""
    hints = typing.get_type_hints(TrainConfig)
    return {name: hints[name] for name in TrainConfig.sections()}


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML config file and check its tables and keys against the config sections.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: not valid TOML, or a table / key that is not a setting (names it and the valid ones).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist; check the --config path.")
    return _check_tables(path.read_text(encoding="utf-8"), str(path))


def _check_tables(text: str, origin: str) -> dict[str, dict[str, Any]]:
    import tomllib  # Python 3.11's; imported here so that the library's Python 3.10 floor can import this module

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config file {origin} is not valid TOML: {error}.") from error
    sections = section_types()
    for section, values in data.items():
        if section not in sections or not isinstance(values, dict):
            raise ValueError(f"config file {origin}: [{section}] is not a section; use one of {sorted(sections)}.")
        known = {item.name for item in dataclasses.fields(sections[section])}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"config file {origin}: [{section}] has unknown key(s) {unknown}; valid keys are {sorted(known)}."
            )
    return data


def build_config(values: dict[str, dict[str, Any]]) -> TrainConfig:
    """A `TrainConfig` of `{section: {key: value}}`, each value checked against its field's type."""
    built = {}
    for section, cls in section_types().items():
        hints = typing.get_type_hints(cls)
        given = {key: _coerce(value, hints[key], f"{section}.{key}") for key, value in values.get(section, {}).items()}
        built[section] = cls(**given)
    return TrainConfig(**built)


def _coerce(value: Any, hint: Any, flag: str) -> Any:
    """Check a TOML value against the field type (TOML has int/float/bool/str; `none` means None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() == NONE):
            return None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"--{flag}: {value!r} is not one of {list(choices)}.")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise TypeError(f"--{flag}: expected {hint.__name__}, got {type(value).__name__} {value!r}.")
    return value


def config_to_toml(config: TrainConfig) -> str:
    """The resolved config as TOML text (loads back to an equal config through `--config`)."""
    lines: list[str] = []
    for section in TrainConfig.sections():
        lines.append(f"[{section}]")
        for item in dataclasses.fields(getattr(config, section)):
            lines.append(f"{item.name} = {toml_value(getattr(getattr(config, section), item.name))}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """A setting's value as TOML text."""
    if value is None:
        return f'"{NONE}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def save_config(config: TrainConfig, path: str | Path) -> Path:
    """Write the resolved config as TOML, atomically (temp file then rename)."""
    return write_text_atomic(path, config_to_toml(config))


def config_from_toml_text(text: str) -> TrainConfig:
    """Build a config from TOML text (used to compare a resumed run's config with the saved one)."""
    return build_config(_check_tables(text, "<saved config>"))

"""Flags and `--help` generated from the config sections in `trainer.config` (TOML files: `trainer.config_file`).

Each field `x` of section `s` is the flag `--s.x` and the key `x` of the TOML table `[s]`; its help
text is the field's docstring. Precedence: defaults < `--config FILE` < flags; a run that starts from a
T5 weights file (`--model.start_from`) takes the file's `--model` settings where neither sets them (defaults
< the file < `--config FILE` < flags). Unknown TOML keys are errors (a typo never passes silently).
`add_flags` is the one flag generator: the trainer's other commands (`trainer/push.py`,
`python -m sd3_testbed.pretrain`) build their flags with it too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Collection
from typing import Any, Literal

from trainer.config import TrainConfig
from trainer.config_file import NONE, build_config, load_toml, section_types, toml_value
from trainer.from_file import file_settings
from trainer.presets import check_config

__all__ = ["add_flags", "build_parser", "parse_args"]


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _converter(hint: Any, flag: str) -> tuple[Any, list[str] | None, str | None]:
    """A string -> value parser for a field type, and its choices and metavar for `--help`."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return str, [str(choice) for choice in typing.get_args(hint)], None
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        parse, _, metavar = _converter(inner[0], flag)

        def optional(text: str) -> Any:
            return None if text.lower() == NONE else parse(text)

        return optional, None, f"{metavar}|{NONE}"
    if hint is bool:
        return _parse_bool, None, "BOOL"
    if hint in (int, float, str):
        return hint, None, hint.__name__.upper()
    raise TypeError(f"config field {flag} has type {hint}, which the CLI cannot parse.")


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    section: str = "",
    only: Collection[str] | None = None,
    required: Collection[str] = (),
) -> None:
    """Add one flag per field of the dataclass `cls`: `--section.field`, or `--field-name` without a
    section (underscores as hyphens). The field's type parses the value (and gives the choices of a
    `Literal`); `--help` shows its docstring and default. A value is stored under the flag's name
    (`section.field`, or `field`) only when the flag is given, so `cls(**given)` keeps the defaults.

    Args:
        parser: the parser or argument group the flags join.
        cls: a dataclass whose fields all have defaults.
        section (`str`, *optional*): the flags' prefix; empty gives plain `--field-name` flags.
        only (`Collection[str]`, *optional*): the fields to expose (default: every field, in order).
        required (`Collection[str]`, *optional*): fields whose flag must be given.
    """
    defaults = cls()
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        if only is not None and item.name not in only:
            continue
        dest = f"{section}.{item.name}" if section else item.name
        parse, choices, metavar = _converter(hints[item.name], dest)
        help_text = docs.get(item.name, "").replace("%", "%%")
        if item.name not in required:
            help_text += f" (default: {toml_value(getattr(defaults, item.name))})"
        parser.add_argument(
            f"--{dest}" if section else f"--{item.name.replace('_', '-')}",
            dest=dest,
            type=parse,
            choices=choices,
            default=argparse.SUPPRESS,
            required=item.name in required,
            metavar=metavar,
            help=help_text.strip(),
        )


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: `--config` plus one flag per config field, grouped by section."""
    parser = argparse.ArgumentParser(
        prog="trainer/run.py",
        description=(
            "Fine-tune an SD3-family transformer with T5 attention and export the T5 weights file. "
            "Run with torchrun for several processes. Precedence: defaults < --config TOML < flags."
        ),
        argument_default=argparse.SUPPRESS,
        # `--training.step 20` must not pass for `--training.steps 20`.
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with [section] tables of these settings.")
    for section, cls in section_types().items():
        add_flags(parser.add_argument_group(section, (cls.__doc__ or "").strip()), cls, section=section)
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse flags (and the `--config` file they name) into a `TrainConfig` checked by its sections and
    by `trainer.presets.check_config`.

    Raises:
        SystemExit: bad flags (argparse prints the usage) or `--help`.
        ValueError / TypeError / FileNotFoundError: a bad config file or setting, naming the flag.
    """
    namespace = vars(build_parser().parse_args(argv))
    config_file = namespace.pop("config", None)
    values: dict[str, dict[str, Any]] = load_toml(config_file) if config_file else {}
    for flag, value in namespace.items():
        section, key = flag.split(".", 1)
        values.setdefault(section, {})[key] = value
    start = values.get("model", {}).get("start_from")
    if start:
        # the file's recipe sits between the defaults and the TOML file
        values["model"] = {**file_settings(start), **values["model"]}
    config = build_config(values)
    check_config(config)
    return config

"""Built-in base models the trainer knows by name (`--model.base toy`), registered as torchtitan
registers its models.

A preset supplies what a base otherwise gets from files: the softmax model, its own training data,
its evaluation, the weight files the model card hashes and a note for the card. The trainer looks a
base up here and uses what it finds; it never compares base names itself. Built-in presets are
imported on first lookup (`get_preset`, or `preset_data_sources` when a config is checked).

    register_preset(ModelPreset(name="my-toy", ...))
    preset = get_preset(config.model.base)        # None for files, folders and Hub repo ids
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from trainer.config import DataConfig
    from trainer.data import Source

__all__ = ["ModelPreset", "get_preset", "preset_data_sources", "register_preset"]


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A named base model with its own data and evaluation.

    Parameters:
        name (`str`): what `--model.base` gives.
        description (`str`): how the model card names it ("the built-in toy ...").
        data_source (`str`): the `--data.source` that trains it (and no other base).
        load_base (`Callable[[], nn.Module]`): the softmax model, fp32, eval mode, on CPU.
        weight_files (`Callable[[], dict[str, Path]]`): file name -> path of its weights (hashed on the card).
        build_source (`Callable[[DataConfig], Source]`): its training data (at its own default size
            when `--data.resolution` is 0).
        evaluate (`Callable`): `evaluate(student, output, world, samples=, sharded=, progress=)` -> numbers for
            the run report, or None when skipped.
        card_note (`str`): a closing line for the model card (how to sample it).
    """

    name: str
    description: str
    data_source: str
    load_base: Callable[[], nn.Module]
    weight_files: Callable[[], dict[str, Path]]
    build_source: Callable[[DataConfig], Source]
    evaluate: Callable[..., dict[str, Any] | None]
    card_note: str = ""


_REGISTRY: dict[str, ModelPreset] = {}
_BUILTIN: dict[str, str] = {"toy": "trainer.toy.preset"}
"""Built-in preset name -> the module that registers it when imported."""


def register_preset(preset: ModelPreset) -> ModelPreset:
    """Add a preset; a name can be registered once (re-registering the same object is a no-op)."""
    known = _REGISTRY.get(preset.name)
    if known is not None and known is not preset:
        raise ValueError(f"a model preset named {preset.name!r} is already registered.")
    _REGISTRY[preset.name] = preset
    return preset


def get_preset(name: str) -> ModelPreset | None:
    """The preset registered as `name`, or None when `name` is not a preset (a file, folder or repo id)."""
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    return _REGISTRY.get(name)


def preset_data_sources() -> frozenset[str]:
    """The data sources that belong to a preset (each trains only its preset)."""
    for name in _BUILTIN:
        get_preset(name)
    return frozenset(preset.data_source for preset in _REGISTRY.values())

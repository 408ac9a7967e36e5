"""Built-in base models the trainer knows by name (`--model.base toy`), registered as torchtitan
registers its models, and the checks of a config against them.

A preset supplies what a base otherwise gets from files: the softmax model, its own training data,
its evaluation with the name of its numbers in the run report and its section of the model card,
the weight files the card hashes and a note for the card. The trainer looks a base up here and uses
what it finds; it never compares base names itself. Built-in presets are imported on first lookup
(`get_preset`, or `preset_data_sources` when `check_config` runs).

    register_preset(ModelPreset(name="my-toy", ...))
    preset = get_preset(config.model.base)        # None for files, folders and Hub repo ids
    check_config(config)                          # what `trainer.cli.parse_args` and `trainer.train.run` call
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from t5core.hosts.diffusers import T5Handle
    from trainer.config import DataConfig, TrainConfig
    from trainer.data import Source
    from trainer.distributed import World

__all__ = ["ModelPreset", "check_config", "get_preset", "preset_data_sources", "register_preset"]


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
            when `--data.resolution` is 0); a `ValueError` naming the flag for data settings it cannot
            use (`check_config` builds it once to check them; building is cheap).
        evaluate (`Callable[[nn.Module, TrainConfig, Path, World], dict | None]`): `evaluate(student,
            config, output, world)` after training, on every rank -> its numbers for the run report (None
            when skipped); it may write files into the run folder `output`.
        evaluation_name (`str`): the run report's key for those numbers (`report.json`).
        card_section (`Callable[[Mapping[str, Any]], list[str]]`): the model card's validation text
            (markdown lines) for those numbers.
        card_note (`str`): a closing line for the model card (how to sample it).
        adapt_student (`Callable[[T5Handle, TrainConfig], tuple[list[nn.Parameter], list[nn.Parameter]]]`,
            *optional*): what the preset changes in the converted student before its parameters are split (a
            baseline in place of T5, re-initialised weights) -> `(new, unused)`: the parameters, besides T5's,
            that train as new ones, and those the student no longer uses (frozen).
        exports (`bool`, *optional*, defaults to True): False for a baseline whose student a T5 weights
            file cannot hold (another attention in place of T5, re-initialised base weights): its runs
            train and evaluate it and write no weights file, report, card or copy.
    """

    name: str
    description: str
    data_source: str
    load_base: Callable[[], nn.Module]
    weight_files: Callable[[], dict[str, Path]]
    build_source: Callable[[DataConfig], Source]
    evaluate: Callable[[nn.Module, TrainConfig, Path, World], dict[str, Any] | None]
    evaluation_name: str
    card_section: Callable[[Mapping[str, Any]], list[str]]
    card_note: str = ""
    adapt_student: Callable[[T5Handle, TrainConfig], tuple[list[nn.Parameter], list[nn.Parameter]]] | None = None
    exports: bool = True


_REGISTRY: dict[str, ModelPreset] = {}
_BUILTIN: dict[str, str] = dict.fromkeys(("toy", "toy-linear", "toy-no-inherit"), "sd3_testbed.preset")
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


def check_config(config: TrainConfig) -> None:
    """Check a config against the registered presets and the data sources: the checks that span
    sections and registries (each section checks its own fields when it is built).

    Raises:
        ValueError: names the flag to change: a preset base with another data source, a preset's
            data source with another base, a source that reads a path without one, data settings
            the preset cannot use, `--validation.enabled` for a preset (it has its own evaluation), or a
            ComfyUI copy or Hub upload for a preset that writes no weights file.
    """
    preset, source, owned = get_preset(config.model.base), config.data.source, preset_data_sources()
    if source != "prompts" and source not in owned and not config.data.path:
        raise ValueError(f"--data.path: source {source!r} needs a path.")
    if preset is not None and source != preset.data_source:
        raise ValueError(
            f"--data.source: the {preset.name} base trains on its own data, --data.source {preset.data_source}; "
            f"got --data.source {source!r}."
        )
    if preset is None and source in owned:
        raise ValueError(
            f"--data.source: --data.source {source!r} belongs to a built-in model; --model.base "
            f"{config.model.base!r} trains on `images`, `prompts` or a `cache`."
        )
    if preset is not None and config.validation.enabled:
        raise ValueError(
            f"--validation.enabled: the {preset.name} base is evaluated after training by its own "
            f"{preset.evaluation_name}; leave --validation.enabled off for it."
        )
    if preset is not None and not preset.exports:
        for flag, value in (("comfyui", config.output.comfyui), ("push_to_hub", config.output.push_to_hub)):
            if value:
                raise ValueError(
                    f"--output.{flag}: the {preset.name} base is a baseline whose runs write no T5 weights "
                    f"file to copy or upload; leave --output.{flag} empty for it."
                )
    if preset is not None:
        preset.build_source(config.data)

"""Runs that start from a T5 weights file (`--model.start_from`): adapting a file to another base.

A file trained on one base loses quality on a fine-tune of it, since its T5 parameters were fit to the
other base's activations (docs/toy.md#a-t5-file-on-a-fine-tune-of-its-base). Such a run converts its
base with the file (its T5 modules, its deltas added), trains as its recipe says and exports the file's
changes and its own as one set of deltas against this base:

* the file brings its recipe: its T5 settings, layers, `trainable` and `rank` fill the `--model`
  settings the run does not give (`file_settings`); those given must agree (`check_start`);
* an inherited weight that trains in full starts at base + the file's delta, and its exported delta is
  measured from the base (`T5Handle.base_values`);
* a weight that trains a low-rank delta continues the file's factors: its frozen value is the base, its
  factors start as the file's (`continue_factors`), so the file's rank must be the run's;
* a tensor the run does not train keeps the file's delta as it is (`carried_deltas`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from t5core.config import BaseArch
from t5core.deltas import Delta, diffusers_factors
from t5core.hosts.diffusers import T5Handle
from t5core.layers import resolve_layers
from t5core.sd3_keys import key_rules
from t5core.weights import T5Weights, load
from trainer.config import ModelConfig

__all__ = ["carried_deltas", "check_start", "continue_factors", "file_settings", "start_file"]

_RECIPE = ("trainable", "rank")
"""The provenance entries of a file that are `--model` settings of the run that made it."""


def start_file(path: str) -> T5Weights:
    """The T5 weights file a run starts from, loaded and checked (`t5core.weights.load`).

    Raises:
        FileNotFoundError / T5WeightsError: as `load`.
        ValueError: a file of absolute `base.*` values (format 1-3), which no other base can take as changes.
    """
    weights = load(path)
    if weights.base:
        raise ValueError(
            f"--model.start_from: {weights.name} stores absolute base.* values (format 1-3), which would replace "
            "this base's weights instead of changing them. Start from a format-4 file (deltas), as trainer/run.py "
            "writes, or train a new file."
        )
    return weights


def file_settings(path: str) -> dict[str, Any]:
    """The `--model` settings of the run that made the file at `path`: its T5 settings and layers, and the
    `trainable` and `rank` its provenance records (a file saved by hand may not)."""
    weights = start_file(path)
    settings: dict[str, Any] = {**weights.config.settings(), "layers": ",".join(weights.config.layers)}
    recorded = {key: weights.provenance[key] for key in _RECIPE if key in weights.provenance}
    if "rank" in recorded:
        recorded["rank"] = int(recorded["rank"])
    return settings | recorded


def check_start(weights: T5Weights, model: ModelConfig, arch: BaseArch) -> None:
    """Check that the run continues the file's recipe: its T5 settings and modules.

    Raises:
        ValueError: naming each `--model` setting that differs from the file's, and the fix.
    """
    held = weights.config.settings()
    differ = {name: (held[name], getattr(model, name)) for name in held if held[name] != getattr(model, name)}
    if resolve_layers(model.layers, arch) != weights.config.layers:
        differ["layers"] = (",".join(weights.config.layers), model.layers)
    if differ:
        named = [
            f"{name} {pair[0]!r} where the run asks for --model.{name} {pair[1]!r}" for name, pair in differ.items()
        ]
        raise ValueError(
            f"--model.start_from: {weights.name} holds {', '.join(named)}. A run that starts from a file continues "
            "its recipe: drop those flags (the file brings its own)."
        )


def continue_factors(handle: T5Handle, weights: Mapping[str, Delta], low_rank: Iterable[str]) -> None:
    """Give each low-rank weight in `low_rank` (diffusers names, already parametrized) the file's delta as its
    starting factors and the base as its frozen value; a weight the file did not change keeps its fresh
    factors (zero `up`).

    Raises:
        ValueError: a file's delta of such a weight that is a full diff, or of another rank than the run's.
    """
    factors = diffusers_factors(weights, handle.arch)
    sources = _sources(handle.arch)
    full = {name for key, delta in weights.items() if not delta.low_rank for name in sources[key]}
    modules = dict(handle.model.named_modules())
    for name in low_rank:
        parametrization = modules[name.removesuffix(".weight")].parametrizations.weight
        delta = parametrization[0]
        rank = delta.down.shape[0]
        if name in full:
            raise ValueError(
                f"--model.rank: the file changes {name} by a full delta, which a rank-{rank} delta cannot "
                "continue. Train it in full, as the file was: --model.rank 0."
            )
        if name not in factors:
            continue
        up, down = factors[name]
        if down.shape[0] != rank:
            raise ValueError(
                f"--model.rank: the file's delta of {name} has rank {down.shape[0]}, the run's {rank}. A run that "
                f"starts from a file continues its factors: --model.rank {down.shape[0]}."
            )
        (base,) = handle.base_values([name]).values()
        with torch.no_grad():
            parametrization.original.copy_(base)
            delta.up.copy_(up.to(torch.float32) / delta.scale)
            delta.down.copy_(down.to(torch.float32))


def carried_deltas(weights: Mapping[str, Delta], trained: Iterable[str], arch: BaseArch) -> dict[str, Delta]:
    """The file's deltas of SD3 tensors that the run leaves as they are: none of their diffusers tensors is in
    `trained` (parameter names, a low-rank weight's factors among them)."""
    touched, sources = {_weight_of(name) for name in trained}, _sources(arch)
    return {key: delta for key, delta in weights.items() if touched.isdisjoint(sources[key])}


def _sources(arch: BaseArch) -> dict[str, tuple[str, ...]]:
    """SD3 tensor name -> the diffusers tensors it is made of."""
    return {rule.sd3: rule.diffusers for rule in key_rules(arch)}


def _weight_of(name: str) -> str:
    """The weight a low-rank factor's parameter name belongs to, or the name itself."""
    owner, parametrized, _ = name.partition(".parametrizations.")
    return owner + ".weight" if parametrized else name

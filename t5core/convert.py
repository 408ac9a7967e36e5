"""Between a T5 weights file and a host's model: what to install, and what to export.

`prepare` is the sequence both hosts run before wiring anything into a model: load the file, check
it against the model's architecture and the layer request, check its `base.*` tensors or deltas
against the model's own, compare the base fingerprint (`check_fingerprint`) and build the
`T5Attention` modules. Nothing is changed in the model, so a refusal leaves it as it was.
`base_tensors` goes the other way: from a fine-tuned diffusers model (or the full tensors a trainer
gathered) to the SD3-named `base.*` tensors of a weights file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from torch import Tensor

from t5core.attention import T5Attention
from t5core.config import T5_SETTINGS, BaseArch, T5Config
from t5core.deltas import Delta
from t5core.layers import LayerSpec
from t5core.sd3_keys import diffusers_module, diffusers_to_sd3, key_rules
from t5core.weights import T5Weights, T5WeightsError, build_modules, check_base, check_compatible, load

__all__ = ["Prepared", "base_sources", "base_tensors", "check_fingerprint", "left_out_by", "prepare"]

logger = logging.getLogger(__name__)


_ATTENTION_KEY = re.compile(r"joint_blocks\.(\d+)\.(?:x_block|context_block)\.(attn2?)\.")
_BLOCK = re.compile(r"(?:joint_)?blocks\.(\d+)\.")


def _attention_layer(key: str) -> str | None:
    """The attention module an SD3 tensor belongs to (`blocks.3.attn` for the joint attention's image
    and text projections), None for a tensor outside attention."""
    match = _ATTENTION_KEY.match(key)
    return f"blocks.{match[1]}.{match[2]}" if match else None


def _block(name: str) -> str | None:
    """The joint block index an SD3 tensor (`joint_blocks.3.`) or layer (`blocks.3.attn`) is in."""
    match = _BLOCK.match(name)
    return match[1] if match else None


def left_out_by(keys: Iterable[str], file_layers: Iterable[str], chosen: Iterable[str]) -> frozenset[str]:
    """The file's changes to inherited weights that a `layers` subset leaves out.

    A change goes with the conversion it was trained for: an attention module's own tensors (its
    q/k/v, output projection and q/k norms) with that module; the other tensors of a joint block (MLP,
    adaLN modulation) with the block, so they are left out when the subset converts none of the block's
    modules the file converts. Tensors of modules the file does not convert, of blocks it converts
    nothing in, and outside the joint blocks (embedders, final layer) stay: the subset does not reach
    them. Choosing all the file's layers leaves nothing out.

    Args:
        keys: SD3 names of the file's `base.*` tensors or deltas.
        file_layers: the modules the file converts.
        chosen: the modules converted for this model.

    Returns:
        The keys to leave out.
    """
    dropped = set(file_layers) - set(chosen)
    blocks_dropped = {_block(layer) for layer in dropped} - {_block(layer) for layer in chosen}
    left_out = set()
    for key in keys:
        layer = _attention_layer(key)
        if (layer in dropped) if layer is not None else (_block(key) in blocks_dropped):
            left_out.add(key)
    return frozenset(left_out)


@dataclass(frozen=True)
class Prepared:
    """A T5 weights file made ready for one model.

    Attributes:
        weights: the loaded file.
        config: the file's settings, with `layers` set to the modules chosen for this model.
        modules: a `T5Attention` holding the file's tensors per chosen module (`blocks.3.attn`).
        base: the file's `base.*` tensors to apply, in SD3 naming, each checked to be a model tensor of
            the same shape; a `layers` subset leaves out those of the modules it leaves out (`left_out_by`).
        deltas: the file's deltas to add, in SD3 naming, each checked to be of a model tensor of its
            shape; chosen like `base`.
        left_out: SD3 names of the file's `base.*` tensors and deltas the subset left out, sorted.
        fingerprint_matches: whether the model is the base the file was trained on
            (`check_fingerprint`); None when the file has no fingerprint.
    """

    weights: T5Weights
    config: T5Config
    modules: dict[str, T5Attention]
    base: dict[str, Tensor] = field(default_factory=dict)
    deltas: dict[str, Delta] = field(default_factory=dict)
    left_out: tuple[str, ...] = ()
    fingerprint_matches: bool | None = None

    @property
    def layers(self) -> tuple[str, ...]:
        """The chosen modules, in the order of the config."""
        return self.config.layers

    def describe(self) -> str:
        """One line on what the file converts and changes here: "1 of 6 modules the file converts; 8 deltas
        added (8 low rank, 0 full); 75 changes to base weights left out with the modules not converted"."""
        parts = [f"{len(self.layers)} of {len(self.weights.config.layers)} modules the file converts"]
        if self.base:
            parts.append(f"{len(self.base)} base weights applied")
        if self.deltas:
            low_rank = sum(delta.low_rank for delta in self.deltas.values())
            parts.append(f"{len(self.deltas)} deltas added ({low_rank} low rank, {len(self.deltas) - low_rank} full)")
        if self.left_out:
            parts.append(f"{len(self.left_out)} changes to base weights left out with the modules not converted")
        return "; ".join(parts)


def check_fingerprint(weights: T5Weights, model_fingerprint: Callable[[], str]) -> bool | None:
    """Compare the base fingerprint a file records with the model's, and say so once when they differ.

    A different base is allowed (a file's deltas are meant for fine-tunes of its base too), so a
    mismatch is one warning naming both fingerprints and the base the file was made for.

    Args:
        weights: the loaded file.
        model_fingerprint: returns `t5core.deltas.fingerprint` of the model; called only when the file
            has a fingerprint.

    Returns:
        Whether they match; None when the file has no fingerprint.
    """
    if weights.fingerprint is None:
        return None
    model = model_fingerprint()
    if model == weights.fingerprint:
        return True
    base = weights.provenance.get("base")
    logger.warning(
        "T5 weights %s: made for %s (fingerprint %s), but this model's fingerprint is %s; %s anyway (a file "
        "is meant for fine-tunes of its base too), but results may differ from those it was trained for; a few "
        "steps of `python trainer/run.py --model.start_from %s` on this model adapt the file to it",
        weights.name,
        f"base {base!r}" if base else "another base",
        weights.fingerprint,
        model,
        f"adding its {len(weights.deltas)} deltas" if weights.deltas else "using it",
        weights.path,
    )
    return False


def _check_settings(weights: T5Weights, config: T5Config) -> None:
    """Check that a weights file holds the T5 settings `config` asks for (its layers are not compared).

    Raises:
        T5WeightsError: naming each setting that differs, the file's value beside the asked one.
    """
    held, asked = weights.config.settings(), config.settings()
    differ = [name for name in T5_SETTINGS if held[name] != asked[name]]
    if differ:
        raise T5WeightsError(
            f"{weights.name}: holds {', '.join(f'{name} {held[name]!r}' for name in differ)}, but the config "
            f"asks for {', '.join(f'{name}={asked[name]!r}' for name in differ)}. A weights file brings its "
            "own settings: drop the config, or give one with the file's settings."
        )


def prepare(
    weights: T5Weights | str | os.PathLike[str],
    arch: BaseArch,
    *,
    model_state: Callable[[], Mapping[str, Tensor]],
    model_fingerprint: Callable[[], str],
    layers: LayerSpec | None = None,
    config: T5Config | None = None,
    backend: str = "auto",
) -> Prepared:
    """Load and check a T5 weights file for a model, and build its T5 modules.

    Args:
        weights: a loaded T5 weights file, or its path.
        arch: the model's architecture.
        model_state: returns the model's tensors by SD3 checkpoint name (meta tensors will do: only
            names and shapes are read); called only when the file has `base.*` tensors or deltas.
        model_fingerprint: returns `t5core.deltas.fingerprint` of the model as it is before the file
            changes it; called only when the file has a fingerprint (`check_fingerprint`).
        layers: restricts the conversion to a subset of the file's layers (a layer spec); None takes
            all of them.
        config: the T5 settings the caller expects (`T5Config.settings()`; its layers are not read,
            `layers` restricts them); None takes the file's.
        backend: `"auto" | "torch" | "triton"` for every `T5Attention`.

    Returns:
        A `Prepared` with the modules on the CPU, in the file's dtype.

    Raises:
        FileNotFoundError: `weights` is a path that does not exist.
        T5WeightsError: the file is unreadable, has other settings than `config`, is for another architecture, cannot
            serve `layers`, or has `base.*` tensors or deltas of tensors the model lacks or holds in
            another shape.
    """
    weights = weights if isinstance(weights, T5Weights) else load(weights)
    if config is not None:
        _check_settings(weights, config)
    chosen = check_compatible(weights, arch, layers)
    if weights.base or weights.deltas:
        check_base(weights, model_state())
    matches = check_fingerprint(weights, model_fingerprint)
    config = replace(weights.config, layers=chosen)
    left_out = left_out_by([*weights.base, *weights.deltas], weights.config.layers, chosen)
    return Prepared(
        weights,
        config,
        build_modules(weights, chosen, backend=backend),
        base={key: tensor for key, tensor in weights.base.items() if key not in left_out},
        deltas={key: delta for key, delta in weights.deltas.items() if key not in left_out},
        left_out=tuple(sorted(left_out)),
        fingerprint_matches=matches,
    )


def base_sources(arch: BaseArch, *, params: Iterable[str] = (), layers: Iterable[str] = ()) -> tuple[str, ...]:
    """The diffusers tensors a weights file's `base.*` needs for fine-tuned inherited weights.

    A fine-tuned parameter brings the whole SD3 tensor it belongs to, so all of a fused qkv comes
    along when only its q was trained.

    Args:
        arch: the model's architecture.
        params: diffusers names of fine-tuned parameters (`transformer_blocks.3.attn.to_q.weight`).
        layers: converted modules (`blocks.3.attn`) whose inherited projections and q/k norms all count
            as fine-tuned.

    Returns:
        Sorted diffusers names.

    Raises:
        ValueError: a name in `params` that is not an inherited SD3 weight of this architecture.
    """
    wanted = set(params)
    prefixes = tuple(diffusers_module(layer) + "." for layer in layers)
    rules = [rule for rule in key_rules(arch) if wanted & set(rule.diffusers) or rule.diffusers[0].startswith(prefixes)]
    sources = {name for rule in rules for name in rule.diffusers}
    unknown = sorted(wanted - sources)
    if unknown:
        raise ValueError(
            f"{unknown[:5]} are not inherited SD3 weights of a {arch.describe()}; "
            "pass parameter names of the diffusers transformer (T5 parameters are saved as modules, not base)."
        )
    return tuple(sorted(sources))


def base_tensors(
    state: Mapping[str, Tensor], arch: BaseArch, *, params: Iterable[str] = (), layers: Iterable[str] = ()
) -> dict[str, Tensor]:
    """SD3-named tensors for a weights file's `base.*`, from a diffusers-named state dict.

    Args:
        state: diffusers tensors by name (`transformer.state_dict()`, or full tensors a trainer
            gathered); must hold every name `base_sources` returns for `params` and `layers`.
        arch, params, layers: as for `base_sources`.

    Returns:
        SD3-named tensors (detached), ready for `t5core.weights.save(..., base=...)`.

    Raises:
        ValueError: as for `base_sources`.
    """
    names = base_sources(arch, params=params, layers=layers)
    return diffusers_to_sd3({name: state[name].detach() for name in names}, arch)

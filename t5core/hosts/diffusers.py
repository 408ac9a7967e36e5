"""The diffusers host: convert an `SD3Transformer2DModel`'s attention to T5 attention, reversibly.

`linearize` gives each converted `Attention` a `T5AttnProcessor`, hooks in the latent grid (both in
`t5core.hosts.diffusers_runtime`), copies a weights file's `base.*` tensors into the model and adds
its deltas to the model's weights (computed in float32, stored in each weight's dtype); the handle's
`remove()` restores processors and weights and drops the hooks. `t5core.convert.prepare` reads and
checks the file and compares the model's fingerprint, taken before anything changes, with the file's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from t5core.attention import T5Attention
from t5core.config import BaseArch, T5Config
from t5core.convert import prepare
from t5core.deltas import Delta, TensorsOnRead, diffusers_deltas, fingerprint, fingerprint_keys
from t5core.hosts.diffusers_runtime import T5AttnProcessor, drop_grid_hook, grid_hook
from t5core.layers import LayerSpec, resolve_layers
from t5core.sd3_keys import diffusers_module, diffusers_to_sd3, key_rules, layer_name, sd3_to_diffusers
from t5core.weights import T5Weights

__all__ = ["T5AttnProcessor", "T5Handle", "arch_of", "converted_layers", "linearize"]

logger = logging.getLogger(__name__)


def arch_of(transformer: nn.Module) -> BaseArch:
    """The `BaseArch` of an `SD3Transformer2DModel`.

    Raises:
        TypeError: the model is not an SD3-family diffusers transformer (names its class).
    """
    config = getattr(transformer, "config", None)
    needed = ("num_layers", "num_attention_heads", "attention_head_dim")
    if not (hasattr(transformer, "transformer_blocks") and all(hasattr(config, key) for key in needed)):
        raise TypeError(
            "expected a diffusers SD3Transformer2DModel (SD3, SD3.5 Medium or Large); "
            f"got {type(transformer).__name__}. "
            "Load the transformer with SD3Transformer2DModel.from_pretrained(..., subfolder='transformer')."
        )
    return BaseArch(
        depth=config.num_layers,
        heads=config.num_attention_heads,
        head_dim=config.attention_head_dim,
        dual_attention_layers=tuple(getattr(config, "dual_attention_layers", None) or ()),
        qk_norm=getattr(config, "qk_norm", None) is not None,
    )


def converted_layers(transformer: nn.Module) -> tuple[str, ...]:
    """The layers a `linearize`d transformer runs as T5 attention (`blocks.3.attn`); () for any other model."""
    processors = getattr(transformer, "attn_processors", {})
    return tuple(
        layer_name(name.removesuffix(".processor"))
        for name, processor in processors.items()
        if isinstance(processor, T5AttnProcessor)
    )


def _tensors(transformer: nn.Module) -> dict[str, Tensor]:
    return {**dict(transformer.named_parameters()), **dict(transformer.named_buffers())}


def _sd3_state(transformer: nn.Module, arch: BaseArch) -> dict[str, Tensor]:
    """The transformer's tensors in SD3 checkpoint naming, as meta tensors (names and shapes only)."""
    meta = {name: torch.empty(t.shape, device="meta") for name, t in _tensors(transformer).items()}
    return diffusers_to_sd3(meta, arch)


def _fingerprint(transformer: nn.Module, arch: BaseArch) -> str:
    """`t5core.deltas.fingerprint` of the transformer, each fused qkv made when it is read."""
    tensors = _tensors(transformer)
    sources = {rule.sd3: rule.diffusers for rule in key_rules(arch)}

    def read(key: str) -> Tensor:
        return diffusers_to_sd3({name: tensors[name] for name in sources[key]}, arch)[key]

    return fingerprint(TensorsOnRead(fingerprint_keys(arch), read), arch)


@dataclass
class T5Handle:
    """A conversion in place: the T5 modules and how to undo it.

    Attributes:
        model: the converted transformer.
        modules: the `T5Attention` of each converted module, by name (`blocks.3.attn`).
        config: the conversion's `T5Config`.
        arch: the model's `BaseArch`.
    """

    model: nn.Module
    modules: dict[str, T5Attention]
    config: T5Config
    arch: BaseArch
    _processors: dict[str, Any] = field(repr=False)
    _hooks: list[RemovableHandle] = field(repr=False)
    _originals: dict[str, Tensor] = field(repr=False)
    _removed: bool = field(default=False, repr=False)

    def t5_parameters(self) -> Iterator[nn.Parameter]:
        """The new parameters (fast weights and locality convs) of every converted module."""
        for module in self.modules.values():
            yield from module.parameters()

    def base_values(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The named diffusers tensors as the model had them before the conversion: a weights file's base
        tensors and deltas taken off (what `remove` restores), the tensors it did not change as they are."""
        tensors = _tensors(self.model)
        return {name: (self._originals[name] if name in self._originals else tensors[name]).detach() for name in names}

    @contextlib.contextmanager
    def softmax(self) -> Iterator[None]:
        """Inside, every converted module runs its original softmax attention; the T5 modules stay in place
        and return on exit. With the inherited weights as the base has them, this is the softmax model."""
        converted = self.model.attn_processors
        self.model.set_attn_processor(dict(self._processors))
        hooks = [
            self.model.get_submodule(diffusers_module(name)).register_forward_pre_hook(drop_grid_hook, with_kwargs=True)
            for name in self.modules
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self.model.set_attn_processor(converted)

    def remove(self) -> None:
        """Undo: original processors, no hooks, original inherited weights. Bit-identical outputs."""
        if self._removed:
            return
        for hook in self._hooks:
            hook.remove()
        self.model.set_attn_processor(dict(self._processors))
        _copy_into(self.model, self._originals)
        self._removed = True
        logger.info("T5: restored softmax attention on %d modules", len(self.modules))


def _copy_into(transformer: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy diffusers-named tensors into the model."""
    tensors = _tensors(transformer)
    with torch.no_grad():
        for name, tensor in state.items():
            tensors[name].copy_(tensor)


def _change(
    transformer: nn.Module, arch: BaseArch, *, values: dict[str, Tensor], deltas: dict[str, Delta]
) -> dict[str, Tensor]:
    """Set the model's tensors to diffusers-named `values` and add SD3-named `deltas` to them (in
    float32, stored in each tensor's dtype, one delta at a time); return the original of every tensor
    changed."""
    tensors = _tensors(transformer)
    originals: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, value in values.items():
            originals.setdefault(name, tensors[name].detach().clone())
            tensors[name].copy_(value)
        for key, delta in deltas.items():
            for name, change in diffusers_deltas({key: delta}, arch).items():
                target = tensors[name]
                originals.setdefault(name, target.detach().clone())
                target.copy_(target.to(torch.float32) + change.to(target.device))
    return originals


def _install(transformer: nn.Module, modules: dict[str, T5Attention]) -> list[RemovableHandle]:
    """Give each converted attention its processor (on the model's device) and hook in the latent
    grid; return the hooks."""
    device = next(transformer.parameters()).device
    processors = transformer.attn_processors
    for name, module in modules.items():
        processors[diffusers_module(name) + ".processor"] = T5AttnProcessor(module.to(device=device))
    transformer.set_attn_processor(processors)
    hooks = [transformer.register_forward_pre_hook(grid_hook(transformer.config.patch_size), with_kwargs=True)]
    converted = {diffusers_module(name) for name in modules}
    for name, module in transformer.named_modules():
        if name.endswith((".attn", ".attn2")) and name not in converted:
            hooks.append(module.register_forward_pre_hook(drop_grid_hook, with_kwargs=True))
    return hooks


def _layer_spec(config: T5Config | None, layers: LayerSpec | None, arch: BaseArch) -> LayerSpec | None:
    """The layers asked for, by `config.layers` or `layers` (None: neither names any); both must agree."""
    if config is None or not config.layers:
        return layers
    if layers is not None and resolve_layers(layers, arch) != resolve_layers(config.layers, arch):
        raise ValueError(
            f"layers={layers!r} and config.layers {list(config.layers)} name different modules; "
            "give the layers once, in config.layers or in layers."
        )
    return config.layers


def linearize(
    transformer: nn.Module,
    *,
    config: T5Config | None = None,
    layers: LayerSpec | None = None,
    weights: str | os.PathLike[str] | T5Weights | None = None,
    backend: str = "auto",
    inplace: bool = True,
) -> T5Handle:
    """Convert an `SD3Transformer2DModel`'s attention modules to T5 attention.

    Args:
        transformer: the diffusers SD3 / SD3.5 transformer.
        config: the T5 settings (variant, key norm, locality, joint mode, merge, neighbourhood) and,
            if its `layers` is not empty, the modules to convert. Fresh modules are built as it says
            (None: `T5Config()`, the paper's settings); with `weights`, its settings must be the
            file's, which brings its own. Default: None.
        layers: layer spec (`"paper"`, `"all"`, `"joint:18-23,attn2:0-12"`, ...) for when `config`
            names no layers; naming other modules than `config.layers` is an error. Default: `"paper"`
            for fresh T5 modules, the file's layers when `weights` is given.
        weights: a T5 weights file (path or loaded) to initialise from: its `base.*` tensors replace
            the model's, its deltas add to them.
        backend: `"auto" | "torch" | "triton"` for every `T5Attention`.
        inplace: convert `transformer` itself (True) or a deep copy (False, returned as `handle.model`).

    Returns:
        A `T5Handle`; `handle.remove()` undoes the conversion.

    Raises:
        TypeError: not an SD3-family diffusers transformer, or `config` is not a `T5Config`.
        ValueError: a bad layer spec, `layers` and `config.layers` that name different modules, or a
            transformer that is already converted.
        T5WeightsError: a weights file that does not fit the model, `config` or `layers`.
    """
    arch = arch_of(transformer)
    if config is not None and not isinstance(config, T5Config):
        raise TypeError(f"config must be a t5core.config.T5Config or None; got {type(config).__name__}.")
    spec = _layer_spec(config, layers, arch)
    if converted_layers(transformer):
        raise ValueError(
            "this transformer is already converted to T5 attention; call .remove() on its handle "
            "first, or convert a fresh model."
        )
    if not inplace:
        transformer = copy.deepcopy(transformer)
    if weights is None:
        names = resolve_layers("paper" if spec is None else spec, arch)
        config = replace(config or T5Config(), layers=names)
        modules = {
            name: T5Attention.from_config(config, arch.heads, arch.head_dim, layer=name, backend=backend)
            for name in names
        }
        base, deltas, changes = {}, {}, ""
    else:
        prepared = prepare(
            weights,
            arch,
            model_state=functools.partial(_sd3_state, transformer, arch),
            model_fingerprint=functools.partial(_fingerprint, transformer, arch),
            layers=spec,
            config=config,
            backend=backend,
        )
        config, modules = prepared.config, prepared.modules
        base, deltas = sd3_to_diffusers(prepared.base, arch), prepared.deltas
        changes = f"; {prepared.describe()}"
    original = transformer.attn_processors
    originals = _change(transformer, arch, values=base, deltas=deltas)
    hooks = _install(transformer, modules)
    names = ",".join(config.layers) or "none"
    logger.info(
        "T5: converted %d of %d attention modules to %s T5 attention (%s)%s",
        len(modules),
        len(original),
        config.variant,
        names,
        changes,
    )
    return T5Handle(transformer, modules, config, arch, original, hooks, originals)

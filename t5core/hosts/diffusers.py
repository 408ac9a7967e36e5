"""The diffusers host: convert an `SD3Transformer2DModel`'s attention to T5 attention, reversibly.

Each converted `Attention` gets a `T5AttnProcessor` (an `nn.Module` holding its `T5Attention`,
stateless between calls, so gradient checkpointing can replay it). A forward pre-hook on the
transformer puts the latent token grid into `joint_attention_kwargs["t5_grid"]`; attention modules
that keep softmax get a pre-hook that drops that key, so their processors see exactly what they saw
before. diffusers orders joint tokens [image, text].
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from t5core.attention import T5Attention
from t5core.config import BaseArch, T5Config
from t5core.layers import LayerSpec, resolve_layers
from t5core.sd3_keys import diffusers_to_sd3, key_rules, sd3_to_diffusers
from t5core.weights import T5Weights, T5WeightsError, build_modules, check_compatible, load

__all__ = ["T5AttnProcessor", "T5Handle", "arch_of", "linearize"]

logger = logging.getLogger(__name__)

GRID_KWARG = "t5_grid"


def _diffusers_path(name: str) -> str:
    """`blocks.3.attn2` -> `transformer_blocks.3.attn2`."""
    return "transformer_" + name


class T5AttnProcessor(nn.Module):
    """diffusers attention processor that runs `T5Attention` between the module's own projections.

    Works for joint attention (`attn`, image + text, text last) and image-only attention (`attn2`).
    """

    def __init__(self, t5: T5Attention) -> None:
        super().__init__()
        self.t5 = t5

    def _heads(self, attn: nn.Module, x: Tensor, proj: str, norm: str | None = None) -> Tensor:
        out = getattr(attn, proj)(x).unflatten(-1, (attn.heads, -1))
        norm_module = getattr(attn, norm) if norm else None
        return out if norm_module is None else norm_module(out)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        t5_grid: tuple[int, int] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        if attention_mask is not None:
            raise ValueError("T5 attention takes no attention mask; SD3 sampling does not use one.")
        q = self._heads(attn, hidden_states, "to_q", "norm_q")
        k = self._heads(attn, hidden_states, "to_k", "norm_k")
        v = self._heads(attn, hidden_states, "to_v")
        text_tokens = 0
        if encoder_hidden_states is not None:
            text_tokens = encoder_hidden_states.shape[1]
            q = torch.cat([q, self._heads(attn, encoder_hidden_states, "add_q_proj", "norm_added_q")], dim=1)
            k = torch.cat([k, self._heads(attn, encoder_hidden_states, "add_k_proj", "norm_added_k")], dim=1)
            v = torch.cat([v, self._heads(attn, encoder_hidden_states, "add_v_proj")], dim=1)
        out = self.t5(q, k, v, grid=t5_grid, text_tokens=text_tokens, text_first=False).flatten(2)
        image = attn.to_out[1](attn.to_out[0](out[:, : hidden_states.shape[1]]))
        if encoder_hidden_states is None:
            return image
        text = out[:, hidden_states.shape[1] :]
        return image, (text if attn.context_pre_only else attn.to_add_out(text))


def arch_of(transformer: nn.Module) -> BaseArch:
    """The `BaseArch` of an `SD3Transformer2DModel`.

    Raises:
        TypeError: the model is not an SD3-family diffusers transformer (names its class).
    """
    config = getattr(transformer, "config", None)
    needed = ("num_layers", "num_attention_heads", "attention_head_dim")
    if (
        config is None
        or not all(hasattr(config, key) for key in needed)
        or not hasattr(transformer, "transformer_blocks")
    ):
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
    _replaced_base: dict[str, Tensor] = field(repr=False)
    _removed: bool = field(default=False, repr=False)

    def t5_parameters(self) -> Iterator[nn.Parameter]:
        """The new parameters (fast weights and locality convs) of every converted module."""
        for module in self.modules.values():
            yield from module.parameters()

    def base_state_dict(self, param_names: list[str] | None = None) -> dict[str, Tensor]:
        """Inherited weights in SD3 checkpoint naming, for a weights file's `base.*` tensors.

        Args:
            param_names: diffusers parameter names (`transformer_blocks.3.attn.to_q.weight`) that
                were fine-tuned; each brings the whole SD3 tensor it belongs to (all of a fused
                qkv). None: the inherited projections and norms of every converted module.

        Returns:
            SD3-named tensors (detached).
        """
        if param_names is None:
            prefixes = tuple(_diffusers_path(name) + "." for name in self.modules)
            param_names = [
                n for n, _ in self.model.named_parameters() if n.startswith(prefixes) and ".processor." not in n
            ]
        wanted = set(param_names)
        state = dict(self.model.named_parameters())
        state.update(self.model.named_buffers())
        rules = [rule for rule in key_rules(self.arch) if wanted.intersection(rule.diffusers)]
        unknown = wanted - {name for rule in rules for name in rule.diffusers}
        if unknown:
            raise ValueError(f"not inherited SD3 weights of this model: {sorted(unknown)[:5]}.")
        sources = {name: state[name].detach() for rule in rules for name in rule.diffusers}
        return diffusers_to_sd3(sources, self.arch)

    def remove(self) -> None:
        """Undo: original processors, no hooks, original inherited weights. Bit-identical outputs."""
        if self._removed:
            return
        for hook in self._hooks:
            hook.remove()
        self.model.set_attn_processor(dict(self._processors))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, original in self._replaced_base.items():
                params[name].copy_(original)
        self._removed = True
        logger.info("T5: restored softmax attention on %d modules", len(self.modules))


def _grid_hook(patch_size: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        height, width = latents.shape[-2:]
        joint = dict(kwargs.get("joint_attention_kwargs") or {})
        joint[GRID_KWARG] = (height // patch_size, width // patch_size)
        return args, {**kwargs, "joint_attention_kwargs": joint}

    return hook


def _drop_grid_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {key: value for key, value in kwargs.items() if key != GRID_KWARG}


def _apply_base(transformer: nn.Module, weights: T5Weights, arch: BaseArch) -> dict[str, Tensor]:
    """Copy the file's `base.*` tensors into the model; return the replaced originals."""
    path = weights.name
    try:
        state = sd3_to_diffusers(weights.base, arch)
    except ValueError as error:
        raise T5WeightsError(f"{path}: base tensor {error} Re-export the file for this model.") from error
    params = dict(transformer.named_parameters())
    params.update(transformer.named_buffers())
    originals: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if name not in params:
            raise T5WeightsError(
                f"{path}: base tensor for {name} has no parameter in this model. Re-export the file for this model."
            )
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise T5WeightsError(
                f"{path}: base tensor for {name} is {tuple(tensor.shape)}, the model has {tuple(params[name].shape)}. "
                "Use a T5 weights file trained for this model."
            )
    with torch.no_grad():
        for name, tensor in state.items():
            originals[name] = params[name].detach().clone()
            params[name].copy_(tensor)
    return originals


def linearize(
    transformer: nn.Module,
    layers: LayerSpec | None = None,
    weights: str | os.PathLike[str] | T5Weights | None = None,
    variant: str | None = None,
    *,
    key_norm_eps: float | None = 1.0,
    locality: bool = True,
    backend: str = "auto",
    inplace: bool = True,
) -> T5Handle:
    """Convert an `SD3Transformer2DModel`'s attention modules to T5 attention.

    Args:
        transformer: the diffusers SD3 / SD3.5 transformer.
        layers: layer spec (`"paper"`, `"all"`, `"joint:18-23,attn2:0-12"`, ...). Default: `"paper"`
            for fresh T5 modules, the file's layers when `weights` is given.
        weights: a T5 weights file (path or loaded) to initialise from, `base.*` tensors included.
        variant: inner model for fresh modules (`"swiglu"` by default); must match a given file.
        key_norm_eps, locality: T5 settings for fresh modules (a file brings its own).
        backend: `"auto" | "torch" | "triton"` for every `T5Attention`.
        inplace: convert `transformer` itself (True) or a deep copy (False, returned as `handle.model`).

    Returns:
        A `T5Handle`; `handle.remove()` undoes the conversion.

    Raises:
        TypeError: not an SD3-family diffusers transformer.
        ValueError: a bad layer spec or setting, or a transformer that is already converted.
        T5WeightsError: a weights file that does not fit the model or the request.
    """
    arch = arch_of(transformer)
    if not inplace:
        transformer = copy.deepcopy(transformer)
    original = transformer.attn_processors
    if any(isinstance(p, T5AttnProcessor) for p in original.values()):
        raise ValueError(
            "this transformer is already converted to T5 attention; call .remove() on its handle "
            "first, or convert a fresh model."
        )
    if weights is not None:
        weights = weights if isinstance(weights, T5Weights) else load(weights)
        if variant is not None and variant != weights.config.variant:
            raise T5WeightsError(
                f"{weights.name}: holds variant {weights.config.variant!r}, but variant={variant!r} "
                "was requested. Drop the variant argument."
            )
        names = check_compatible(weights, arch, layers)
        config = T5Config(weights.config.variant, weights.config.key_norm_eps, weights.config.locality, names)
        modules = build_modules(weights, names, backend=backend)
    else:
        names = resolve_layers("paper" if layers is None else layers, arch)
        config = T5Config(variant or "swiglu", key_norm_eps, locality, names)
        modules = {name: T5Attention.from_config(config, arch.heads, arch.head_dim, backend=backend) for name in names}
    reference = next(transformer.parameters())
    for module in modules.values():
        module.to(device=reference.device)

    processors = dict(original)
    for name, module in modules.items():
        processors[_diffusers_path(name) + ".processor"] = T5AttnProcessor(module)
    replaced_base = _apply_base(transformer, weights, arch) if weights is not None and weights.base else {}
    transformer.set_attn_processor(dict(processors))

    hooks = [transformer.register_forward_pre_hook(_grid_hook(transformer.config.patch_size), with_kwargs=True)]
    converted = {_diffusers_path(name) for name in names}
    for name, module in transformer.named_modules():
        if name.endswith((".attn", ".attn2")) and name not in converted:
            hooks.append(module.register_forward_pre_hook(_drop_grid_hook, with_kwargs=True))
    logger.info(
        "T5: converted %d of %d attention modules to %s T5 attention (%s)",
        len(names),
        len(original),
        config.variant,
        ",".join(names) or "none",
    )
    return T5Handle(transformer, modules, config, arch, original, hooks, replaced_base)

"""Names of an SD3-family transformer's weights: diffusers' `SD3Transformer2DModel` vs the original
SD3 checkpoint naming (`joint_blocks.{i}.x_block.attn.qkv.weight`, ...) that ComfyUI and Stability's
files use, and that the T5 weights file uses for its `base.*` tensors.

T5 Linearize names an attention module as a layer (`blocks.3.attn2`, the weights file's and layer
specs' naming); its diffusers module path adds `transformer_` (`diffusers_module`, undone by
`layer_name`). Three kinds of rules map one weight name to the other: the same tensor renamed; the fused `qkv` as the
concatenation of diffusers' separate q, k and v projections (rows [q; k; v]); and the final-layer and
last-block text adaLN, whose two chunks are (shift, scale) in SD3 and (scale, shift) in diffusers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from t5core.config import BaseArch

__all__ = ["KeyRule", "diffusers_module", "diffusers_to_sd3", "key_rules", "layer_name", "sd3_to_diffusers"]

_DIFFUSERS_PREFIX = "transformer_"


@dataclass(frozen=True, slots=True)
class KeyRule:
    """One SD3 tensor and the diffusers tensors it is made of."""

    sd3: str
    diffusers: tuple[str, ...]
    kind: Literal["same", "fused", "swapped"] = "same"


def diffusers_module(layer: str) -> str:
    """The diffusers path of a layer: `blocks.3.attn2` -> `transformer_blocks.3.attn2`."""
    return _DIFFUSERS_PREFIX + layer


def layer_name(module: str) -> str:
    """The layer a diffusers module path names: `transformer_blocks.3.attn2` -> `blocks.3.attn2`."""
    return module.removeprefix(_DIFFUSERS_PREFIX)


def _linear(sd3: str, diffusers: str, kind: str = "same") -> list[KeyRule]:
    return [KeyRule(f"{sd3}.{p}", (f"{diffusers}.{p}",), kind) for p in ("weight", "bias")]


def _qkv(sd3: str, diffusers: tuple[str, str, str]) -> list[KeyRule]:
    return [KeyRule(f"{sd3}.{p}", tuple(f"{d}.{p}" for d in diffusers), "fused") for p in ("weight", "bias")]


def _attention(sd3: str, diffusers: str, *, text: bool, qk_norm: bool, output: bool) -> list[KeyRule]:
    names = ("add_q_proj", "add_k_proj", "add_v_proj") if text else ("to_q", "to_k", "to_v")
    rules = _qkv(f"{sd3}.qkv", tuple(f"{diffusers}.{n}" for n in names))
    if qk_norm:
        norm_q, norm_k = ("norm_added_q", "norm_added_k") if text else ("norm_q", "norm_k")
        rules += [
            KeyRule(f"{sd3}.ln_q.weight", (f"{diffusers}.{norm_q}.weight",)),
            KeyRule(f"{sd3}.ln_k.weight", (f"{diffusers}.{norm_k}.weight",)),
        ]
    if output:
        rules += _linear(f"{sd3}.proj", f"{diffusers}.{'to_add_out' if text else 'to_out.0'}")
    return rules


def key_rules(arch: BaseArch) -> tuple[KeyRule, ...]:
    """Every rule for a model of this architecture (global layers, then blocks in order)."""
    rules = [
        KeyRule("pos_embed", ("pos_embed.pos_embed",)),
        *_linear("x_embedder.proj", "pos_embed.proj"),
        *_linear("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
        *_linear("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
        *_linear("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
        *_linear("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
        *_linear("context_embedder", "context_embedder"),
        *_linear("final_layer.linear", "proj_out"),
        *_linear("final_layer.adaLN_modulation.1", "norm_out.linear", "swapped"),
    ]
    for i in range(arch.depth):
        s, d = f"joint_blocks.{i}", diffusers_module(f"blocks.{i}")
        last = i == arch.depth - 1
        rules += _attention(f"{s}.x_block.attn", f"{d}.attn", text=False, qk_norm=arch.qk_norm, output=True)
        rules += _attention(f"{s}.context_block.attn", f"{d}.attn", text=True, qk_norm=arch.qk_norm, output=not last)
        if i in arch.dual_attention_layers:
            rules += _attention(f"{s}.x_block.attn2", f"{d}.attn2", text=False, qk_norm=arch.qk_norm, output=True)
        rules += _linear(f"{s}.x_block.adaLN_modulation.1", f"{d}.norm1.linear")
        rules += _linear(
            f"{s}.context_block.adaLN_modulation.1", f"{d}.norm1_context.linear", "swapped" if last else "same"
        )
        rules += _linear(f"{s}.x_block.mlp.fc1", f"{d}.ff.net.0.proj")
        rules += _linear(f"{s}.x_block.mlp.fc2", f"{d}.ff.net.2")
        if not last:
            rules += _linear(f"{s}.context_block.mlp.fc1", f"{d}.ff_context.net.0.proj")
            rules += _linear(f"{s}.context_block.mlp.fc2", f"{d}.ff_context.net.2")
    return tuple(rules)


def _swap_halves(t: Tensor) -> Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def diffusers_to_sd3(state: Mapping[str, Tensor], arch: BaseArch) -> dict[str, Tensor]:
    """Map diffusers tensors to SD3 names; a rule is applied when all its sources are present.

    Raises:
        ValueError: some but not all of a fused qkv's q, k, v are given.
    """
    out: dict[str, Tensor] = {}
    for rule in key_rules(arch):
        present = [name in state for name in rule.diffusers]
        if not any(present):
            continue
        if not all(present):
            missing = [n for n, p in zip(rule.diffusers, present, strict=True) if not p]
            raise ValueError(f"{rule.sd3} is fused from {rule.diffusers}; {missing} are missing. Pass all three.")
        sources = [state[name] for name in rule.diffusers]
        if rule.kind == "fused":
            out[rule.sd3] = torch.cat(sources, dim=0)
        elif rule.kind == "swapped":
            out[rule.sd3] = _swap_halves(sources[0])
        else:
            out[rule.sd3] = sources[0]
    return out


def sd3_to_diffusers(state: Mapping[str, Tensor], arch: BaseArch) -> dict[str, Tensor]:
    """Map SD3-named tensors to diffusers names.

    Raises:
        ValueError: a name that no rule of this architecture knows (names the key and the model).
    """
    by_sd3 = {rule.sd3: rule for rule in key_rules(arch)}
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        rule = by_sd3.get(key)
        if rule is None:
            raise ValueError(f"{key!r} is not a weight of a {arch.describe()}.")
        if rule.kind == "fused":
            for name, part in zip(rule.diffusers, tensor.chunk(3, dim=0), strict=True):
                out[name] = part
        elif rule.kind == "swapped":
            out[rule.diffusers[0]] = _swap_halves(tensor)
        else:
            out[rule.diffusers[0]] = tensor
    return out

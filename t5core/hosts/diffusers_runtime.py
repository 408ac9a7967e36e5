"""What runs inside a converted diffusers `SD3Transformer2DModel` on each call.

`T5AttnProcessor` runs T5 attention between an `Attention` module's own projections; `grid_hook` puts
the latent token grid into `joint_attention_kwargs["t5_grid"]` for it, and `drop_grid_hook` keeps that
key from the attention modules that stay softmax. `t5core.hosts.diffusers` installs them.
diffusers orders joint tokens [image, text].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from t5core.attention import T5Attention

__all__ = ["GRID_KWARG", "T5AttnProcessor", "drop_grid_hook", "grid_hook"]

GRID_KWARG = "t5_grid"


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


def grid_hook(patch_size: int) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """A forward pre-hook for the transformer: the latent token grid into `joint_attention_kwargs`."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        height, width = latents.shape[-2:]
        joint = dict(kwargs.get("joint_attention_kwargs") or {})
        joint[GRID_KWARG] = (height // patch_size, width // patch_size)
        return args, {**kwargs, "joint_attention_kwargs": joint}

    return hook


def drop_grid_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook for attention that keeps softmax: its processor never sees the grid."""
    return args, {key: value for key, value in kwargs.items() if key != GRID_KWARG}

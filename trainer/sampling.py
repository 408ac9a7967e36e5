"""Sampling a flow-matching transformer: text conditioning for a batch, the shifted sigma schedule, and the
Euler sampler with classifier-free guidance that validation and the toy's evaluation use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.losses import predict_velocity, shift_sigmas

__all__ = ["Conditioning", "sample", "sigma_schedule"]


@dataclass(frozen=True, slots=True)
class Conditioning:
    """Conditional and unconditional text conditioning for a batch: `context`, `context_uncond` `(B, T, J)`;
    `pooled`, `pooled_uncond` `(B, P)`."""

    context: Tensor
    pooled: Tensor
    context_uncond: Tensor
    pooled_uncond: Tensor


def sigma_schedule(steps: int, *, shift: float = 1.0) -> Tensor:
    """Flow-matching sigmas from 1 to 0 (`steps + 1` values), shifted as SD3's scheduler does."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}.")
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return shift_sigmas(s, shift).float()


@torch.no_grad()
def sample(
    model, cond: Conditioning, noise: Tensor, steps: int = 20, cfg: float = 3.0, *, shift: float = 1.0
) -> Tensor:
    """Euler sampling of the flow-matching ODE from `noise` (sigma = 1) to latents (sigma = 0).

    Works for the softmax model and for any linearized one (the T5 host hook supplies the grid).
    Cond and uncond run as one batch, as in ComfyUI and diffusers.

    Args:
        model: an `SD3Transformer2DModel` (possibly linearized).
        cond (`Conditioning`): text conditioning for B samples.
        noise (`Tensor`): `(B, 16, h, w)` starting latents.
        steps (`int`, *optional*, defaults to 20): Euler steps.
        cfg (`float`, *optional*, defaults to 3.0): classifier-free guidance scale; 1 disables it.
        shift (`float`, *optional*, defaults to 1.0): sigma shift (1 = none).

    Returns:
        `(B, 16, h, w)` latents in the dtype of `noise`.
    """
    if noise.shape[0] != cond.context.shape[0]:
        raise ValueError(
            f"noise has batch {noise.shape[0]} but cond has {cond.context.shape[0]}; give one caption per sample."
        )
    dtype = next(model.parameters()).dtype
    x = noise.to(dtype)
    guided = cfg != 1.0
    context = torch.cat([cond.context, cond.context_uncond]) if guided else cond.context
    pooled = torch.cat([cond.pooled, cond.pooled_uncond]) if guided else cond.pooled
    context, pooled = context.to(dtype), pooled.to(dtype)
    sigmas = sigma_schedule(steps, shift=shift)
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        if guided:
            x_both = torch.cat([x, x])
            v_cond, v_uncond = predict_velocity(
                model, x_both, sigma.expand(len(x_both)), context=context, pooled=pooled
            ).chunk(2)
            velocity = v_uncond + cfg * (v_cond - v_uncond)
        else:
            velocity = predict_velocity(model, x, sigma.expand(len(x)), context=context, pooled=pooled)
        x = x + (sigma_next - sigma).to(dtype) * velocity
    return x.to(noise.dtype)

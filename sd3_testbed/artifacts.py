"""Artifact measures that ToyEval cannot see: a raised background and a token-periodic pattern.

Both compare samples with the softmax teacher's samples from the same captions and noise.

* `background_level`: the mean pixel level where the teacher's image is black (its brightest channel
  below `BLACK`). The toy's background is black, so a model that lifts it (banding, a faint grid)
  scores above the teacher's own level there.
* `open_background_level`: the same, over the background pixels farther than `margin` pixels from
  either image's objects, so that an object drawn a little larger or elsewhere than the teacher's
  does not count: what is left is a lift of the open background (banding, a faint grid).
* `token_period_energy`: the share of the energy of (model - teacher) that lies on the token
  lattice of the spectrum: the frequencies of a pattern that repeats every `token_px` pixels in both
  directions (4 px for the toy: 2 x 2 latent patches of 2 x 2 pixels). White residual puts
  `(token_px^2 - 1) / (H W)` of its energy there (0.0065 at 48 px); a per-token pattern all of it.
* `background_error`: the open background before the decoder's clamp (`generate(..., clamp=False)`),
  split into its mean (`bias`: the data's background is exactly black, 0), its spread (`noise`) and
  the part that repeats every token (`token_pattern`). The clamp hides everything below black, so the
  two levels above move with the bias as much as with the noise: the teacher's own low level is its
  background sitting below black, not a cleaner one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sd3_testbed.eval import FOREGROUND

__all__ = [
    "BLACK",
    "BackgroundError",
    "background_error",
    "background_level",
    "open_background_level",
    "token_period_energy",
]

BLACK = 0.05
"""A teacher pixel is background when its brightest channel is below this (objects are > `FOREGROUND`)."""


def _check(images: Tensor, teacher_images: Tensor) -> None:
    if images.shape != teacher_images.shape or images.dim() != 4:
        raise ValueError(
            f"need two (B, 3, H, W) image sets of one shape; got {tuple(images.shape)} and "
            f"{tuple(teacher_images.shape)}."
        )


def _token_grid(images: Tensor, token_px: int) -> tuple[int, int]:
    """The `(H, W)` of `images`, checked to be multiples of `token_px`."""
    height, width = images.shape[-2:]
    if height % token_px or width % token_px:
        raise ValueError(f"image size {height}x{width} is not a multiple of the token size {token_px}.")
    return height, width


def _masked_mean(images: Tensor, mask: Tensor) -> float:
    """Mean of `images` over `mask`; 0.0 where the mask is empty."""
    return images.float()[mask].mean().item() if mask.any() else 0.0


def background_level(images: Tensor, teacher_images: Tensor) -> float:
    """Mean level of `images` (in [0, 1]) over the pixels where `teacher_images` is black.

    Pass the teacher's images as both arguments for the teacher's own level.
    """
    _check(images, teacher_images)
    black = teacher_images.float().amax(dim=1, keepdim=True) < BLACK
    return _masked_mean(images, black.expand_as(images))


def _open_mask(images: Tensor, teacher_images: Tensor, margin: int) -> Tensor:
    """`(B, 3, H, W)`: the teacher's black pixels more than `margin` pixels (Chebyshev distance) from an
    object pixel (ToyEval's foreground) of either image; `images` in [0, 1]."""
    _check(images, teacher_images)
    near = (torch.maximum(images.float(), teacher_images.float()).amax(dim=1, keepdim=True) > FOREGROUND).float()
    near = F.max_pool2d(near, 2 * margin + 1, stride=1, padding=margin) > 0
    open_ = (teacher_images.float().amax(dim=1, keepdim=True) < BLACK) & ~near
    return open_.expand_as(images)


def open_background_level(images: Tensor, teacher_images: Tensor, *, margin: int = 2) -> float:
    """Mean level of `images` over the teacher's black pixels more than `margin` pixels (Chebyshev
    distance) from an object pixel (ToyEval's foreground) of either image; 0.0 where no such pixel exists."""
    return _masked_mean(images, _open_mask(images, teacher_images, margin))


@dataclass(frozen=True, slots=True)
class BackgroundError:
    """How a model's open background departs from the data's black (0), before the decoder's clamp."""

    bias: float
    """Mean raw level; below 0 is hidden by the clamp."""
    noise: float
    """Standard deviation of the raw level about `bias`."""
    token_pattern: float
    """RMS about `bias` of the mean level at each pixel position within a token (channel by channel):
    the part of the background that repeats every token, the faint grid."""
    lit: float
    """Share of the values above black: what the clamp lets through."""


def background_error(
    raw_images: Tensor, teacher_images: Tensor, *, margin: int = 2, token_px: int = 4
) -> BackgroundError:
    """The open background (`open_background_level`'s pixels) of unclamped decodes, split into bias,
    noise and token pattern.

    Args:
        raw_images: `(B, 3, H, W)` decodes before the clamp (`generate(..., clamp=False)`).
        teacher_images: the teacher's `(B, 3, H, W)` samples from the same captions and noise, in [0, 1].
        margin: pixels kept clear of objects, as `open_background_level`.
        token_px: pixels per token side (H and W must be multiples of it).

    Returns:
        A `BackgroundError`; all zeros where no open background exists.
    """
    mask = _open_mask(raw_images.clamp(0.0, 1.0), teacher_images, margin)
    height, width = _token_grid(raw_images, token_px)
    if not mask.any():
        return BackgroundError(0.0, 0.0, 0.0, 0.0)
    raw = raw_images.float()
    values = raw[mask]
    bias = values.mean()
    # (B, C, H/t, t, W/t, t): sum each pixel position within a token over every token and image
    tiles = raw.shape[:2] + (height // token_px, token_px, width // token_px, token_px)
    weights = mask.float().view(tiles).sum(dim=(0, 2, 4))
    phase_mean = (raw * mask).view(tiles).sum(dim=(0, 2, 4)) / weights.clamp_min(1)
    occupied = weights > 0
    pattern = (phase_mean[occupied] - bias).square().mul(weights[occupied]).sum() / weights[occupied].sum()
    return BackgroundError(
        bias=bias.item(),
        noise=values.std(correction=0).item(),
        token_pattern=pattern.sqrt().item(),
        lit=(values > 0).float().mean().item(),
    )


def token_period_energy(images: Tensor, teacher_images: Tensor, *, token_px: int = 4) -> float:
    """Share of the residual's spectral energy at the token period and its harmonics.

    Args:
        images, teacher_images: `(B, 3, H, W)` samples from the same captions and noise.
        token_px: pixels per token side (H and W must be multiples of it).

    Returns:
        A fraction in [0, 1]; white residual gives about `(token_px**2 - 1) / (H * W)`.
    """
    _check(images, teacher_images)
    height, width = _token_grid(images, token_px)
    residual = images.float() - teacher_images.float()
    residual = residual - residual.mean(dim=(-2, -1), keepdim=True)
    power = torch.fft.fft2(residual).abs().square().sum(dim=(0, 1))  # (H, W)
    # a pattern of period token_px has its energy at multiples of (H / token_px, W / token_px) cycles
    rows = torch.arange(height) % (height // token_px) == 0
    cols = torch.arange(width) % (width // token_px) == 0
    periodic = rows[:, None] & cols[None, :]
    periodic[0, 0] = False
    total = power.sum()
    return (power[periodic].sum() / total).item() if total > 0 else 0.0

"""ToyEval: a programmatic score of generated toy images, in the spirit of GenEval, plus the
flow-matching validation loss and the distance to the softmax teacher's samples.

Each image is read off its pixels: the foreground is every pixel brighter than `FOREGROUND`; its
largest 4-connected component is the object. Colour = the word whose palette colour (`COLORS`, or
the palette the images were rendered in) is nearest to the object's mean RGB; position = nearest
anchor to its centroid; size = its bounding-box extent against the midpoint of the two sizes; shape =
its fill ratio (area / bounding box: square 1, circle pi/4, triangle 1/2). An image with no object, or
with foreground over `CLUTTER` of its area, is unreadable and matches nothing. A sample scores on an
attribute when the reading equals its caption; `overall` needs all four. Chance is 1/6 (colour), 1/3
(shape), 1/5 (position), 1/2 (size) and 1/180 overall.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sd3_testbed.data import (
    COLORS,
    IMAGE_SIZE,
    LATENT_CHANNELS,
    POSITIONS,
    SIZES,
    Caption,
    Palette,
    ToyBatch,
    all_captions,
    check_palette,
    decode_latents,
    make_batch,
)
from sd3_testbed.model import ToyCond
from trainer.config import LossConfig
from trainer.losses import sample_sigmas, step_losses
from trainer.sampling import sample

logger = logging.getLogger(__name__)

__all__ = [
    "ATTRIBUTES",
    "GENERATE_BATCH",
    "Reading",
    "ToyEvalScore",
    "batch_loss",
    "eval_set",
    "generate",
    "read_images",
    "sample_hits",
    "score_hits",
    "score_images",
    "teacher_distance",
    "toy_eval",
    "validation_loss",
]

ATTRIBUTES: tuple[str, ...] = ("color", "shape", "position", "size")
FOREGROUND = 0.35
"""A pixel is foreground when its brightest channel exceeds this (background is black)."""
CLUTTER = 0.4
"""Foreground above this fraction of the image means there is no single readable object."""
MIN_PIXELS = 6
_FILL_SQUARE = 0.89
_FILL_TRIANGLE = 0.64
_SIZE_SPLIT = sum(SIZES.values())
"""Bounding-box extent / side separating small (2 x 0.125) from large (2 x 0.22)."""


@dataclass(frozen=True, slots=True)
class Reading:
    """What ToyEval reads off one image; None fields mean the image has no readable object."""

    color: str | None
    shape: str | None
    position: str | None
    size: str | None

    def matches(self, caption: Caption) -> dict[str, bool]:
        return {name: getattr(self, name) == getattr(caption, name) for name in ATTRIBUTES}


@dataclass(frozen=True, slots=True)
class ToyEvalScore:
    """Fractions of samples whose attribute matches the caption; `overall` needs all four."""

    color: float
    shape: float
    position: float
    size: float
    overall: float
    readable: float
    count: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _largest_component(mask: Tensor) -> Tensor:
    """Keep the largest 4-connected component of each (B, S, S) boolean mask."""
    count, rows, cols = mask.shape
    big = rows * cols + 1
    labels = torch.where(mask, torch.arange(rows * cols, dtype=torch.float32).view(1, rows, cols), float(big))
    cross = torch.tensor([[0, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=torch.bool)
    while True:
        padded = F.pad(labels, (1, 1, 1, 1), value=float(big)).unsqueeze(1)
        patches = F.unfold(padded, 3).view(count, 9, rows, cols)[:, cross.flatten()]
        spread = torch.where(mask, patches.amin(1), float(big))
        if torch.equal(spread, labels):
            break
        labels = spread
    flat = labels.view(count, -1).long()
    sizes = torch.zeros(count, big + 1).scatter_add_(1, flat, mask.view(count, -1).float())
    sizes[:, big] = 0
    keep = sizes.argmax(1)
    return (flat == keep.view(count, 1)).view(count, rows, cols) & mask


def _nearest(value: Tensor, table: dict[str, tuple[float, ...]]) -> list[str]:
    names = list(table)
    centres = torch.tensor([table[n] for n in names], dtype=torch.float32)
    return [names[i] for i in torch.cdist(value, centres).argmin(1).tolist()]


def read_images(images: Tensor, *, palette: Palette = COLORS) -> list[Reading]:
    """Read colour (a word of `palette`), shape, position and size off `(B, 3, S, S')` images in [0, 1]."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, S, S') RGB in [0, 1]; got {tuple(images.shape)}.")
    check_palette(palette)
    images = images.float()
    count, _, rows, cols = images.shape
    foreground = images.amax(1) > FOREGROUND
    obj = _largest_component(foreground)
    area = obj.flatten(1).sum(1).float()
    readable = (area >= MIN_PIXELS) & (foreground.flatten(1).float().mean(1) <= CLUTTER)
    weights = obj.float().unsqueeze(1)
    mean_rgb = (images * weights).flatten(2).sum(2) / area.clamp_min(1).view(count, 1)
    row_idx = torch.arange(rows, dtype=torch.float32) + 0.5
    col_idx = torch.arange(cols, dtype=torch.float32) + 0.5
    centroid = torch.stack(
        [(obj.sum(2) * row_idx).sum(1) / rows, (obj.sum(1) * col_idx).sum(1) / cols], dim=1
    ) / area.clamp_min(1).view(count, 1)
    height, width = obj.any(2).sum(1).float(), obj.any(1).sum(1).float()
    fill = area / (height * width).clamp_min(1)
    extent = torch.maximum(height / rows, width / cols)
    colors = _nearest(mean_rgb, palette)
    positions = _nearest(centroid, POSITIONS)
    readings = []
    for i in range(count):
        if not readable[i]:
            readings.append(Reading(None, None, None, None))
            continue
        shape = "square" if fill[i] > _FILL_SQUARE else "circle" if fill[i] > _FILL_TRIANGLE else "triangle"
        size = "large" if extent[i] > _SIZE_SPLIT else "small"
        readings.append(Reading(color=colors[i], shape=shape, position=positions[i], size=size))
    return readings


def sample_hits(
    images: Tensor, captions: tuple[Caption, ...] | list[Caption], *, palette: Palette = COLORS
) -> list[dict[str, bool]]:
    """Per sample: which attributes match the caption (colours read in `palette`), `overall` (all four)
    and `readable`."""
    if len(captions) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(captions)} captions; give one caption per image.")
    hits = []
    for reading, caption in zip(read_images(images, palette=palette), captions, strict=True):
        match = reading.matches(caption)
        hits.append({**match, "overall": all(match.values()), "readable": reading.color is not None})
    return hits


def score_images(
    images: Tensor, captions: tuple[Caption, ...] | list[Caption], *, palette: Palette = COLORS
) -> ToyEvalScore:
    """ToyEval of images against their captions (per attribute, overall, and readable fraction), colours
    read in `palette`."""
    return score_hits(sample_hits(images, captions, palette=palette))


def score_hits(hits: list[dict[str, bool]]) -> ToyEvalScore:
    """ToyEval of `sample_hits`' per-sample results: the fraction of samples that hit each attribute."""
    fractions = {name: sum(h[name] for h in hits) / len(hits) for name in (*ATTRIBUTES, "overall", "readable")}
    return ToyEvalScore(**fractions, count=len(hits))


def eval_set(count: int, *, seed: int = 0, size: int = IMAGE_SIZE) -> tuple[tuple[Caption, ...], Tensor]:
    """The fixed evaluation prompts and noise: `count` captions cycling through a seeded permutation
    of all 180, and `(count, 16, size/2, size/2)` Gaussian noise, one seeded draw per sample, so the
    first k samples of a larger set are exactly the set of size k."""
    table = all_captions()
    order = torch.randperm(len(table), generator=torch.Generator().manual_seed(seed)).tolist()
    captions = tuple(table[order[i % len(table)]] for i in range(count))
    shape = (LATENT_CHANNELS, size // 2, size // 2)
    noise = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + i)) for i in range(count)]
    )
    return captions, noise


GENERATE_BATCH = 64
"""Samples per sampling batch of `generate`."""


def generate(
    model,
    captions: tuple[Caption, ...],
    noise: Tensor,
    *,
    steps: int = 20,
    cfg: float = 3.0,
    on_batch: Callable[[], object] | None = None,
    clamp: bool = True,
) -> Tensor:
    """Sample images `(B, 3, S, S)` in [0, 1] for captions from the given noise, `GENERATE_BATCH` at a
    time; `on_batch` is called after each batch (a progress bar's update); `clamp=False` keeps the
    decoder's values outside [0, 1] (`decode_latents`)."""
    chunks = []
    for start in range(0, len(captions), GENERATE_BATCH):
        part = captions[start : start + GENERATE_BATCH]
        cond = ToyCond.from_captions([str(c) for c in part])
        latents = sample(model, cond, noise[start : start + len(part)], steps=steps, cfg=cfg)
        chunks.append(decode_latents(latents, clamp=clamp))
        if on_batch is not None:
            on_batch()
    return torch.cat(chunks)


def toy_eval(
    model,
    *,
    count: int = 180,
    steps: int = 20,
    cfg: float = 3.0,
    seed: int = 0,
    size: int = IMAGE_SIZE,
    clamp: bool = True,
    palette: Palette = COLORS,
) -> tuple[ToyEvalScore, Tensor]:
    """Generate the fixed evaluation set with `model` at `size` x `size` pixels and score it, colours
    read in `palette` (the one the model was trained on).

    Returns:
        The `ToyEvalScore` and the images `(count, 3, S, S)`, for grids and teacher distances; with
        `clamp=False` the decoder's values outside [0, 1] are kept (the score reads the clamped images).
    """
    captions, noise = eval_set(count, seed=seed, size=size)
    images = generate(model, captions, noise, steps=steps, cfg=cfg, clamp=clamp)
    return score_images(images.clamp(0.0, 1.0), captions, palette=palette), images


def teacher_distance(images: Tensor, teacher_images: Tensor) -> float:
    """Root-mean-square pixel difference (in [0, 1] units) between samples made from the same noise."""
    if images.shape != teacher_images.shape:
        raise ValueError(f"image sets differ in shape: {tuple(images.shape)} vs {tuple(teacher_images.shape)}.")
    return (images.float() - teacher_images.float()).square().mean().sqrt().item()


_TOY_LOSS = LossConfig()
"""The toy's flow-matching loss: SD3's logit-normal(0, 1) sigmas, no shift, no weighting."""


def batch_loss(
    model,
    batch: ToyBatch,
    *,
    generator: torch.Generator,
    config: LossConfig = _TOY_LOSS,
    teacher: torch.nn.Module | None = None,
) -> Tensor:
    """The trainer's loss (`trainer.losses.step_losses`) on a toy batch, noise and sigmas from `generator`.

    Args:
        config (`LossConfig`, *optional*): loss weights; defaults to flow matching alone.
        teacher (`nn.Module`, *optional*): the frozen softmax model, needed when `config.distill_weight > 0`.

    Returns:
        The scalar loss (float32), differentiable.
    """
    noise = torch.randn(batch.latents.shape, generator=generator)
    sigmas = sample_sigmas(batch.latents.shape[0], generator=generator, config=config)
    return step_losses(
        model,
        batch.latents,
        noise=noise,
        sigmas=sigmas,
        context=batch.encoder_hidden_states,
        pooled=batch.pooled_projections,
        config=config,
        teacher=teacher if config.distill_weight > 0 else None,
    ).total


@torch.no_grad()
def validation_loss(
    model,
    *,
    batches: int = 4,
    batch_size: int = 32,
    seed: int = 10_000,
    size: int = IMAGE_SIZE,
    palette: Palette = COLORS,
) -> float:
    """Mean flow-matching loss on fixed held-out batches (images `size` px, rendered in `palette`), fixed
    noise and sigmas."""
    total = 0.0
    for index in range(batches):
        batch = make_batch(batch_size, seed=seed + index, size=size, palette=palette)
        total += batch_loss(model, batch, generator=torch.Generator().manual_seed(seed + index)).item()
    return total / batches

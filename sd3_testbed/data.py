"""The toy's procedural text-to-image set, its "text encoders" and its "VAE", all made on the fly.

An image is one filled shape on a black background; its caption names the shape's size, colour,
kind and position ("small red circle top left"). Everything is a pure function of a seed, so any
batch can be re-made bit for bit, on any machine, without downloads. The colour a word renders as is
a palette's (`PALETTES`, `COLORS` by default), so a fine-tune of the teacher can learn another one.

Stand-ins for the parts of SD3 the toy does not ship:

* text encoders: a fixed-vocabulary tokenizer, then fixed seeded tables that turn tokens into
  `encoder_hidden_states (B, T, joint_attention_dim)` and `pooled_projections (B, pooled_dim)`;
* VAE: `encode_images` space-to-depth (2x2) then an orthonormal 12 -> 16 channel map, so latents
  have 16 channels at half the image resolution; `decode_latents` is its exact left inverse.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "COLORS",
    "IMAGE_SIZE",
    "JOINT_ATTENTION_DIM",
    "LATENT_CHANNELS",
    "PALETTES",
    "POOLED_DIM",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "TEXT_TOKENS",
    "VOCAB",
    "Caption",
    "Palette",
    "ToyBatch",
    "all_captions",
    "check_palette",
    "decode_latents",
    "embed_captions",
    "encode_images",
    "make_batch",
    "render",
    "sample_captions",
    "tokenize",
]

IMAGE_SIZE = 48
"""Default image side in pixels (24 x 24 latents, 12 x 12 = 144 image tokens); images may be any
multiple of 16 from 32 up."""
LATENT_CHANNELS = 16
JOINT_ATTENTION_DIM = 64
POOLED_DIM = 64
TEXT_TOKENS = 8
"""Context length T: the longest caption has 5 words, padded to 8 tokens."""

Palette = Mapping[str, tuple[float, float, float]]
"""The RGB colour (in [0, 1]) each colour word of the captions renders as."""

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.1),
    "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "magenta": (0.95, 0.1, 0.95),
    "cyan": (0.1, 0.9, 0.95),
}
"""The colour words and the palette the teacher was trained on."""
PALETTES: dict[str, Palette] = {
    "default": COLORS,
    # every word renders as the next word's default colour: a fine-tune that must relearn each colour
    "rotated": {
        "red": COLORS["green"],
        "green": COLORS["blue"],
        "blue": COLORS["yellow"],
        "yellow": COLORS["magenta"],
        "magenta": COLORS["cyan"],
        "cyan": COLORS["red"],
    },
}
"""Named palettes (`render`, `make_batch` and ToyEval take one): `default` is `COLORS`."""
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: dict[str, float] = {"small": 0.125, "large": 0.22}
"""Half-extent of the shape as a fraction of the image side."""
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.25, 0.25),
    "top right": (0.25, 0.75),
    "bottom left": (0.75, 0.25),
    "bottom right": (0.75, 0.75),
    "center": (0.5, 0.5),
}
"""Anchor (row, column) as fractions of the image side."""
JITTER = 0.04
"""Largest random offset of the shape centre from its anchor, as a fraction of the side."""

VOCAB: tuple[str, ...] = ("<pad>", *SIZES, *COLORS, *SHAPES, "top", "bottom", "left", "right", "center")
_TOKEN_ID = {word: i for i, word in enumerate(VOCAB)}

_TEXT_SEED = 20260
_LATENT_SEED = 20261


@dataclass(frozen=True, slots=True)
class Caption:
    """One caption's attributes; `str(caption)` is the text, e.g. "small red circle top left"."""

    size: str
    color: str
    shape: str
    position: str

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("size", self.size, SIZES),
            ("color", self.color, COLORS),
            ("shape", self.shape, SHAPES),
            ("position", self.position, POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"caption {name} {value!r} is not one of {tuple(allowed)}.")

    def __str__(self) -> str:
        return f"{self.size} {self.color} {self.shape} {self.position}"


@dataclass(frozen=True, slots=True)
class ToyBatch:
    """A batch ready for the model: latents plus both text conditionings and the captions.

    Shapes: `latents (B, 16, h, w)` with h = w = image side / 2, `encoder_hidden_states
    (B, T, JOINT_ATTENTION_DIM)`, `pooled_projections (B, POOLED_DIM)`, `images (B, 3, S, S)` in [0, 1].
    """

    captions: tuple[Caption, ...]
    images: Tensor
    latents: Tensor
    encoder_hidden_states: Tensor
    pooled_projections: Tensor


def check_palette(palette: Palette) -> None:
    """Refuse a palette that does not give an RGB colour to exactly the colour words of `COLORS`.

    Raises:
        ValueError: missing or extra words, or a colour that is not three values in [0, 1].
    """
    if set(palette) != set(COLORS):
        raise ValueError(
            f"a palette colours exactly the words {tuple(COLORS)}; got {tuple(palette)}. "
            f"Start from one of PALETTES ({', '.join(PALETTES)})."
        )
    for word, rgb in palette.items():
        if len(rgb) != 3 or not all(0.0 <= value <= 1.0 for value in rgb):
            raise ValueError(f"palette colour of {word!r} is {rgb}; give three RGB values in [0, 1].")


def all_captions() -> tuple[Caption, ...]:
    """Every caption the set can produce (2 sizes x 6 colours x 3 shapes x 5 positions = 180)."""
    return tuple(
        Caption(size=s, color=c, shape=k, position=p)
        for s, c, k, p in itertools.product(SIZES, COLORS, SHAPES, POSITIONS)
    )


def sample_captions(count: int, *, generator: torch.Generator) -> tuple[Caption, ...]:
    """Draw `count` captions uniformly with replacement."""
    table = all_captions()
    picks = torch.randint(len(table), (count,), generator=generator)
    return tuple(table[i] for i in picks.tolist())


def render(
    captions: tuple[Caption, ...] | list[Caption],
    *,
    size: int = IMAGE_SIZE,
    generator: torch.Generator,
    palette: Palette = COLORS,
) -> Tensor:
    """Draw one filled shape per caption on black, in its colour word's `palette` colour; the centre
    jitters by up to `JITTER` of the side.

    Returns:
        `(B, 3, size, size)` float32 in [0, 1].
    """
    if size < 32 or size % 16:
        raise ValueError(f"image size must be a multiple of 16 and at least 32; got {size}.")
    check_palette(palette)
    count = len(captions)
    offsets = (torch.rand(count, 2, generator=generator) * 2 - 1) * JITTER * size
    axis = torch.arange(size, dtype=torch.float32) + 0.5
    rows, cols = axis.view(1, size, 1), axis.view(1, 1, size)
    anchors = torch.tensor([POSITIONS[c.position] for c in captions], dtype=torch.float32) * size + offsets
    half = torch.tensor([SIZES[c.size] for c in captions], dtype=torch.float32).view(count, 1, 1) * size
    dy = rows - anchors[:, 0].view(count, 1, 1)
    dx = cols - anchors[:, 1].view(count, 1, 1)
    circle = dy.square() + dx.square() <= half.square()
    square = (dy.abs() <= half) & (dx.abs() <= half)
    # Upright isosceles triangle filling the same box: apex at the top, base at the bottom.
    triangle = (dy.abs() <= half) & (dx.abs() <= (dy + half) / 2)
    kind = torch.tensor([SHAPES.index(c.shape) for c in captions]).view(count, 1, 1)
    mask = torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))
    color = torch.tensor([palette[c.color] for c in captions], dtype=torch.float32).view(count, 3, 1, 1)
    return mask.unsqueeze(1).float() * color


def tokenize(texts: list[str] | tuple[str, ...]) -> Tensor:
    """Map captions (or "" for the unconditional prompt) to token ids, padded to `TEXT_TOKENS`.

    Returns:
        `(B, T)` int64, pad id 0.

    Raises:
        ValueError: a word outside `VOCAB`, or a caption longer than T words.
    """
    ids = torch.zeros(len(texts), TEXT_TOKENS, dtype=torch.int64)
    for row, text in enumerate(texts):
        words = text.split()
        if len(words) > TEXT_TOKENS:
            raise ValueError(f"caption {text!r} has {len(words)} words; the toy tokenizer takes at most {TEXT_TOKENS}.")
        for col, word in enumerate(words):
            if word not in _TOKEN_ID:
                raise ValueError(f"caption {text!r}: word {word!r} is not in the toy vocabulary {VOCAB[1:]}.")
            ids[row, col] = _TOKEN_ID[word]
    return ids


def _text_tables() -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(_TEXT_SEED)
    words = torch.randn(len(VOCAB), JOINT_ATTENTION_DIM, generator=gen)
    words[0] = 0.0
    slots = torch.randn(TEXT_TOKENS, JOINT_ATTENTION_DIM, generator=gen) * 0.5
    pooled = torch.randn(len(VOCAB), POOLED_DIM, generator=gen)
    pooled[0] = 0.0
    return words, slots, pooled


def embed_captions(texts: list[str] | tuple[str, ...]) -> tuple[Tensor, Tensor]:
    """The toy's text encoders: fixed seeded word and slot tables; "" gives the unconditional embedding.

    Returns:
        `encoder_hidden_states (B, T, JOINT_ATTENTION_DIM)` (pad tokens are exactly zero) and
        `pooled_projections (B, POOLED_DIM)` (the mean of the words' pooled vectors), float32.
    """
    ids = tokenize(texts)
    words, slots, pooled = _text_tables()
    present = (ids > 0).unsqueeze(-1).float()
    hidden = (words[ids] + slots) * present
    count = present.sum(1).clamp_min(1.0)
    return hidden, pooled[ids].sum(1) / count


def _latent_basis() -> Tensor:
    gen = torch.Generator().manual_seed(_LATENT_SEED)
    basis, _ = torch.linalg.qr(torch.randn(LATENT_CHANNELS, 12, generator=gen, dtype=torch.float64))
    return basis.float()


def encode_images(images: Tensor) -> Tensor:
    """The toy's VAE encoder: [0, 1] RGB `(B, 3, S, S')` -> latents `(B, 16, S/2, S'/2)`.

    Pixels go to [-1, 1], each 2x2 patch to 12 channels, then through a fixed orthonormal 16 x 12
    map, so the latent norm equals the image norm and `decode_latents` inverts it exactly.
    """
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[-1] % 2 or images.shape[-2] % 2:
        raise ValueError(f"images must be (B, 3, S, S') with even sides; got {tuple(images.shape)}.")
    patches = F.pixel_unshuffle(images.float() * 2 - 1, 2)
    return torch.einsum("lc,bchw->blhw", _latent_basis(), patches)


def decode_latents(latents: Tensor, *, clamp: bool = True) -> Tensor:
    """The toy's VAE decoder: latents `(B, 16, h, w)` -> RGB `(B, 3, 2h, 2w)` in [0, 1]; `clamp=False`
    keeps what falls outside (the artifact measures read the background below black)."""
    if latents.ndim != 4 or latents.shape[1] != LATENT_CHANNELS:
        raise ValueError(f"latents must be (B, {LATENT_CHANNELS}, h, w); got {tuple(latents.shape)}.")
    patches = torch.einsum("lc,blhw->bchw", _latent_basis(), latents.float())
    images = (F.pixel_shuffle(patches, 2) + 1) / 2
    return images.clamp(0.0, 1.0) if clamp else images


def make_batch(
    batch_size: int, *, seed: int, size: int = IMAGE_SIZE, drop_text: float = 0.0, palette: Palette = COLORS
) -> ToyBatch:
    """Make batch `seed`: the same seed always gives the same batch, any batch size.

    Args:
        batch_size (`int`): B.
        seed (`int`): fixes captions, jitter and which captions are dropped.
        size (`int`, *optional*, defaults to `IMAGE_SIZE`): image side in pixels.
        drop_text (`float`, *optional*, defaults to 0): probability of replacing a caption's
            conditioning by the unconditional one (classifier-free guidance training).
        palette (`Palette`, *optional*, defaults to `COLORS`): the colour each colour word renders as;
            the same seed gives the same captions, shapes and jitter in any palette.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
    if not 0.0 <= drop_text < 1.0:
        raise ValueError(f"drop_text must be in [0, 1); got {drop_text}.")
    gen = torch.Generator().manual_seed(seed)
    captions = sample_captions(batch_size, generator=gen)
    images = render(captions, size=size, generator=gen, palette=palette)
    dropped = torch.rand(batch_size, generator=gen) < drop_text
    texts = ["" if drop else str(c) for c, drop in zip(captions, dropped.tolist(), strict=True)]
    hidden, pooled = embed_captions(texts)
    return ToyBatch(
        captions=captions,
        images=images,
        latents=encode_images(images),
        encoder_hidden_states=hidden,
        pooled_projections=pooled,
    )

"""Token chunks for the chunked torch path (`t5core.ttt_chunked`): which tokens each chunk holds, and
the locality conv (docs/method.md, "Per converted attention module", step 2) computed on one chunk of
image rows, forward and backward.

Legend: B batch, N tokens, H heads, D head dim, C = H*D conv channels, h x w latent grid, T text
tokens. Tensors come in the host layout (B, N, H, D).

An image chunk is a band of whole grid rows `[r0, r1)`. Its 3x3 conv reads one halo row above and
below: the band is cut out with its halo as a `(B, C, r1 - r0 + 2, w)` slab (zero rows at the image
border, as the conv's zero padding) and convolved with no row padding, so each chunk gives exactly
the rows of the full-image conv. Text tokens, and every token when there is no locality, are cut
into plain runs of at most `chunk_tokens`. A sequence that fits one chunk is one chunk, text included:
at small N every op is a fixed cost, so a separate run of a few text tokens would repeat the whole
chain of ops for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from t5core.contract import Conv

__all__ = ["Chunk", "Prepare", "TokenChunks"]

# A function applied to a token run (B, n, H, D) before the conv, returning fp32: the key norm, or a cast.
Prepare = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Chunk:
    """One chunk: the tokens `[start, stop)` and, for a band of image rows under locality, `rows = (r0, r1)`
    (a chunk of the whole sequence also holds the text tokens)."""

    start: int
    stop: int
    rows: tuple[int, int] | None = None

    @property
    def tokens(self) -> slice:
        return slice(self.start, self.stop)


def _runs(start: int, stop: int, size: int) -> list[Chunk]:
    return [Chunk(s, min(s + size, stop)) for s in range(start, stop, size)]


@dataclass(frozen=True)
class TokenChunks:
    """The chunks of one call's token layout.

    Args:
        n (`int`): tokens in the sequence.
        chunk_tokens (`int`): tokens per chunk; an image chunk holds `max(1, chunk_tokens // w)` rows.
        grid (`tuple[int, int]`, *optional*): `(h, w)` of the image tokens; None: no locality.
        text_tokens (`int`, *optional*, defaults to 0): text tokens in the sequence.
        text_first (`bool`, *optional*, defaults to True): text before or after the image tokens.
    """

    n: int
    chunk_tokens: int
    grid: tuple[int, int] | None = None
    text_tokens: int = 0
    text_first: bool = True
    chunks: list[Chunk] = field(init=False, repr=False, compare=False)
    """Bands of whole image rows (with a grid), then runs of text tokens; runs of all tokens without;
    one chunk of every token when they fit one."""

    def __post_init__(self) -> None:
        # a plain attribute set once: torch.compile cannot trace the lock of a `functools.cached_property`
        object.__setattr__(self, "chunks", self._plan())

    @property
    def image_start(self) -> int:
        return self.text_tokens if self.text_first else 0

    def _plan(self) -> list[Chunk]:
        if self.grid is None:
            return _runs(0, self.n, self.chunk_tokens)
        h, w = self.grid
        if self.n <= self.chunk_tokens:
            return [Chunk(0, self.n, (0, h))]
        band = max(1, self.chunk_tokens // w)
        first = self.image_start
        image = [
            Chunk(first + r0 * w, first + min(r0 + band, h) * w, (r0, min(r0 + band, h))) for r0 in range(0, h, band)
        ]
        text_start = 0 if self.text_first else h * w
        return image + _runs(text_start, text_start + self.text_tokens, self.chunk_tokens)

    def _parts(self, chunk: Chunk) -> tuple[slice, slice | None]:
        """The image tokens of a chunk with rows and its text tokens (None if it has none), relative
        to the chunk's start."""
        (r0, r1), (_, w) = chunk.rows, self.grid
        image = slice(self.image_start + r0 * w - chunk.start, self.image_start + r1 * w - chunk.start)
        if image.stop - image.start == chunk.stop - chunk.start:
            return image, None
        return image, slice(image.stop, chunk.stop) if image.start == 0 else slice(0, image.start)

    def _halo(self, rows: tuple[int, int]) -> tuple[int, int]:
        """Grid rows `[lo, hi)` of the band plus its halo rows that lie inside the image."""
        return max(rows[0] - 1, 0), min(rows[1] + 1, self.grid[0])

    def slab(self, x: Tensor, chunk: Chunk, prepare: Prepare) -> Tensor:
        """The band of `chunk` with one halo row above and below (zeros outside the image), prepared.

        Returns:
            `(B, C, r1 - r0 + 2, w)` fp32 (a channels-last view).
        """
        (r0, r1), (lo, hi) = chunk.rows, self._halo(chunk.rows)
        _, w = self.grid
        start = self.image_start
        band = prepare(x[:, start + lo * w : start + hi * w]).reshape(x.shape[0], hi - lo, w, -1)
        if (lo, hi) != (r0 - 1, r1 + 1):
            band = F.pad(band, (0, 0, 0, 0, lo - (r0 - 1), (r1 + 1) - hi))
        return band.permute(0, 3, 1, 2)

    def local(self, x: Tensor, chunk: Chunk, conv: Conv | None, prepare: Prepare) -> Tensor:
        """The chunk's tokens after `prepare` and, on image rows with a conv, plus the conv: `x + DWC(x)`.

        Returns:
            `(B, H, n, D)` fp32, contiguous (heads first, as the inner model's matmuls take it).
        """
        batch, _, heads, dim = x.shape
        out_BHND = torch.empty(batch, heads, chunk.stop - chunk.start, dim, dtype=torch.float32, device=x.device)
        out = out_BHND.transpose(1, 2)
        tokens = x[:, chunk.tokens]
        if conv is None or chunk.rows is None:
            out.copy_(prepare(tokens))
            return out_BHND
        image_part, text_part = self._parts(chunk)
        if text_part is not None:
            out[:, text_part].copy_(prepare(tokens[:, text_part]))
        weight, bias = conv
        bias = None if bias is None else bias.float()
        if chunk.rows == (0, self.grid[0]):
            # the band is the whole image: the conv's own zero padding, no slab to pad and copy; a slice
            # of heads is made dense (else the conv copies it to channels-first, a much slower path)
            image = prepare(tokens[:, image_part]).contiguous().reshape(batch, *self.grid, -1).permute(0, 3, 1, 2)
            conv_out = F.conv2d(image, weight.float(), bias, padding=1, groups=image.shape[1])
            centre = image
        else:
            slab = self.slab(x, chunk, prepare)
            conv_out = F.conv2d(slab, weight.float(), bias, padding=(0, 1), groups=slab.shape[1])
            centre = slab[:, :, 1:-1]
        # both are channels-last, so (B, rows, w, C) and then (B, n, H, D) are views
        centre, conv_out = (y.permute(0, 2, 3, 1).reshape(batch, -1, heads, dim) for y in (centre, conv_out))
        # an assignment, not `torch.add(..., out=)` into the strided view, which torch.compile cannot trace
        out[:, image_part] = centre + conv_out
        return out_BHND

    def local_backward(
        self,
        grad: Tensor,
        x: Tensor,
        chunk: Chunk,
        conv: Conv | None,
        prepare: Prepare,
        *,
        grad_x: Tensor,
        grad_conv: list[Tensor],
    ) -> None:
        """Backward of `local` for one chunk: add the gradient of the prepared `x` into `grad_x`, and
        the conv's weight and bias gradients into `grad_conv`.

        Args:
            grad (`Tensor`): `(B, n, H, D)` gradient of `local`'s output (a view of the heads-first
                gradient is fine), fp32.
            grad_x (`Tensor`): `(B, N, H, D)` fp32 accumulator; the conv's transpose reaches into
                the halo rows, so neighbouring chunks add into the same rows.
            grad_conv (`list[Tensor]`): `[weight (C, 1, 3, 3), bias (C,)]` fp32 accumulators (the
                bias one is unused when the conv has no bias).
        """
        grad_x[:, chunk.tokens] += grad
        if conv is None or chunk.rows is None:
            return
        grad = grad[:, self._parts(chunk)[0]]
        (r0, r1), (lo, hi) = chunk.rows, self._halo(chunk.rows)
        _, w = self.grid
        slab = self.slab(x, chunk, prepare)
        channels = slab.shape[1]
        grad_BCHW = grad.reshape(grad.shape[0], r1 - r0, w, channels).permute(0, 3, 1, 2)
        grad_slab, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_BCHW,
            slab,
            conv[0].float(),
            None if conv[1] is None else [channels],
            stride=[1, 1],
            padding=[0, 1],
            dilation=[1, 1],
            transposed=False,
            output_padding=[0, 0],
            groups=channels,
            output_mask=[True, True, conv[1] is not None],
        )
        grad_slab = grad_slab.permute(0, 2, 3, 1)[:, lo - (r0 - 1) : hi - (r0 - 1)]
        start = self.image_start
        grad_x[:, start + lo * w : start + hi * w] += grad_slab.reshape(grad.shape[0], -1, *grad.shape[2:])
        grad_conv[0] += grad_weight
        if conv[1] is not None:
            grad_conv[1] += grad_bias

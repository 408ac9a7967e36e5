"""Neighbourhood attention: exact softmax over each image query's k x k window of image keys.

Legend: B batch, M = h * w image tokens (row-major grid), H heads, D head dim, T tile side, L key
region side. Tensors come in the host layout (B, M, H, D).

The window of the query at grid row y starts at row clamp(y - k // 2, 0, h - k), and likewise for
columns, as NATTEN's neighbourhood attention has it: a window never leaves the grid, so every query sees
exactly k x k keys (min(k, h) x min(k, w) on a grid smaller than the kernel). The softmax scale is
softmax attention's, D^-0.5. The paper's DiT code blends this (k = 5) 50/50 with the TTT output
(the paper, arXiv 2605.02772, section 2.8); `T5Attention(neighborhood=5)` does the same on image rows.

Computed tile by tile with one fused attention call per group of tile rows: the queries of a T x T
tile attend to an L x L key region (L = T + 2 (k // 2), clamped inside the grid; it holds every window
of the tile's queries, since the window start is monotone in the query position) under a boolean mask
that keeps each query's own window. That costs L^2 / k^2 (5.8x at T = 8, k = 5) the window's scores,
but as dense, fused attention; the gathered key regions are (L / T)^2 = 2.25x the keys and values of
the tile rows in flight, which `ROWS_PER_SLAB` bounds. On CPU the gathers take about as long as the
attention itself; smaller tiles mean more and smaller calls, larger ones larger key regions, and
T = 8 balances the two.

A slab's key regions are one `index_select` of whole tokens (H x D contiguous values each) in the host
layout, then one copy to heads first: one gather of contiguous blocks, rather than one gather along
each grid axis of a heads-first view.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "NEIGHBORHOOD_BLEND",
    "check_neighborhood",
    "is_neighborhood",
    "neighborhood_attention",
    "window_starts",
]

NEIGHBORHOOD_BLEND = 0.5
"""The neighbourhood share of a blended image output (the paper's DiT code: 0.5 NA + 0.5 TTT)."""
TILE = 8
"""Query tile side T."""
ROWS_PER_SLAB = 32
"""Image rows per fused call: bounds the gathered key regions at 2K (128 x 128 tokens) to 1/4 of the keys."""


def is_neighborhood(window: int) -> bool:
    """Whether `window` is a valid `neighborhood` setting: 0 (no blend) or an odd window side."""
    return window == 0 or (window > 0 and window % 2 == 1)


def check_neighborhood(window: int) -> None:
    """Raise `ValueError` unless `is_neighborhood(window)` (`T5Config` and `T5Attention` call it)."""
    if not is_neighborhood(window):
        raise ValueError(f"neighborhood must be 0 (off) or an odd window side; got {window}.")


def window_starts(size: int, kernel: int, positions: Tensor) -> Tensor:
    """First row (or column) of the window of each query position: clamp(p - k // 2, 0, size - k)."""
    kernel = min(kernel, size)
    return (positions - kernel // 2).clamp(0, size - kernel)


@functools.lru_cache(maxsize=32)
def _region_tokens(grid: tuple[int, int], kernel: int, device: torch.device) -> Tensor:
    """The image token of every key region position, `(tile rows, tile columns x L_h x L_w)`: tile row
    r's regions in tile-column order, each row-major."""
    rows, cols = _plan(grid[0], kernel, device)[0], _plan(grid[1], kernel, device)[0]
    tokens = rows[:, None, :, None] * grid[1] + cols[None, :, None, :]
    return tokens.reshape(rows.shape[0], -1)


@functools.lru_cache(maxsize=32)
def _plan(size: int, kernel: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Along one grid axis: the key region's indices per tile `(tiles, L)` and the mask of each tile
    query's window within its region `(tiles, T, L)`."""
    tiles = -(-size // TILE)
    span = min(TILE + 2 * (kernel // 2), size)
    tile_first = torch.arange(tiles, device=device) * TILE
    region_start = (tile_first - kernel // 2).clamp(0, size - span)
    region = region_start[:, None] + torch.arange(span, device=device)
    # tile queries past the grid's end (padding) take the last window, so no row of the mask is empty
    query = (tile_first[:, None] + torch.arange(TILE, device=device)).clamp(max=size - 1)
    start = window_starts(size, kernel, query)
    keys = region[:, None, :]
    mask = (keys >= start[..., None]) & (keys < start[..., None] + min(kernel, size))
    return region, mask


def neighborhood_attention(q: Tensor, k: Tensor, v: Tensor, grid: tuple[int, int], kernel: int = 5) -> Tensor:
    """Softmax attention of each image query over its `kernel x kernel` window of image keys.

    Args:
        q, k, v (`Tensor`): image tokens `(B, M, H, D)`, M = h * w, row-major.
        grid (`tuple[int, int]`): `(h, w)`.
        kernel (`int`, *optional*, defaults to 5): window side k (odd, >= 1).

    Returns:
        `(B, M, H, D)` in the dtype of `q`. Differentiable.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"the neighbourhood kernel must be odd and positive; got {kernel}.")
    batch, tokens, heads, dim = q.shape
    h, w = grid
    if h * w != tokens:
        raise ValueError(f"grid {grid} holds {h * w} tokens; the call has {tokens} image tokens.")
    rows, row_mask = _plan(h, kernel, q.device)
    cols, col_mask = _plan(w, kernel, q.device)
    pad_h, pad_w = rows.shape[0] * TILE - h, cols.shape[0] * TILE - w
    q_grid = q.transpose(1, 2).reshape(batch, heads, h, w, dim)
    # queries padded up to whole tiles (their outputs are dropped)
    q_grid = F.pad(q_grid, (0, 0, 0, pad_w, 0, pad_h))
    region_tokens = _region_tokens(grid, kernel, q.device)
    tiles_w, span_h, span_w = cols.shape[0], rows.shape[1], cols.shape[1]
    slab_tiles = max(1, ROWS_PER_SLAB // TILE)
    outputs = []
    for first in range(0, rows.shape[0], slab_tiles):
        tile_rows = slice(first, first + slab_tiles)
        count = rows[tile_rows].shape[0]
        q_tiles = (
            q_grid[:, :, first * TILE : (first + count) * TILE]
            .reshape(batch, heads, count, TILE, tiles_w, TILE, dim)
            .permute(0, 1, 2, 4, 3, 5, 6)
            .reshape(batch * heads, count * tiles_w, TILE * TILE, dim)
        )
        k_regions, v_regions = (
            # one gather of whole tokens (H x D each) in the host layout, then heads first
            x.index_select(1, region_tokens[tile_rows].flatten())
            .view(batch, count * tiles_w, span_h * span_w, heads, dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(batch * heads, count * tiles_w, span_h * span_w, dim)
            for x in (k, v)
        )
        # 4-D, so that the CPU's fused kernel takes the mask (a 3-D one sends SDPA to its math path)
        mask = (row_mask[tile_rows][:, None, :, None, :, None] & col_mask[None, :, None, :, None, :]).reshape(
            1, count * tiles_w, TILE * TILE, span_h * span_w
        )
        out = F.scaled_dot_product_attention(q_tiles, k_regions, v_regions, attn_mask=mask)
        outputs.append(
            out.reshape(batch, heads, count, tiles_w, TILE, TILE, dim)
            .permute(0, 1, 2, 4, 3, 5, 6)
            .reshape(batch, heads, count * TILE, tiles_w * TILE, dim)
        )
    out_grid = torch.cat(outputs, dim=2)[:, :, :h, :w]
    return out_grid.reshape(batch, heads, tokens, dim).transpose(1, 2).to(q.dtype)

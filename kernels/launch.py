"""Launch plan shared by the T5 kernels: shapes, token layout, tile size and the split of the token
axis across programs (fixed for a given shape and device, so results are bitwise reproducible).

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, S token splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["Plan", "make_plan"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# Tile sizes. On CUDA they are first guesses until a GPU sweep (kernels/README.md); under the
# interpreter a small tile keeps several tiles and splits in play at test shapes.
_BLOCK_N_CUDA = {"fwd": 64, "bwd": 32}
_BLOCK_N_INTERPRETER = 16
# Programs per SM the token split aims for on CUDA.
_PROGRAMS_PER_SM = 2
# Warps of the reduction kernels on CUDA: 8 spreads their fp32 D x D accumulators over more
# registers once D reaches 64.
_REDUCE_WARPS_WIDE, _WIDE_HEAD_DIM = 8, 64
_SPLITS_INTERPRETER = 2


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class Plan:
    """Everything the launchers need besides the tensors."""

    batch: int
    tokens: int
    heads: int
    head_dim: int
    grid_h: int
    grid_w: int
    text_tokens: int
    text_first: bool
    dot_dtype: tl.dtype
    block_n: int
    splits: int
    tiles_per_split: int
    reduce_warps: int

    @property
    def programs(self) -> int:
        """Independent (sample, head) pairs, the first launch-grid axis of the reductions."""
        return self.batch * self.heads

    @property
    def n_image(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def tiles(self) -> int:
        return triton.cdiv(self.tokens, self.block_n)


def make_plan(q: torch.Tensor, *, grid: tuple[int, int] | None, text_tokens: int, text_first: bool, phase: str) -> Plan:
    """Plan a launch for `q` of shape (B, N, H, D); `phase` is "fwd" or "bwd" (tile size)."""
    batch, tokens, heads, head_dim = q.shape
    grid_h, grid_w = grid if grid is not None else (1, tokens - text_tokens)
    if q.is_cuda:
        block_n = _BLOCK_N_CUDA[phase]
        target = _PROGRAMS_PER_SM * _sm_count(q.device.index if q.device.index is not None else 0)
    else:
        block_n = _BLOCK_N_INTERPRETER
        target = _SPLITS_INTERPRETER * batch * heads
    tiles = triton.cdiv(tokens, block_n)
    splits = max(1, min(tiles, triton.cdiv(target, batch * heads)))
    tiles_per_split = triton.cdiv(tiles, splits)
    return Plan(
        batch=batch,
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        grid_h=grid_h,
        grid_w=grid_w,
        text_tokens=text_tokens,
        text_first=text_first,
        dot_dtype=_TL_DTYPES[q.dtype],
        block_n=block_n,
        splits=triton.cdiv(tiles, tiles_per_split),
        tiles_per_split=tiles_per_split,
        reduce_warps=_REDUCE_WARPS_WIDE if q.is_cuda and head_dim >= _WIDE_HEAD_DIM else 4,
    )

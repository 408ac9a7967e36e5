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

__all__ = ["LAYOUT_ARGS", "Plan", "cuda_settings", "make_plan"]

# Runtime ints of the token layout: never specialised, so a new resolution or text length reuses
# the compiled kernels.
LAYOUT_ARGS = ["n_tokens", "text_tokens", "n_image", "grid_h", "grid_w", "tiles_per_split"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# CUDA launch settings, chosen from ptxas register / spill / shared-memory reports for sm_90 at
# D = 64 (t5kernels/README.md, "Launch settings") and still to be swept on a GPU. Reduction kernels
# loop over a token range with D x D fp32 accumulators: 8 warps spread them over more registers,
# and one pipeline stage keeps the backward's operand buffers within shared memory (3 stages need
# 209 KB there, 1 needs 40 KB). fp32 inputs use 3xTF32 MMAs with larger operands, hence the
# smaller tile. Per-token map kernels use 32-token tiles, where they do not spill.
_REDUCE_BLOCK_N = {"fwd": 64, "bwd": 32}
_REDUCE_BLOCK_N_FP32 = 32
_MAP_BLOCK_N = 32
_REDUCE_WARPS = 8
_REDUCE_STAGES = {"fwd": 2, "bwd": 1}
# Programs per SM the token split aims for on CUDA.
_PROGRAMS_PER_SM = 2
# Under the interpreter, small tiles and two splits keep several tiles and a real combine in play
# at test shapes.
_BLOCK_N_INTERPRETER = 16
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
    map_block_n: int
    num_warps: int
    num_stages: int

    @property
    def programs(self) -> int:
        """Independent (sample, head) pairs, the first launch-grid axis of the reductions."""
        return self.batch * self.heads

    @property
    def n_image(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def map_tiles(self) -> int:
        """Tiles of the per-token map kernels (their first launch-grid axis)."""
        return triton.cdiv(self.tokens, self.map_block_n)

    @property
    def error_scale(self) -> float:
        """scale/N = D^-1/2 / N, the factor the kernels leave out of the inner error."""
        return self.head_dim**-0.5 / self.tokens

    def layout_args(self, *, reduction: bool = True) -> dict[str, int]:
        """The runtime `LAYOUT_ARGS` of a launch by name; map kernels (`reduction=False`) take no
        `tiles_per_split`."""
        names = LAYOUT_ARGS if reduction else LAYOUT_ARGS[:-1]
        values = (self.tokens, self.text_tokens, self.n_image, self.grid_h, self.grid_w, self.tiles_per_split)
        return dict(zip(names, values[: len(names)], strict=True))

    def partials(self, *shape: int, device: torch.device) -> torch.Tensor:
        """Uninitialised fp32 `(S, B*H, *shape)`: one partial per split and (sample, head) pair."""
        return torch.empty(self.splits, self.programs, *shape, device=device, dtype=torch.float32)


def cuda_settings(dtype: torch.dtype, phase: str) -> tuple[int, int, int, int]:
    """CUDA `(block_n, map_block_n, num_warps, num_stages)` for inputs of `dtype` in `phase`."""
    block_n = _REDUCE_BLOCK_N_FP32 if dtype == torch.float32 else _REDUCE_BLOCK_N[phase]
    stages = 1 if dtype == torch.float32 else _REDUCE_STAGES[phase]
    return block_n, _MAP_BLOCK_N, _REDUCE_WARPS, stages


def make_plan(q: torch.Tensor, *, grid: tuple[int, int] | None, text_tokens: int, text_first: bool, phase: str) -> Plan:
    """Plan a launch for `q` of shape (B, N, H, D); `phase` is "fwd" or "bwd"."""
    batch, tokens, heads, head_dim = q.shape
    grid_h, grid_w = grid if grid is not None else (1, tokens - text_tokens)
    if q.is_cuda:
        block_n, map_block_n, warps, stages = cuda_settings(q.dtype, phase)
        target = _PROGRAMS_PER_SM * _sm_count(q.device.index if q.device.index is not None else 0)
    else:
        block_n = map_block_n = _BLOCK_N_INTERPRETER
        warps, stages = 4, 1
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
        map_block_n=map_block_n,
        num_warps=warps,
        num_stages=stages,
    )

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

from t5core.contract import T5Layout

__all__ = ["LAYOUT_ARGS", "LaunchSettings", "Plan", "cuda_settings", "error_sign", "make_plan"]

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


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class LaunchSettings:
    """How the kernels are launched on a GPU. `cuda_settings` gives the defaults;
    `benchmarks/sweep_kernels.py` times others through `t5_attention(..., launch=...)`.

    Attributes:
        block_n: tokens per tile of the reduction kernels (power of two, >= 16 for the MMAs).
        map_block_n: tokens per tile of the per-token map kernels (power of two, >= 16).
        num_warps: warps per program (1, 2, 4, 8 or 16).
        num_stages: software-pipeline stages of the reduction kernels' token loops (>= 1).
        programs_per_sm: the token split aims for this many reduction programs per SM (>= 1).
    """

    block_n: int
    map_block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = _PROGRAMS_PER_SM

    def __post_init__(self) -> None:
        for name in ("block_n", "map_block_n"):
            value = getattr(self, name)
            if not (_is_power_of_two(value) and value >= 16):
                raise ValueError(f"{name} must be a power of two >= 16 (the MMA minimum); got {value}.")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16; got {self.num_warps}.")
        if self.num_stages < 1 or self.programs_per_sm < 1:
            raise ValueError(
                f"num_stages and programs_per_sm must be >= 1; got {self.num_stages}, {self.programs_per_sm}."
            )


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


def error_sign(variant: str) -> float:
    """SIGN of the inner error e = SIGN * scale/N * e_u, with e_u = v (swiglu: e = -scale/N v) or
    f(k) - v (mlp); the kernels accumulate e_u and the launchers apply SIGN * scale/N in fp32."""
    return -1.0 if variant == "swiglu" else 1.0


def cuda_settings(dtype: torch.dtype, phase: str) -> LaunchSettings:
    """The default CUDA launch settings for inputs of `dtype` in `phase` ("fwd" or "bwd")."""
    block_n = _REDUCE_BLOCK_N_FP32 if dtype == torch.float32 else _REDUCE_BLOCK_N[phase]
    stages = 1 if dtype == torch.float32 else _REDUCE_STAGES[phase]
    return LaunchSettings(block_n, _MAP_BLOCK_N, _REDUCE_WARPS, stages)


def make_plan(q: torch.Tensor, layout: T5Layout, *, phase: str, settings: LaunchSettings | None = None) -> Plan:
    """Plan a launch for queries `q` of a checked call `layout`; `phase` is "fwd" or "bwd".

    `settings` replaces the defaults (`cuda_settings` on CUDA; small tiles and two splits per
    (sample, head) pair under the interpreter, where a CPU counts as one SM).
    """
    assert tuple(q.shape) == layout.shape, (tuple(q.shape), layout.shape)
    batch, tokens, heads, head_dim = layout.shape
    grid_h, grid_w = layout.grid if layout.grid is not None else (1, layout.n_image)
    if settings is None and q.is_cuda:
        settings = cuda_settings(q.dtype, phase)
    if settings is not None:
        block_n, map_block_n = settings.block_n, settings.map_block_n
        warps, stages = settings.num_warps, settings.num_stages
        sm_count = _sm_count(q.device.index if q.device.index is not None else 0) if q.is_cuda else 1
        target = settings.programs_per_sm * sm_count
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
        text_tokens=layout.text_tokens,
        text_first=layout.text_first,
        dot_dtype=_TL_DTYPES[q.dtype],
        block_n=block_n,
        splits=triton.cdiv(tiles, tiles_per_split),
        tiles_per_split=tiles_per_split,
        map_block_n=map_block_n,
        num_warps=warps,
        num_stages=stages,
    )

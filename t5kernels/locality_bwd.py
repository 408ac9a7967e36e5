"""Backward of the locality conv (`t5core.ttt.apply_locality`) and of the key instance norm
(`t5core.ttt.key_instance_norm`).

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, S token splits,
P = B*H. Per-split partial sums are `(S, P, 16, D)` fp32 rows: 0-8 the conv taps' gradients,
9 the conv bias gradient, 10 sum(dx), 11 sum(dx * x_hat) (key-norm backward), 12-15 unused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from t5kernels.launch import LAYOUT_ARGS, Plan
from t5kernels.reduce import combine
from t5kernels.tiles import (
    conv_tile,
    image_position,
    load_rows,
    neighbour,
    norm_stats,
    pair_offset,
    partial_ptr,
    tile_tokens,
)

__all__ = ["conv_param_grads", "key_norm_bwd", "locality_bwd"]

_PARTIAL_ROWS = 16
_BIAS_ROW, _SUM_ROW, _SUM_XHAT_ROW = 9, 10, 11


@triton.jit(do_not_specialize=LAYOUT_ARGS)
def locality_bwd_kernel(
    dy_ptr,
    x_ptr,
    stats_ptr,
    taps_ptr,
    dx_ptr,
    part_ptr,
    n_tokens,
    text_tokens,
    n_image,
    grid_h,
    grid_w,
    tiles_per_split,
    eps,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_CONV: tl.constexpr,
    TEXT_FIRST: tl.constexpr,
):
    # dx = dy + DWC^T(dy) on image rows (dy on text rows); x is the conv input (k is normalised
    # on the fly when HAS_NORM), needed for the taps' gradient.
    bh = tl.program_id(0)
    split = tl.program_id(1)
    h, row_offset = pair_offset(bh, n_tokens, H, D)
    x_base = x_ptr + row_offset
    dy_base = dy_ptr + row_offset
    offs_d = tl.arange(0, D)
    rows16 = tl.arange(0, 16)
    mean, rstd = norm_stats(stats_ptr + bh * 2 * D, x_base, n_tokens, eps, offs_d, D, HAS_NORM)
    no_norm = tl.zeros([D], dtype=tl.float32)
    taps = taps_ptr + h * 9 * D
    acc = tl.zeros([16, D], dtype=tl.float32)
    for i in range(tiles_per_split):
        tok, valid = tile_tokens(split * tiles_per_split + i, n_tokens, BLOCK_N)
        is_image, row, col = image_position(tok, n_tokens, text_tokens, n_image, grid_w, TEXT_FIRST)
        dx = conv_tile(
            dy_base,
            H * D,
            tok,
            offs_d,
            valid,
            is_image,
            row,
            col,
            grid_h,
            grid_w,
            no_norm,
            no_norm,
            taps,
            taps,
            D,
            False,
            HAS_CONV,
            True,
        )  # [BLOCK_N, D]
        if HAS_CONV:
            dy_image = load_rows(dy_base, H * D, tok, offs_d, is_image, no_norm, no_norm, False)
            for tap in tl.static_range(9):
                tok_tap, ok = neighbour(tok, is_image, row, col, grid_h, grid_w, tap, False)
                x_tap = load_rows(x_base, H * D, tok_tap, offs_d, ok, mean, rstd, HAS_NORM)
                acc += tl.where(rows16[:, None] == tap, tl.sum(dy_image * x_tap, axis=0)[None, :], 0.0)
            acc += tl.where(rows16[:, None] == 9, tl.sum(dy_image, axis=0)[None, :], 0.0)
        if HAS_NORM:
            x_hat = load_rows(x_base, H * D, tok, offs_d, valid, mean, rstd, True)
            acc += tl.where(rows16[:, None] == 10, tl.sum(dx, axis=0)[None, :], 0.0)
            acc += tl.where(rows16[:, None] == 11, tl.sum(dx * x_hat, axis=0)[None, :], 0.0)
        out = dx_ptr + row_offset + tok[:, None] * (H * D) + offs_d[None, :]
        tl.store(out, dx.to(dx_ptr.dtype.element_ty), mask=valid[:, None])
    part = partial_ptr(part_ptr, split, bh, 16 * D)
    tl.store(part + rows16[:, None] * D + offs_d[None, :], acc)


@triton.jit(do_not_specialize=["n_tokens"])
def key_norm_bwd_kernel(
    g_ptr,
    k_ptr,
    stats_ptr,
    sums_ptr,
    dk_ptr,
    n_tokens,
    eps,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # dk = rstd * (g - mean_N(g) - k_hat * mean_N(g * k_hat)), g = dLoss/dk_hat
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    _, row_offset = pair_offset(bh, n_tokens, H, D)
    offs_d = tl.arange(0, D)
    mean, rstd = norm_stats(stats_ptr + bh * 2 * D, k_ptr + row_offset, n_tokens, eps, offs_d, D, True)
    sums = sums_ptr + bh.to(tl.int64) * 16 * D
    g_mean = tl.load(sums + 10 * D + offs_d) / n_tokens
    gx_mean = tl.load(sums + 11 * D + offs_d) / n_tokens
    tok, valid = tile_tokens(tile, n_tokens, BLOCK_N)
    k_hat = load_rows(k_ptr + row_offset, H * D, tok, offs_d, valid, mean, rstd, True)
    g = load_rows(g_ptr + row_offset, H * D, tok, offs_d, valid, mean, rstd, False)
    dk = rstd[None, :] * (g - g_mean[None, :] - k_hat * gx_mean[None, :])
    out = dk_ptr + row_offset + tok[:, None] * (H * D) + offs_d[None, :]
    tl.store(out, dk.to(dk_ptr.dtype.element_ty), mask=valid[:, None])


def locality_bwd(
    grad: torch.Tensor,
    x: torch.Tensor,
    taps: torch.Tensor | None,
    stats: torch.Tensor | None,
    *,
    plan: Plan,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient through x -> x + DWC(x) (and the sums the key-norm backward needs).

    Args:
        grad (`Tensor`): `(B, N, H, D)` fp32 gradient at the conv output.
        x (`Tensor`): the raw input `(B, N, H, D)` (q, or k before its norm when `stats` is given).
        taps (`Tensor`, *optional*): `(H, 9, D)` conv taps; None means no conv (dx = grad).
        stats (`Tensor`, *optional*): key sums of `key_stats_fwd` when x is normalised on the fly.
        out_dtype (`torch.dtype`): dtype of the returned input gradient.

    Returns:
        The input gradient `(B, N, H, D)` and the partial sums `(S, B*H, 16, D)`.
    """
    partials = plan.partials(_PARTIAL_ROWS, plan.head_dim, device=x.device)
    dx = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    locality_bwd_kernel[(plan.programs, plan.splits)](
        grad,
        x,
        stats if stats is not None else grad,
        taps if taps is not None else grad,
        dx,
        partials,
        **plan.layout_args(),
        eps=eps,
        H=plan.heads,
        D=plan.head_dim,
        BLOCK_N=plan.block_n,
        HAS_NORM=stats is not None,
        HAS_CONV=taps is not None,
        TEXT_FIRST=plan.text_first,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return dx, partials


def conv_param_grads(partials: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv weight `(H*D, 1, 3, 3)` and bias `(H*D,)` gradients from `locality_bwd` partials."""
    flat = (plan.splits * plan.batch, plan.heads, _PARTIAL_ROWS, plan.head_dim)
    summed = combine(partials.view(flat))  # (H, 16, D)
    channels = plan.heads * plan.head_dim
    weight = summed[:, :9].transpose(1, 2).reshape(channels, 1, 3, 3)
    return weight, summed[:, _BIAS_ROW].reshape(channels)


def key_norm_bwd(
    grad_hat: torch.Tensor, k: torch.Tensor, stats: torch.Tensor, partials: torch.Tensor, *, plan: Plan, eps: float
) -> torch.Tensor:
    """Gradient through the key instance norm: `(B, N, H, D)` in k's dtype from dLoss/dk_hat (fp32)."""
    sums = combine(partials)  # (B*H, 16, D)
    dk = torch.empty_like(k)
    key_norm_bwd_kernel[(plan.map_tiles, plan.programs)](
        grad_hat, k, stats, sums, dk, plan.tokens, eps, H=plan.heads, D=plan.head_dim, BLOCK_N=plan.map_block_n
    )
    return dk

"""Backward of the locality conv (`t5core.ttt.apply_locality`) and of the key instance norm
(`t5core.ttt.key_instance_norm`).

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, S token splits,
P = B*H. Per-split partial sums are `(S, P, PARTIAL_ROWS, D)` fp32, rows named below (kernels and
launchers use the names): rows 0 to TAPS - 1 the conv taps' gradients, then the conv bias gradient
and the two sums the key-norm backward needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from t5kernels.launch import LAYOUT_ARGS, Plan
from t5kernels.reduce import combine
from t5kernels.tiles import (
    STAT_ROWS,
    TAPS,
    conv_tile,
    image_position,
    load_rows,
    neighbour,
    norm_stats,
    pair_offset,
    partial_ptr,
    tile_tokens,
)

__all__ = ["BIAS_ROW", "DX_ROW", "DX_XHAT_ROW", "PARTIAL_ROWS", "conv_param_grads", "key_norm_bwd", "locality_bwd"]

# Rows of a locality_bwd partial: rows 0 to TAPS - 1 the taps' gradients sum(dy * x_tap); then
BIAS_ROW: tl.constexpr = TAPS  # sum(dy) over image tokens, the bias gradient
DX_ROW: tl.constexpr = TAPS + 1  # sum(dx), for the key-norm backward
DX_XHAT_ROW: tl.constexpr = TAPS + 2  # sum(dx * x_hat), for the key-norm backward
# rows in all, a power of two for tl.arange (the last four are unused)
PARTIAL_ROWS: tl.constexpr = tl.constexpr(16)


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
    h, row_offset = pair_offset(bh, n_tokens, H=H, D=D)
    x_base = x_ptr + row_offset
    dy_base = dy_ptr + row_offset
    offs_d = tl.arange(0, D)
    rows = tl.arange(0, PARTIAL_ROWS)
    mean, rstd = norm_stats(
        stats_ptr + bh * STAT_ROWS * D, x_base, n_tokens, eps=eps, offs_d=offs_d, D=D, HAS_NORM=HAS_NORM
    )
    no_norm = tl.zeros([D], dtype=tl.float32)
    taps = taps_ptr + h * TAPS * D
    acc = tl.zeros([PARTIAL_ROWS, D], dtype=tl.float32)  # this split's partial
    for i in range(tiles_per_split):
        tok, valid = tile_tokens(split * tiles_per_split + i, n_tokens, BLOCK_N=BLOCK_N)
        is_image, row, col = image_position(
            tok, n_tokens, text_tokens, n_image=n_image, grid_w=grid_w, TEXT_FIRST=TEXT_FIRST
        )
        dx = conv_tile(
            dy_base,
            H * D,
            tok,
            offs_d=offs_d,
            valid=valid,
            is_image=is_image,
            row=row,
            col=col,
            grid_h=grid_h,
            grid_w=grid_w,
            mean=no_norm,
            rstd=no_norm,
            taps_ptr=taps,
            bias_ptr=taps,
            D=D,
            HAS_NORM=False,
            HAS_CONV=HAS_CONV,
            FLIP=True,
        )  # [BLOCK_N, D]
        if HAS_CONV:
            dy_image = load_rows(
                dy_base, H * D, tok, offs_d=offs_d, valid=is_image, mean=no_norm, rstd=no_norm, HAS_NORM=False
            )
            for tap in tl.static_range(TAPS):
                tok_tap, ok = neighbour(
                    tok, is_image=is_image, row=row, col=col, grid_h=grid_h, grid_w=grid_w, tap=tap, FLIP=False
                )
                x_tap = load_rows(
                    x_base, H * D, tok_tap, offs_d=offs_d, valid=ok, mean=mean, rstd=rstd, HAS_NORM=HAS_NORM
                )
                acc += tl.where(rows[:, None] == tap, tl.sum(dy_image * x_tap, axis=0)[None, :], 0.0)
            acc += tl.where(rows[:, None] == BIAS_ROW, tl.sum(dy_image, axis=0)[None, :], 0.0)
        if HAS_NORM:
            x_hat = load_rows(x_base, H * D, tok, offs_d=offs_d, valid=valid, mean=mean, rstd=rstd, HAS_NORM=True)
            acc += tl.where(rows[:, None] == DX_ROW, tl.sum(dx, axis=0)[None, :], 0.0)
            acc += tl.where(rows[:, None] == DX_XHAT_ROW, tl.sum(dx * x_hat, axis=0)[None, :], 0.0)
        out = dx_ptr + row_offset + tok[:, None] * (H * D) + offs_d[None, :]
        tl.store(out, dx.to(dx_ptr.dtype.element_ty), mask=valid[:, None])
    part = partial_ptr(part_ptr, split, bh, SIZE=PARTIAL_ROWS * D)
    tl.store(part + rows[:, None] * D + offs_d[None, :], acc)


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
    _, row_offset = pair_offset(bh, n_tokens, H=H, D=D)
    offs_d = tl.arange(0, D)
    mean, rstd = norm_stats(
        stats_ptr + bh * STAT_ROWS * D, k_ptr + row_offset, n_tokens, eps=eps, offs_d=offs_d, D=D, HAS_NORM=True
    )
    sums = sums_ptr + bh.to(tl.int64) * PARTIAL_ROWS * D
    g_mean = tl.load(sums + DX_ROW * D + offs_d) / n_tokens
    gx_mean = tl.load(sums + DX_XHAT_ROW * D + offs_d) / n_tokens
    tok, valid = tile_tokens(tile, n_tokens, BLOCK_N=BLOCK_N)
    k_hat = load_rows(k_ptr + row_offset, H * D, tok, offs_d=offs_d, valid=valid, mean=mean, rstd=rstd, HAS_NORM=True)
    g = load_rows(g_ptr + row_offset, H * D, tok, offs_d=offs_d, valid=valid, mean=mean, rstd=rstd, HAS_NORM=False)
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
        taps (`Tensor`, *optional*): `(H, TAPS, D)` conv taps; None means no conv (dx = grad).
        stats (`Tensor`, *optional*): key sums of `key_stats_fwd` when x is normalised on the fly.
        out_dtype (`torch.dtype`): dtype of the returned input gradient.

    Returns:
        The input gradient `(B, N, H, D)` and the partial sums `(S, B*H, PARTIAL_ROWS, D)`.
    """
    partials = plan.partials(PARTIAL_ROWS.value, plan.head_dim, device=x.device)
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
    flat = (plan.splits * plan.batch, plan.heads, PARTIAL_ROWS.value, plan.head_dim)
    summed = combine(partials.view(flat))  # (H, PARTIAL_ROWS, D)
    channels = plan.heads * plan.head_dim
    weight = summed[:, : TAPS.value].transpose(1, 2).reshape(channels, 1, 3, 3)
    return weight, summed[:, BIAS_ROW.value].reshape(channels)


def key_norm_bwd(
    grad_hat: torch.Tensor, k: torch.Tensor, stats: torch.Tensor, partials: torch.Tensor, *, plan: Plan, eps: float
) -> torch.Tensor:
    """Gradient through the key instance norm: `(B, N, H, D)` in k's dtype from dLoss/dk_hat (fp32)."""
    sums = combine(partials)  # (B*H, PARTIAL_ROWS, D)
    dk = torch.empty_like(k)
    key_norm_bwd_kernel[(plan.map_tiles, plan.programs)](
        grad_hat, k, stats, sums, dk, plan.tokens, eps, H=plan.heads, D=plan.head_dim, BLOCK_N=plan.map_block_n
    )
    return dk

"""Forward passes of T5 attention: the inner step (`t5core.ttt.inner_step` on keys prepared by
`t5core.ttt.key_instance_norm` and `t5core.ttt.apply_locality`) and the apply pass
(`t5core.ttt.inner_apply` on queries prepared by `apply_locality`).

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, S token splits,
P = B*H, NW fast weights (3 swiglu, 2 mlp). Activations are contiguous (B, N, H, D); fast weights
are fp32 `(H, NW, D, D)` (initial) or `(P, NW, D, D)` (updated); conv taps `(H, 9, D)`, bias `(H, D)`.

The inner-step kernel accumulates gradient sums without the scale/N factor (it would underflow
fp16 operands at 2K); the combine applies it in fp32: W' = W - SIGN * scale/N * sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from t5kernels.launch import LAYOUT_ARGS, Plan, error_sign
from t5kernels.reduce import combine
from t5kernels.tiles import (
    STAT_ROWS,
    TAPS,
    conv_tile,
    image_position,
    load_rows,
    mm,
    norm_stats,
    pair_offset,
    silu_with_grad,
    store_partials,
    tile_tokens,
)

__all__ = ["inner_apply_fwd", "inner_step_fwd"]


@triton.jit(do_not_specialize=LAYOUT_ARGS)
def inner_step_fwd_kernel(
    k_ptr,
    v_ptr,
    w_ptr,
    stats_ptr,
    taps_ptr,
    bias_ptr,
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
    NW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_CONV: tl.constexpr,
    TEXT_FIRST: tl.constexpr,
    DT: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    h, row_offset = pair_offset(bh, n_tokens, H=H, D=D)
    k_base = k_ptr + row_offset
    v_base = v_ptr + row_offset
    offs_d = tl.arange(0, D)
    offs_dd = offs_d[:, None] * D + offs_d[None, :]
    offs_dd_t = offs_d[None, :] * D + offs_d[:, None]
    mean, rstd = norm_stats(
        stats_ptr + bh * STAT_ROWS * D, k_base, n_tokens, eps=eps, offs_d=offs_d, D=D, HAS_NORM=HAS_NORM
    )
    taps = taps_ptr + h * TAPS * D
    bias = bias_ptr + h * D
    w_head = w_ptr + h * NW * D * D
    w1 = tl.load(w_head + offs_dd).to(DT)  # [D, D], kept in registers as MMA operands
    g1 = tl.zeros([D, D], dtype=tl.float32)
    g2 = tl.zeros([D, D], dtype=tl.float32)
    g3 = tl.zeros([D, D], dtype=tl.float32)  # swiglu only
    if SWIGLU:
        w2 = tl.load(w_head + D * D + offs_dd).to(DT)
        w3_t = tl.load(w_head + 2 * D * D + offs_dd_t).to(DT)
    else:
        w2_t = tl.load(w_head + D * D + offs_dd_t).to(DT)
        w2 = tl.load(w_head + D * D + offs_dd).to(DT)
    for i in range(tiles_per_split):
        tok, valid = tile_tokens(split * tiles_per_split + i, n_tokens, BLOCK_N=BLOCK_N)
        is_image, row, col = image_position(
            tok, n_tokens, text_tokens, n_image=n_image, grid_w=grid_w, TEXT_FIRST=TEXT_FIRST
        )
        k2 = conv_tile(
            k_base,
            H * D,
            tok,
            offs_d=offs_d,
            valid=valid,
            is_image=is_image,
            row=row,
            col=col,
            grid_h=grid_h,
            grid_w=grid_w,
            mean=mean,
            rstd=rstd,
            taps_ptr=taps,
            bias_ptr=bias,
            D=D,
            HAS_NORM=HAS_NORM,
            HAS_CONV=HAS_CONV,
            FLIP=False,
        )  # [BLOCK_N, D], 0 on rows past N
        v = load_rows(v_base, H * D, tok, offs_d=offs_d, valid=valid, mean=mean, rstd=rstd, HAS_NORM=False)
        z1 = mm(k2, w1, DT=DT)
        _, a1, silu_grad = silu_with_grad(z1)
        k2_t = tl.trans(k2)
        if SWIGLU:
            z2 = mm(k2, w2, DT=DT)
            da2 = mm(v, w3_t, DT=DT)
            g1 += mm(k2_t, da2 * z2 * silu_grad, DT=DT)
            g2 += mm(k2_t, da2 * a1, DT=DT)
            g3 += mm(tl.trans(a1 * z2), v, DT=DT)
        else:
            e = mm(a1, w2, DT=DT) - v
            g1 += mm(k2_t, mm(e, w2_t, DT=DT) * silu_grad, DT=DT)
            g2 += mm(tl.trans(a1), e, DT=DT)
    store_partials(part_ptr, split, bh, g1=g1, g2=g2, g3=g3, offs_d=offs_d, D=D, NW=NW)


@triton.jit(do_not_specialize=LAYOUT_ARGS[:-1])
def inner_apply_fwd_kernel(
    q_ptr,
    w_ptr,
    taps_ptr,
    bias_ptr,
    out_ptr,
    n_tokens,
    text_tokens,
    n_image,
    grid_h,
    grid_w,
    H: tl.constexpr,
    D: tl.constexpr,
    NW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_CONV: tl.constexpr,
    TEXT_FIRST: tl.constexpr,
    DT: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    h, row_offset = pair_offset(bh, n_tokens, H=H, D=D)
    offs_d = tl.arange(0, D)
    offs_dd = offs_d[:, None] * D + offs_d[None, :]
    tok, valid = tile_tokens(tile, n_tokens, BLOCK_N=BLOCK_N)
    is_image, row, col = image_position(
        tok, n_tokens, text_tokens, n_image=n_image, grid_w=grid_w, TEXT_FIRST=TEXT_FIRST
    )
    no_norm = tl.zeros([D], dtype=tl.float32)
    q2 = conv_tile(
        q_ptr + row_offset,
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
        taps_ptr=taps_ptr + h * TAPS * D,
        bias_ptr=bias_ptr + h * D,
        D=D,
        HAS_NORM=False,
        HAS_CONV=HAS_CONV,
        FLIP=False,
    )  # [BLOCK_N, D]
    w_pair = w_ptr + bh.to(tl.int64) * NW * D * D
    a1 = mm(q2, tl.load(w_pair + offs_dd), DT=DT)
    a1 = a1 * tl.sigmoid(a1)
    if SWIGLU:
        a2 = a1 * mm(q2, tl.load(w_pair + D * D + offs_dd), DT=DT)
        o = mm(a2, tl.load(w_pair + 2 * D * D + offs_dd), DT=DT)
    else:
        o = mm(a1, tl.load(w_pair + D * D + offs_dd), DT=DT)
    out = out_ptr + row_offset + tok[:, None] * (H * D) + offs_d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def inner_step_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    stats: torch.Tensor | None,
    conv: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    plan: Plan,
    variant: str,
    eps: float,
) -> torch.Tensor:
    """Updated fast weights W' `(B*H, NW, D, D)` fp32 from keys and values `(B, N, H, D)`.

    `stats` are the key sums of `key_stats_fwd` (None: no key norm); `conv` the key conv's
    `(taps (H, 9, D), bias (H, D))` (None: no locality).
    """
    n_weights = weights.shape[1]
    partials = plan.partials(n_weights, plan.head_dim, plan.head_dim, device=k.device)
    taps, bias = conv if conv is not None else (weights, weights)
    inner_step_fwd_kernel[(plan.programs, plan.splits)](
        k,
        v,
        weights,
        stats if stats is not None else weights,
        taps,
        bias,
        partials,
        **plan.layout_args(),
        eps=eps,
        H=plan.heads,
        D=plan.head_dim,
        NW=n_weights,
        BLOCK_N=plan.block_n,
        SWIGLU=variant == "swiglu",
        HAS_NORM=stats is not None,
        HAS_CONV=conv is not None,
        TEXT_FIRST=plan.text_first,
        DT=plan.dot_dtype,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    coef = -error_sign(variant) * plan.error_scale
    return combine(partials, coef, base=weights)


def inner_apply_fwd(
    q: torch.Tensor,
    fast: torch.Tensor,
    conv: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    plan: Plan,
    variant: str,
) -> torch.Tensor:
    """f_{W'}(q + DWC(q)) per token: `(B, N, H, D)` in q's dtype, from W' `(B*H, NW, D, D)`."""
    out = torch.empty_like(q)
    taps, bias = conv if conv is not None else (fast, fast)
    inner_apply_fwd_kernel[(plan.map_tiles, plan.programs)](
        q,
        fast,
        taps,
        bias,
        out,
        **plan.layout_args(reduction=False),
        H=plan.heads,
        D=plan.head_dim,
        NW=fast.shape[1],
        BLOCK_N=plan.map_block_n,
        SWIGLU=variant == "swiglu",
        HAS_CONV=conv is not None,
        TEXT_FIRST=plan.text_first,
        DT=plan.dot_dtype,
        num_warps=plan.num_warps,
    )
    return out

"""Backward passes of the inner model: through `t5core.ttt.inner_apply` (queries and W') and
through `t5core.ttt.inner_step` (keys, values and the initial W). The derivation is in
t5kernels/README.md ("Backward").

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, S token splits,
P = B*H, NW fast weights. U = dLoss/dW' `(P, NW, D, D)`. The inner-step backward is the
gradient of phi = <U, dL_inner/dW> (a Hessian-vector product of the inner loss, computed as the
reverse pass of its forward-mode tangent along U), without the SIGN * scale/N factor, which the
launcher applies in fp32.
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
    load_dd,
    load_rows,
    mm,
    norm_stats,
    pair_offset,
    silu_with_grad,
    store_partials,
    tile_tokens,
)

__all__ = ["inner_apply_bwd", "inner_step_bwd"]


@triton.jit(do_not_specialize=LAYOUT_ARGS)
def inner_apply_bwd_kernel(
    q_ptr,
    w_ptr,
    taps_ptr,
    bias_ptr,
    do_ptr,
    dq2_ptr,
    part_ptr,
    n_tokens,
    text_tokens,
    n_image,
    grid_h,
    grid_w,
    tiles_per_split,
    H: tl.constexpr,
    D: tl.constexpr,
    NW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_CONV: tl.constexpr,
    TEXT_FIRST: tl.constexpr,
    DT: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    h, row_offset = pair_offset(bh, n_tokens, H=H, D=D)
    offs_d = tl.arange(0, D)
    no_norm = tl.zeros([D], dtype=tl.float32)
    w_pair = w_ptr + bh.to(tl.int64) * NW * D * D
    g1 = tl.zeros([D, D], dtype=tl.float32)
    g2 = tl.zeros([D, D], dtype=tl.float32)
    g3 = tl.zeros([D, D], dtype=tl.float32)  # swiglu only
    for i in range(tiles_per_split):
        tok, valid = tile_tokens(split * tiles_per_split + i, n_tokens, BLOCK_N=BLOCK_N)
        is_image, row, col = image_position(
            tok, n_tokens, text_tokens, n_image=n_image, grid_w=grid_w, TEXT_FIRST=TEXT_FIRST
        )
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
        do = load_rows(
            do_ptr + row_offset, H * D, tok, offs_d=offs_d, valid=valid, mean=no_norm, rstd=no_norm, HAS_NORM=False
        )
        q2_t = tl.trans(q2)
        z1 = mm(q2, load_dd(w_pair, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
        _, a1, silu_grad = silu_with_grad(z1)
        if SWIGLU:
            z2 = mm(q2, load_dd(w_pair + D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
            da2 = mm(do, load_dd(w_pair + 2 * D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            g3 += mm(tl.trans(a1 * z2), do, DT=DT)
            dz1 = da2 * z2 * silu_grad
            dz2 = da2 * a1
            g1 += mm(q2_t, dz1, DT=DT)
            g2 += mm(q2_t, dz2, DT=DT)
            dq2 = mm(dz1, load_dd(w_pair, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            dq2 += mm(dz2, load_dd(w_pair + D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
        else:
            dz1 = mm(do, load_dd(w_pair + D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT) * silu_grad
            g2 += mm(tl.trans(a1), do, DT=DT)
            g1 += mm(q2_t, dz1, DT=DT)
            dq2 = mm(dz1, load_dd(w_pair, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
        tl.store(dq2_ptr + row_offset + tok[:, None] * (H * D) + offs_d[None, :], dq2, mask=valid[:, None])
    store_partials(part_ptr, split, bh, g1=g1, g2=g2, g3=g3, offs_d=offs_d, D=D, NW=NW)


@triton.jit(do_not_specialize=LAYOUT_ARGS)
def inner_step_bwd_kernel(
    k_ptr,
    v_ptr,
    w_ptr,
    u_ptr,
    stats_ptr,
    taps_ptr,
    bias_ptr,
    dk2_ptr,
    dv_ptr,
    part_ptr,
    n_tokens,
    text_tokens,
    n_image,
    grid_h,
    grid_w,
    tiles_per_split,
    eps,
    dk_scale,
    dv_scale,
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
    offs_d = tl.arange(0, D)
    mean, rstd = norm_stats(
        stats_ptr + bh * STAT_ROWS * D, k_base, n_tokens, eps=eps, offs_d=offs_d, D=D, HAS_NORM=HAS_NORM
    )
    w_head = w_ptr + h * NW * D * D
    u_pair = u_ptr + bh.to(tl.int64) * NW * D * D
    g1 = tl.zeros([D, D], dtype=tl.float32)
    g2 = tl.zeros([D, D], dtype=tl.float32)
    g3 = tl.zeros([D, D], dtype=tl.float32)  # swiglu only
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
            taps_ptr=taps_ptr + h * TAPS * D,
            bias_ptr=bias_ptr + h * D,
            D=D,
            HAS_NORM=HAS_NORM,
            HAS_CONV=HAS_CONV,
            FLIP=False,
        )  # [BLOCK_N, D]
        v = load_rows(v_ptr + row_offset, H * D, tok, offs_d=offs_d, valid=valid, mean=mean, rstd=rstd, HAS_NORM=False)
        k2_t = tl.trans(k2)
        z1 = mm(k2, load_dd(w_head, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
        sig, a1, silu_grad = silu_with_grad(z1)
        silu_grad2 = sig * (1.0 - sig) * (2.0 + z1 * (1.0 - 2.0 * sig))
        # tangent of the inner forward along U (dots: derivative along U)
        z1_dot = mm(k2, load_dd(u_pair, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
        a1_dot = silu_grad * z1_dot
        if SWIGLU:
            z2 = mm(k2, load_dd(w_head + D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
            z2_dot = mm(k2, load_dd(u_pair + D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
            a2_dot = a1_dot * z2 + a1 * z2_dot
            y_dot = mm(a2_dot, load_dd(w_head + 2 * D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
            y_dot += mm(a1 * z2, load_dd(u_pair + 2 * D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
            # reverse pass of phi_u = v . y_dot
            d_a2_dot = mm(v, load_dd(w_head + 2 * D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            d_a2 = mm(v, load_dd(u_pair + 2 * D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            g3 += mm(tl.trans(a2_dot), v, DT=DT)
            d_a1_dot = d_a2_dot * z2
            dz2 = d_a2_dot * a1_dot + d_a2 * a1
            d_a1 = d_a2_dot * z2_dot + d_a2 * z2
            dz1 = d_a1_dot * z1_dot * silu_grad2 + d_a1 * silu_grad
            dk = mm(d_a1_dot * silu_grad, load_dd(u_pair, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            dk += mm(d_a2_dot * a1, load_dd(u_pair + D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            dk += mm(dz1, load_dd(w_head, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            dk += mm(dz2, load_dd(w_head + D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            g2 += mm(k2_t, dz2, DT=DT)
        else:
            e = mm(a1, load_dd(w_head + D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT) - v
            y_dot = mm(a1_dot, load_dd(w_head + D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
            y_dot += mm(a1, load_dd(u_pair + D * D, offs_d, D=D, TRANSPOSE=False, DT=DT), DT=DT)
            # reverse pass of phi_u = (f(k) - v) . y_dot
            d_a1_dot = mm(e, load_dd(w_head + D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            g2 += mm(tl.trans(a1_dot), e, DT=DT) + mm(tl.trans(a1), y_dot, DT=DT)
            d_a1 = mm(e, load_dd(u_pair + D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            d_a1 += mm(y_dot, load_dd(w_head + D * D, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            dz1 = d_a1_dot * z1_dot * silu_grad2 + d_a1 * silu_grad
            dk = mm(d_a1_dot * silu_grad, load_dd(u_pair, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
            dk += mm(dz1, load_dd(w_head, offs_d, D=D, TRANSPOSE=True, DT=DT), DT=DT)
        g1 += mm(k2_t, dz1, DT=DT)
        rows = row_offset + tok[:, None] * (H * D) + offs_d[None, :]
        tl.store(dk2_ptr + rows, dk * dk_scale, mask=valid[:, None])
        tl.store(dv_ptr + rows, (y_dot * dv_scale).to(dv_ptr.dtype.element_ty), mask=valid[:, None])
    store_partials(part_ptr, split, bh, g1=g1, g2=g2, g3=g3, offs_d=offs_d, D=D, NW=NW)


def inner_apply_bwd(
    q: torch.Tensor,
    fast: torch.Tensor,
    conv: tuple[torch.Tensor, torch.Tensor] | None,
    grad_out: torch.Tensor,
    *,
    plan: Plan,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of the apply pass.

    Returns:
        `dq2` `(B, N, H, D)` fp32, the gradient at the conv output q + DWC(q), and U = dLoss/dW'
        `(B*H, NW, D, D)` fp32.
    """
    n_weights = fast.shape[1]
    partials = plan.partials(n_weights, plan.head_dim, plan.head_dim, device=q.device)
    dq2 = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    taps, bias = conv if conv is not None else (fast, fast)
    inner_apply_bwd_kernel[(plan.programs, plan.splits)](
        q,
        fast,
        taps,
        bias,
        grad_out,
        dq2,
        partials,
        **plan.layout_args(),
        H=plan.heads,
        D=plan.head_dim,
        NW=n_weights,
        BLOCK_N=plan.block_n,
        SWIGLU=variant == "swiglu",
        HAS_CONV=conv is not None,
        TEXT_FIRST=plan.text_first,
        DT=plan.dot_dtype,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return dq2, combine(partials)


def inner_step_bwd(
    k: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor,
    stats: torch.Tensor | None,
    conv: tuple[torch.Tensor, torch.Tensor] | None,
    grad_fast: torch.Tensor,
    *,
    plan: Plan,
    variant: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the inner step, given U = dLoss/dW' `(B*H, NW, D, D)`.

    Returns:
        `dk2` `(B, N, H, D)` fp32 (gradient at the key conv output), `dv` in v's dtype, and the
        gradient of the initial fast weights `(H, NW, D, D)` fp32 (summed over the batch).
    """
    n_weights = weights.shape[1]
    partials = plan.partials(n_weights, plan.head_dim, plan.head_dim, device=k.device)
    dk2 = torch.empty(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.empty_like(v)
    taps, bias = conv if conv is not None else (weights, weights)
    sign, scale = error_sign(variant), plan.error_scale
    inner_step_bwd_kernel[(plan.programs, plan.splits)](
        k,
        v,
        weights,
        grad_fast,
        stats if stats is not None else weights,
        taps,
        bias,
        dk2,
        dv,
        partials,
        **plan.layout_args(),
        eps=eps,
        dk_scale=-sign * scale,
        dv_scale=scale,
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
    per_head = (plan.batch, plan.heads, *grad_fast.shape[1:])
    grad_weights = combine(grad_fast.view(per_head))
    flat = (plan.splits * plan.batch, plan.heads, *grad_fast.shape[1:])
    return dk2, dv, combine(partials.view(flat), -sign * scale, base=grad_weights)

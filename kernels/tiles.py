"""Triton building blocks shared by the T5 kernels: token coordinates, key-norm statistics, tile loads
with the fused key norm and 3x3 depthwise locality conv (`t5core.ttt.key_instance_norm` and
`t5core.ttt.apply_locality`), and the matmul used for every contraction.

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens. A tile is BLOCK_N
consecutive tokens of one (sample, head) pair: `[BLOCK_N, D]`, fp32 in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["conv_tile", "image_position", "load_rows", "mm", "norm_stats"]


@triton.jit
def mm(a, b, DT: tl.constexpr):
    # fp32 inputs keep about fp32 precision through three TF32 products (tensor cores; plain fp32
    # "ieee" dots spill and overflow shared memory at D = 64); fp16 / bf16 inputs use their own
    # dtype as MMA operands. Accumulation is always fp32.
    if DT == tl.float32:
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def image_position(tok, n_tokens, text_tokens, n_image, grid_w, TEXT_FIRST: tl.constexpr):
    # tok: [BLOCK_N] int64 token indices -> (is_image, row, col) of each token on the h x w grid
    if TEXT_FIRST:
        img = tok - text_tokens
    else:
        img = tok
    is_image = (img >= 0) & (img < n_image) & (tok < n_tokens)
    img = tl.where(is_image, img, 0)
    return is_image, img // grid_w, img % grid_w


@triton.jit
def norm_stats(stats_ptr, k_base, n_tokens, eps, offs_d, D: tl.constexpr, HAS_NORM: tl.constexpr):
    # stats_ptr: [2, D] sums of (k - k_0) and (k - k_0)^2 over all N tokens, k_0 the first token
    if HAS_NORM:
        k0 = tl.load(k_base + offs_d).to(tl.float32)
        shifted_mean = tl.load(stats_ptr + offs_d) / n_tokens
        var = tl.load(stats_ptr + D + offs_d) / n_tokens - shifted_mean * shifted_mean
        mean = k0 + shifted_mean
        rstd = 1.0 / tl.sqrt(tl.maximum(var, 0.0) + eps)
    else:
        mean = tl.zeros([D], dtype=tl.float32)
        rstd = tl.full([D], 1.0, dtype=tl.float32)
    return mean, rstd


@triton.jit
def load_rows(base, stride_n, tok, offs_d, valid, mean, rstd, HAS_NORM: tl.constexpr):
    # [BLOCK_N, D] fp32 rows `tok` of one (sample, head); rows not `valid` are 0 (after the norm)
    x = tl.load(base + tok[:, None] * stride_n + offs_d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        x = tl.where(valid[:, None], (x - mean[None, :]) * rstd[None, :], 0.0)
    return x


@triton.jit
def conv_tile(
    base,
    stride_n,
    tok,
    offs_d,
    valid,
    is_image,
    row,
    col,
    grid_h,
    grid_w,
    mean,
    rstd,
    taps_ptr,
    bias_ptr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_CONV: tl.constexpr,
    FLIP: tl.constexpr,
):
    # x + DWC(x) on image rows, x on text rows: [BLOCK_N, D]. taps_ptr: [9, D] of this head,
    # tap = 3 * (dy + 1) + (dx + 1). FLIP applies the transposed conv (taps mirrored, no bias), which
    # is the conv's backward with respect to its input.
    x = load_rows(base, stride_n, tok, offs_d, valid, mean, rstd, HAS_NORM)
    if HAS_CONV:
        acc = tl.zeros_like(x)
        for tap in tl.static_range(9):
            dy = tap // 3 - 1
            dx = tap % 3 - 1
            if FLIP:
                dy = -dy
                dx = -dx
            ok = is_image & (row + dy >= 0) & (row + dy < grid_h) & (col + dx >= 0) & (col + dx < grid_w)
            neighbour = load_rows(base, stride_n, tok + dy * grid_w + dx, offs_d, ok, mean, rstd, HAS_NORM)
            acc += neighbour * tl.load(taps_ptr + tap * D + offs_d)[None, :]
        if not FLIP:
            acc += tl.load(bias_ptr + offs_d)[None, :]
        x = x + tl.where(is_image[:, None], acc, 0.0)
    return x

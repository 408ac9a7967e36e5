"""Triton building blocks shared by the T5 kernels: token coordinates, key-norm statistics, tile loads
with the fused key norm and 3x3 depthwise locality conv (`t5core.ttt.key_instance_norm` and
`t5core.ttt.apply_locality`), silu with its derivative, per-split partial stores, and the matmul used
for every contraction. Kernels call these and Triton inlines them.

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens. A tile is BLOCK_N
consecutive tokens of one (sample, head) pair: `[BLOCK_N, D]`, fp32 in registers.

Helpers take at most three positional arguments; the rest, and every `tl.constexpr`, go by
keyword. The shared layout constants are `tl.constexpr` globals, read by kernels and launchers
alike: `TAPS` per 3x3 conv kernel (taps `[TAPS, D]` per head) and `STAT_ROWS` of the key
statistics (`[STAT_ROWS, D]` per pair: sum of k - k_0, sum of its square); host code reads their
`.value`.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "STAT_ROWS",
    "TAPS",
    "conv_tile",
    "image_position",
    "load_dd",
    "load_rows",
    "mm",
    "neighbour",
    "norm_stats",
    "pair_offset",
    "partial_ptr",
    "silu_with_grad",
    "store_partials",
    "tile_tokens",
]

# 3x3 depthwise conv: tap = 3 * (dy + 1) + (dx + 1) for offsets dy, dx in {-1, 0, 1}
TAPS: tl.constexpr = tl.constexpr(9)
# key statistics per (sample, head) pair: row 0 sums k - k_0, row 1 sums (k - k_0)^2
STAT_ROWS: tl.constexpr = tl.constexpr(2)


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
def silu_with_grad(z):
    # (sigmoid(z), silu(z), silu'(z)) elementwise; silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z)))
    sig = tl.sigmoid(z)
    return sig, z * sig, sig * (1.0 + z * (1.0 - sig))


@triton.jit
def load_dd(ptr, offs_d, D: tl.constexpr, TRANSPOSE: tl.constexpr, DT: tl.constexpr):
    # [D, D] matrix at ptr (or its transpose, a view of the same tile) as an MMA operand
    w = tl.load(ptr + offs_d[:, None] * D + offs_d[None, :]).to(DT)
    if TRANSPOSE:
        w = tl.trans(w)
    return w


@triton.jit
def pair_offset(bh, n_tokens, H: tl.constexpr, D: tl.constexpr):
    # (sample, head) pair bh -> (head, int64 offset of its token 0 in a contiguous (B, N, H, D))
    h = bh % H
    return h, (bh // H).to(tl.int64) * n_tokens * H * D + h * D


@triton.jit
def tile_tokens(tile, n_tokens, BLOCK_N: tl.constexpr):
    # [BLOCK_N] int64 token indices of tile `tile`, and which of them are < N
    tok = tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tok, tok < n_tokens


@triton.jit
def partial_ptr(part_ptr, split, bh, SIZE: tl.constexpr):
    # start of the (split, pair) partial in a (S, P, ...) buffer of SIZE elements per partial;
    # the reductions' launch grid is (P, S)
    return part_ptr + (split.to(tl.int64) * tl.num_programs(0) + bh) * SIZE


@triton.jit
def store_partials(part_ptr, split, bh, g1, g2, g3, offs_d, D: tl.constexpr, NW: tl.constexpr):
    # this program's [NW, D, D] fp32 partial of a (S, P, NW, D, D) buffer; g3 only when NW == 3
    out = partial_ptr(part_ptr, split, bh, SIZE=NW * D * D)
    offs_dd = offs_d[:, None] * D + offs_d[None, :]
    tl.store(out + offs_dd, g1)
    tl.store(out + D * D + offs_dd, g2)
    if NW == 3:
        tl.store(out + 2 * D * D + offs_dd, g3)


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
    # stats_ptr: this pair's [STAT_ROWS, D] sums over all N tokens, k_0 the first token
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
def neighbour(tok, is_image, row, col, grid_h, grid_w, tap: tl.constexpr, FLIP: tl.constexpr):
    # token at 3x3 offset `tap` = 3 * (dy + 1) + (dx + 1) (mirrored if FLIP) of each token, and
    # whether it lies on the grid (image tokens only; zero padding)
    dy = tap // 3 - 1
    dx = tap % 3 - 1
    if FLIP:
        dy = -dy
        dx = -dx
    ok = is_image & (row + dy >= 0) & (row + dy < grid_h) & (col + dx >= 0) & (col + dx < grid_w)
    return tok + dy * grid_w + dx, ok


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
    # x + DWC(x) on image rows, x on text rows: [BLOCK_N, D]. taps_ptr: [TAPS, D] of this head.
    # FLIP applies the transposed conv (taps mirrored, no bias), which is the conv's backward with
    # respect to its input.
    x = load_rows(base, stride_n, tok, offs_d=offs_d, valid=valid, mean=mean, rstd=rstd, HAS_NORM=HAS_NORM)
    if HAS_CONV:
        acc = tl.zeros_like(x)
        for tap in tl.static_range(TAPS):
            tok_tap, ok = neighbour(
                tok, is_image=is_image, row=row, col=col, grid_h=grid_h, grid_w=grid_w, tap=tap, FLIP=FLIP
            )
            x_tap = load_rows(base, stride_n, tok_tap, offs_d=offs_d, valid=ok, mean=mean, rstd=rstd, HAS_NORM=HAS_NORM)
            acc += x_tap * tl.load(taps_ptr + tap * D + offs_d)[None, :]
        if not FLIP:
            acc += tl.load(bias_ptr + offs_d)[None, :]
        x = x + tl.where(is_image[:, None], acc, 0.0)
    return x

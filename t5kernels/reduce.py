"""Token reductions that need no inner model: the key statistics of `t5core.ttt.key_instance_norm`
and the fixed-order combine of per-split partial sums used by every reduction pass.

Legend: B batch, N tokens, H heads, D head dim, S token splits, P = B*H (sample, head) pairs.
Inputs are contiguous (B, N, H, D). No float atomics: each split writes its own partial and the
combine adds them in split order, so the same inputs give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from t5kernels.launch import Plan
from t5kernels.tiles import STAT_ROWS, pair_offset, partial_ptr, tile_tokens

__all__ = ["combine", "key_stats_fwd"]

_COMBINE_BLOCK = 1024


@triton.jit(do_not_specialize=["n_tokens", "tiles_per_split"])
def key_stats_fwd_kernel(
    k_ptr,
    part_ptr,
    n_tokens,
    tiles_per_split,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    _, row_offset = pair_offset(bh, n_tokens, H=H, D=D)
    k_base = k_ptr + row_offset
    offs_d = tl.arange(0, D)
    # shifting by the first token keeps E[x^2] - E[x]^2 well conditioned when |mean| >> std
    k0 = tl.load(k_base + offs_d).to(tl.float32)
    s1 = tl.zeros([D], dtype=tl.float32)
    s2 = tl.zeros([D], dtype=tl.float32)
    for i in range(tiles_per_split):
        tok, valid = tile_tokens(split * tiles_per_split + i, n_tokens, BLOCK_N=BLOCK_N)
        x = tl.load(k_base + tok[:, None] * (H * D) + offs_d[None, :], mask=valid[:, None], other=0.0)
        x = tl.where(valid[:, None], x.to(tl.float32) - k0[None, :], 0.0)  # [BLOCK_N, D]
        s1 += tl.sum(x, axis=0)
        s2 += tl.sum(x * x, axis=0)
    out = partial_ptr(part_ptr, split, bh, SIZE=STAT_ROWS * D)
    tl.store(out + offs_d, s1)  # row 0
    tl.store(out + D + offs_d, s2)  # row 1


@triton.jit
def combine_kernel(
    part_ptr, base_ptr, out_ptr, n_reduce, M, base_rows, coef, HAS_BASE: tl.constexpr, BLOCK: tl.constexpr
):
    # out[p] = base[p % base_rows] + coef * sum_r part[r, p], summed in order r = 0, 1, ...
    p = tl.program_id(0).to(tl.int64)
    n_rows = tl.num_programs(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(n_reduce):
        acc += tl.load(part_ptr + (r * n_rows + p) * M + offs, mask=mask, other=0.0)
    acc = acc * coef
    if HAS_BASE:
        acc += tl.load(base_ptr + (p % base_rows) * M + offs, mask=mask, other=0.0)
    tl.store(out_ptr + p * M + offs, acc, mask=mask)


def combine(partials: torch.Tensor, coef: float = 1.0, base: torch.Tensor | None = None) -> torch.Tensor:
    """Sum fp32 partials over their first axis in a fixed order: `base + coef * partials.sum(0)`.

    Args:
        partials (`Tensor`): `(R, P, ...)` fp32, contiguous.
        coef (`float`, *optional*, defaults to 1.0): multiplies the sum.
        base (`Tensor`, *optional*): `(P', ...)` fp32 added row `p % P'` to row `p` (broadcast of
            per-head weights over the batch when `P = B*P'`).

    Returns:
        `(P, ...)` fp32.
    """
    n_reduce, rows = partials.shape[:2]
    out = torch.empty(partials.shape[1:], device=partials.device, dtype=torch.float32)
    size = out[0].numel()
    combine_kernel[(rows, triton.cdiv(size, _COMBINE_BLOCK))](
        partials,
        base if base is not None else partials,
        out,
        n_reduce,
        size,
        base.shape[0] if base is not None else 1,
        coef,
        HAS_BASE=base is not None,
        BLOCK=_COMBINE_BLOCK,
    )
    return out


def key_stats_fwd(k: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Per-(sample, head, channel) sums of (k - k_0) and (k - k_0)^2 over all tokens: `(B*H, STAT_ROWS, D)`."""
    partials = plan.partials(STAT_ROWS.value, plan.head_dim, device=k.device)
    key_stats_fwd_kernel[(plan.programs, plan.splits)](
        k,
        partials,
        plan.tokens,
        plan.tiles_per_split,
        H=plan.heads,
        D=plan.head_dim,
        BLOCK_N=plan.block_n,
    )
    return combine(partials)

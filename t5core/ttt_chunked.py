"""T5 attention on the torch path with bounded memory: `t5core.ttt.t5_attention_ref`, computed in
chunks of tokens, forward and backward.

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, n tokens of one
chunk. Public functions take and return the host layout (B, N, H, D); `_BHND` marks head-major.

The reference writes about nine (B, H, N, D) fp32 tensors per call. Here each pass walks the tokens
chunk by chunk (`t5core.token_chunks`: bands of image rows with one halo row above and below for the
3x3 convs, runs of text tokens) and carries only per-(B, H) state from one chunk to the next.

Forward, with scale = D^-0.5 and c = scale / N:

1. key statistics: each chunk's mean and biased variance, merged exactly (Chan's pairwise update);
2. inner step: each chunk adds its share of dL/dW (`t5core.ttt.inner_grads`, with c = scale / N of
   the whole call) to fp32 (B, H, D, D) sums; W' = W - sums;
3. apply: each chunk's queries (+ conv) give o = f_W'(q), written into the output.

Hybrid calls when sampling (`chunked_hybrid_attention`, the math in `t5core.hybrid`): the forward
above over the image tokens, where step 1 keeps each chunk's full (D, D) centred key products (the
image log-partition's covariance; the key norm's variance is their diagonal) and step 3 merges each
chunk's output with its exact attention over the text before writing it.

Backward (`_ChunkedT5Function` saves the inputs, parameters, key statistics and W', and recomputes
per chunk). With U = dLoss/dW':

1. apply: each chunk adds its share of U and scatters dLoss/dq through the conv's transpose (which
   reaches the halo rows) into an fp32 (B, N, H, D) buffer;
2. inner step: W' = W - G(k, v, W) with G = dL/dW, so dLoss/dW = U - d<U, G>/dW and the key and value
   gradients are -d<U, G>/dk and -d<U, G>/dv, per token. The derivation is written once, in
   t5kernels/README.md (Backward): <U, G> is a Hessian-vector product of the inner loss, reversed
   per token without autograd. `_inner_step_backward` runs that reverse pass for phi = -<U, G>
   (so its results need no sign flip) with the error scale inside e, as `t5core.ttt.inner_grads`
   has it: swiglu da2 = e W3^T, dp1 = -k U1, dp2 = -k U2, dA = -e U3^T; mlp e2 = e W2^T, dp1 = -k U1.
   The gradient of the normalised keys is scattered through the k conv's transpose into a second
   fp32 buffer;
3. key norm: two sums over tokens, then dk = rstd (dkn - mean_N dkn - kn mean_N(dkn kn)) in place.

Memory above inputs and output: about ten (B, H, n, D) fp32 chunk temporaries in forward, a few
dozen in backward, plus there the two fp32 gradient buffers (dq and dk themselves for fp32 inputs).

Chunk size (`DEFAULT_CHUNK_TOKENS`): every chunk runs some 50 ops, each a multi-threaded region on a
CPU and a kernel launch on a GPU, so small chunks pay that fixed cost more often, most of all when
other processes hold the cores; large chunks hold larger temporaries. 2048 is where larger chunks
stop saving time, with peak memory well under two inputs at N = 16384 (benchmarks/README.md,
"T5Attention vs SDPA", the chunk sizes).

Fixed cost. At small N a call's cost is its aten ops (about 60 per chunk): bmm with (D, D) weights
and elementwise passes, not Python. Sampling (no input requires grad) calls `_forward` directly,
without the autograd node; on a CPU it runs heads in groups of `HEAD_GROUP_BYTES` (every step is per
head) so the elementwise passes stay in cache. One chunk's key statistics skip the merge, and a
whole-image band takes the conv's own padding (no slab copy). A sequence that fits one chunk is one
chunk with its text (`t5core.token_chunks`): a separate text chunk would repeat the whole chain of ops
for a few tokens. T5's matmuls are 18 N D^2 flops per head against SDPA's 4 N^2 D, so below
N = 4.5 D (288 tokens at D = 64) T5 does more matmul work than softmax attention.

Under torch.compile the sampling path is one chunk of all heads (`_plan`, `_forward_by_heads`). Chunks
and head groups are Python loops, which dynamo unrolls, and each writes its slice of the output in place,
which inductor turns into one gather kernel over every slice: a compiled call slower than the eager one,
and a graph that grows with N (docs/comfyui.md, "With other nodes"). One chunk holds whole-sequence
temporaries instead (about as many as the reference path), which inductor fuses where it can.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from t5core.contract import Conv, T5Layout, T5Params, check_call
from t5core.hybrid import TextPart, text_rows
from t5core.token_chunks import Chunk, Prepare, TokenChunks
from t5core.ttt import inner_apply, inner_grads, silu_and_grad_, split_image

__all__ = [
    "DEFAULT_CHUNK_TOKENS", "chunked_attention", "chunked_hybrid_attention", "records_autograd", "t5_attention_chunked",
]  # fmt: skip

DEFAULT_CHUNK_TOKENS = 2048
HEAD_GROUP_BYTES = 4 << 20
"""Without autograd on a CPU, heads run in groups whose (B, heads, n, D) fp32 chunk tensors fit this
(module docstring, Fixed cost): the forward's ~50 elementwise passes then stay in the last-level cache."""


def _silu_grads_(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """silu(z) (written over z), silu'(z) and silu''(z) = sigmoid (1 - sigmoid) (2 + z (1 - 2 sigmoid))."""
    s = torch.sigmoid(z)
    dds = s * (1 - s) * (2 + z * (1 - 2 * s))
    return *silu_and_grad_(z, s), dds


def _heads_first(x: Tensor) -> Tensor:
    """`(B, n, H, D)` -> contiguous fp32 `(B, H, n, D)`."""
    return x.float().transpose(1, 2).contiguous()


def _to_float(x: Tensor) -> Tensor:
    return x.float()


def _accumulate(totals: list[Tensor], shares: tuple[Tensor, ...]) -> None:
    for total, share in zip(totals, shares, strict=True):
        total += share


def _key_moments(k: Tensor, chunks: list[Chunk], *, full: bool) -> tuple[Tensor, Tensor]:
    """Per sample and channel mean `(B, 1, H, D)` over all tokens, and the summed squared deviations:
    per channel `(B, 1, H, D)`, or with `full` the summed centred outer products per head `(B, H, D, D)`
    (whose diagonal they are).

    Each chunk's mean and deviations (two passes over the chunk) are merged with Chan's pairwise
    update, which keeps the (co)variance exact where a sum of squares would cancel. The first chunk's
    moments start the merge (no zero-filled accumulators), so a single chunk is these two passes alone
    (`torch.var_mean` over dim 1 of this layout is much slower on a CPU).
    """
    mean = m2 = None
    count = 0
    for chunk in chunks:
        x = k[:, chunk.tokens].float()
        n_c = chunk.stop - chunk.start
        mean_c = x.sum(1, keepdim=True) / n_c
        if full:
            centred = (x - mean_c).transpose(1, 2)
            m2_c = centred.transpose(-1, -2) @ centred
        else:
            m2_c = (x - mean_c).square_().sum(1, keepdim=True)
        if mean is None:
            mean, m2 = mean_c, m2_c
        else:
            delta = mean_c - mean
            if full:
                delta_BH1D = delta.transpose(1, 2)
                spread = delta_BH1D.transpose(-1, -2) @ delta_BH1D
            else:
                spread = delta.square()
            m2 += m2_c + spread * (count * n_c / (count + n_c))
            mean += delta * (n_c / (count + n_c))
        count += n_c
    return mean, m2


def _norm_stats(mean: Tensor, m2: Tensor, count: int, eps: float, *, full: bool) -> tuple[Tensor, Tensor]:
    """The key norm's mean and 1 / sqrt(biased variance + eps), `(B, 1, H, D)`, from `_key_moments` (with
    `full`, the variances are the diagonal of its outer products)."""
    if full:
        m2 = m2.diagonal(dim1=-2, dim2=-1).unsqueeze(1)
    return mean, torch.rsqrt(m2 / count + eps)


def _key_prepare(stats: tuple[Tensor, Tensor] | None) -> Prepare:
    """The key norm as a function of a token run (a cast to fp32 without it)."""
    if stats is None:
        return _to_float
    mean, rstd = stats
    return lambda x: (x.float() - mean).mul_(rstd)


def _apply_backward(q: Tensor, grad: Tensor, fast: tuple[Tensor, ...], variant: str) -> tuple[Tensor, tuple]:
    """Backward of o = f_W'(q) for one chunk: (dq, this chunk's share of dLoss/dW'), `(B, H, n, D)`."""
    q_t = q.transpose(-1, -2)
    if variant == "swiglu":
        w1, w2, w3 = fast
        u1, u2 = q @ w1, q @ w2
        b1, db1 = silu_and_grad_(u1, torch.sigmoid(u1))
        dp = grad @ w3.transpose(-1, -2)
        du1, du2 = dp * u2 * db1, dp * b1
        dq = du1 @ w1.transpose(-1, -2) + du2 @ w2.transpose(-1, -2)
        return dq, (q_t @ du1, q_t @ du2, (b1 * u2).transpose(-1, -2) @ grad)
    w1, w2 = fast
    u1 = q @ w1
    b1, db1 = silu_and_grad_(u1, torch.sigmoid(u1))
    du1 = (grad @ w2.transpose(-1, -2)) * db1
    return du1 @ w1.transpose(-1, -2), (q_t @ du1, b1.transpose(-1, -2) @ grad)


def _inner_step_backward(
    k: Tensor, v: Tensor, weights: tuple[Tensor, ...], u: tuple[Tensor, ...], variant: str, c: float
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """Gradients of phi = -<U, dL/dW> for one chunk (module docstring): dk, dv `(B, H, n, D)` and the
    chunk's share of d phi / dW `(B, H, D, D)`."""
    k_t = k.transpose(-1, -2)
    if variant == "swiglu":
        (w1, w2, w3), (u1, u2, u3) = weights, u
        e = v * -c
        z1, z2 = k @ w1, k @ w2
        a1, ds, dds = _silu_grads_(z1)
        da2 = e @ w3.transpose(-1, -2)
        p1, p2 = da2 * z2 * ds, da2 * a1
        dp1, dp2, d_a = -(k @ u1), -(k @ u2), -(e @ u3.transpose(-1, -2))
        d_da2 = dp1 * z2 * ds + dp2 * a1
        dz1 = dp1 * da2 * z2 * dds + (dp2 * da2 + d_a * z2) * ds
        dz2 = dp1 * da2 * ds + d_a * a1
        dk = dz1 @ w1.transpose(-1, -2) + dz2 @ w2.transpose(-1, -2)
        dk = dk - p1 @ u1.transpose(-1, -2) - p2 @ u2.transpose(-1, -2)
        de = d_da2 @ w3 - (a1 * z2) @ u3
        return dk, de * -c, (k_t @ dz1, k_t @ dz2, d_da2.transpose(-1, -2) @ e)
    (w1, w2), (u1, u2) = weights, u
    z1 = k @ w1
    a1, ds, dds = _silu_grads_(z1)
    e = (a1 @ w2 - v) * c
    e2 = e @ w2.transpose(-1, -2)
    dp1 = -(k @ u1)
    d_e2 = dp1 * ds
    dy = (d_e2 @ w2 - a1 @ u2) * c
    dz1 = dp1 * e2 * dds + (dy @ w2.transpose(-1, -2) - e @ u2.transpose(-1, -2)) * ds
    dk = dz1 @ w1.transpose(-1, -2) - (e2 * ds) @ u1.transpose(-1, -2)
    return dk, -dy, (k_t @ dz1, d_e2.transpose(-1, -2) @ e + a1.transpose(-1, -2) @ dy)


def _key_norm_backward_(grad: Tensor, k: Tensor, chunks: list[Chunk], stats: tuple[Tensor, Tensor]) -> None:
    """Turn `grad` `(B, N, H, D)` fp32, the gradient of the normalised keys, into that of the keys, in place."""
    mean, rstd = stats
    sum_grad, sum_grad_kn = torch.zeros_like(mean), torch.zeros_like(mean)
    for chunk in chunks:
        g, kn = grad[:, chunk.tokens], (k[:, chunk.tokens].float() - mean) * rstd
        sum_grad += g.sum(1, keepdim=True)
        sum_grad_kn += (g * kn).sum(1, keepdim=True)
    n = k.shape[1]
    for chunk in chunks:
        g, kn = grad[:, chunk.tokens], (k[:, chunk.tokens].float() - mean) * rstd
        g.sub_(sum_grad / n + kn * (sum_grad_kn / n)).mul_(rstd)


def _conv(weight: Tensor | None, bias: Tensor | None) -> Conv | None:
    return None if weight is None else (weight, bias)


def _zero_grads(conv: Conv | None) -> list[Tensor]:
    if conv is None:
        return []
    return [torch.zeros_like(p, dtype=torch.float32) if p is not None else None for p in conv]


def _forward(
    layout: T5Layout,
    plan: TokenChunks,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: T5Params,
    *,
    out: Tensor | None = None,
    text: TextPart | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor] | None, tuple[Tensor, ...]]:
    """Output (written into `out` when given), key statistics (None without the key norm) and W'
    (`params.weights` in fp32). With `text`, `q, k, v` are a hybrid call's image tokens and each
    chunk's T5 output is merged with exact attention over the text as it is computed (`t5core.hybrid`)."""
    weights, q_conv, k_conv = params
    moments, full = None, text is not None
    if layout.key_norm_eps is not None or full:
        moments = _key_moments(k, plan.chunks, full=full)
    eps, count = layout.key_norm_eps, layout.tokens
    stats = None if eps is None else _norm_stats(*moments, count, eps, full=full)
    merge = None if text is None else text.merger(moments[0].transpose(1, 2), moments[1], count)
    keys = _key_prepare(stats)
    c = layout.head_dim**-0.5 / layout.tokens
    sums = None
    for chunk in plan.chunks:
        k_BHND = plan.local(k, chunk, k_conv, keys)
        shares = inner_grads(k_BHND, _heads_first(v[:, chunk.tokens]), weights, layout.variant, c=c)
        # the first chunk's shares start the sums (no zero-filled buffers to add them into)
        if sums is None:
            sums = list(shares)
        else:
            _accumulate(sums, shares)
    fast = tuple(w - g for w, g in zip(weights, sums, strict=True))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for chunk in plan.chunks:
        o_BHND = inner_apply(plan.local(q, chunk, q_conv, _to_float), fast, layout.variant)
        if merge is not None:
            o_BHND = merge(q[:, chunk.tokens].float().transpose(1, 2), o_BHND)
        out[:, chunk.tokens] = o_BHND.transpose(1, 2)
    return out, stats, fast


def _backward(
    layout: T5Layout,
    plan: TokenChunks,
    grad_out: Tensor,
    saved: tuple[Tensor, Tensor, Tensor, T5Params],
    stats: tuple[Tensor, Tensor] | None,
    fast: tuple[Tensor, ...],
) -> tuple[Tensor, Tensor, Tensor, list, list, list[Tensor]]:
    """dq, dk (fp32), dv, the conv gradients and the fast-weight gradients (fp32), chunk by chunk, from
    the saved `(q, k, v, params)` (`params.weights` in fp32)."""
    q, k, v, (weights, q_conv, k_conv) = saved
    keys = _key_prepare(stats)
    c = layout.head_dim**-0.5 / layout.tokens

    dq, dq_conv = torch.zeros(q.shape, dtype=torch.float32, device=q.device), _zero_grads(q_conv)
    u = [torch.zeros_like(w) for w in fast]
    for chunk in plan.chunks:
        q_BHND = plan.local(q, chunk, q_conv, _to_float)
        dq_BHND, shares = _apply_backward(q_BHND, _heads_first(grad_out[:, chunk.tokens]), fast, layout.variant)
        _accumulate(u, shares)
        plan.local_backward(dq_BHND.transpose(1, 2), q, chunk, q_conv, _to_float, grad_x=dq, grad_conv=dq_conv)

    dk, dk_conv = torch.zeros(k.shape, dtype=torch.float32, device=k.device), _zero_grads(k_conv)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dweights = [share.clone() for share in u]
    for chunk in plan.chunks:
        k_BHND = plan.local(k, chunk, k_conv, keys)
        dk_BHND, dv_BHND, shares = _inner_step_backward(
            k_BHND, _heads_first(v[:, chunk.tokens]), weights, tuple(u), layout.variant, c
        )
        dv[:, chunk.tokens] = dv_BHND.transpose(1, 2)
        _accumulate(dweights, shares)
        plan.local_backward(dk_BHND.transpose(1, 2), k, chunk, k_conv, keys, grad_x=dk, grad_conv=dk_conv)
    if stats is not None:
        _key_norm_backward_(dk, k, plan.chunks, stats)
    return dq, dk, dv, dq_conv, dk_conv, [g.sum(0) for g in dweights]


def _cast(grads: list[Tensor | None], conv: Conv | None) -> tuple[Tensor | None, Tensor | None]:
    """Conv weight and bias gradients in the parameters' dtypes (None, None without the conv)."""
    if conv is None:
        return None, None
    return tuple(None if p is None else g.to(p.dtype) for g, p in zip(grads, conv, strict=True))


def _head_slice(conv: Conv | None, heads: slice, head_dim: int) -> Conv | None:
    if conv is None:
        return None
    channels = slice(heads.start * head_dim, heads.stop * head_dim)
    return tuple(None if p is None else p[channels] for p in conv)


def _forward_by_heads(
    layout: T5Layout,
    plan: TokenChunks,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: T5Params,
    *,
    out: Tensor | None = None,
    text: TextPart | None = None,
) -> Tensor:
    """`_forward`'s output with nothing to differentiate (sampling), in groups of heads whose chunk
    temporaries fit `HEAD_GROUP_BYTES`, with no autograd node and no saved tensors.

    Every step is per sample and head (the key statistics per channel, the convs depthwise, the inner
    model per head, the text merge per head), so a group of heads is the same math on fewer heads.
    """
    n_max = max(chunk.stop - chunk.start for chunk in plan.chunks)
    per_head = layout.batch * n_max * layout.head_dim * 4
    # on a GPU one launch per op over all heads is better, and under torch.compile one chunk of all heads
    # (module docstring); the groups are for a CPU's caches in eager mode
    grouped = q.device.type == "cpu" and not torch.compiler.is_compiling()
    group = max(1, min(layout.heads, HEAD_GROUP_BYTES // per_head)) if grouped else layout.heads
    weights = tuple(w.float() for w in params.weights)
    if group == layout.heads:
        params = T5Params(weights, params.q_conv, params.k_conv)
        return _forward(layout, plan, q, k, v, params, out=out, text=text)[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for h0 in range(0, layout.heads, group):
        heads = slice(h0, min(h0 + group, layout.heads))
        part = T5Params(
            tuple(w[heads] for w in weights),
            _head_slice(params.q_conv, heads, layout.head_dim),
            _head_slice(params.k_conv, heads, layout.head_dim),
        )
        part_layout = dataclasses.replace(layout, heads=heads.stop - heads.start)
        _forward(
            part_layout,
            plan,
            q[:, :, heads],
            k[:, :, heads],
            v[:, :, heads],
            part,
            out=out[:, :, heads],
            text=None if text is None else text.heads(heads),
        )
    return out


class _ChunkedT5Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, plan, q, k, v, q_conv_weight, q_conv_bias, k_conv_weight, k_conv_bias, *weights):
        params = T5Params(
            tuple(w.float() for w in weights), _conv(q_conv_weight, q_conv_bias), _conv(k_conv_weight, k_conv_bias)
        )
        out, stats, fast = _forward(layout, plan, q, k, v, params)
        ctx.layout, ctx.plan = layout, plan
        convs = (q_conv_weight, q_conv_bias, k_conv_weight, k_conv_bias)
        ctx.save_for_backward(q, k, v, *convs, *(stats or (None, None)), *weights, *fast)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, q_conv_weight, q_conv_bias, k_conv_weight, k_conv_bias, mean, rstd, *rest = ctx.saved_tensors
        weights, fast = rest[: len(rest) // 2], tuple(rest[len(rest) // 2 :])
        q_conv, k_conv = _conv(q_conv_weight, q_conv_bias), _conv(k_conv_weight, k_conv_bias)
        stats = None if mean is None else (mean, rstd)
        params = T5Params(tuple(w.float() for w in weights), q_conv, k_conv)
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv, dq_conv, dk_conv, dweights = _backward(
                ctx.layout, ctx.plan, grad_out, (q, k, v, params), stats, fast
            )
        return (
            None,
            None,
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv,
            *_cast(dq_conv, q_conv),
            *_cast(dk_conv, k_conv),
            *(g.to(w.dtype) for g, w in zip(dweights, weights, strict=True)),
        )


def records_autograd(*tensors: Tensor | None) -> bool:
    """Whether a call on `tensors` must record autograd (grad mode on and any of them requiring grad);
    without it the chunked forward runs alone, with no autograd node and no saved tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _plan(layout: T5Layout, tokens: int, chunk_tokens: int, *, text: bool, sampling: bool) -> TokenChunks:
    """The chunks of a call over `tokens` tokens (with `text`, the layout's text tokens among them), of
    `chunk_tokens` each; with nothing to differentiate (`sampling`) under torch.compile, one chunk (module
    docstring)."""
    return TokenChunks(
        tokens,
        tokens if sampling and torch.compiler.is_compiling() else chunk_tokens,
        grid=layout.grid if layout.locality else None,
        text_tokens=layout.text_tokens if text else 0,
        text_first=layout.text_first,
    )


def _check_chunk_tokens(chunk_tokens: int) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int; got {chunk_tokens!r}. Use e.g. {DEFAULT_CHUNK_TOKENS}.")


def chunked_attention(
    q: Tensor, k: Tensor, v: Tensor, params: T5Params, layout: T5Layout, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> Tensor:
    """`t5_attention_chunked` on a call `t5core.contract.check_call` has already checked (what
    `t5core.backend` runs for the torch backend).

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)` as checked.
        params (`T5Params`): the fast weights and the locality convs.
        layout (`T5Layout`): grid, text layout, variant and key-norm eps of the call.
        chunk_tokens (`int`, *optional*, defaults to `DEFAULT_CHUNK_TOKENS`): tokens per chunk; with
            locality a chunk is `max(1, chunk_tokens // w)` whole image rows. With nothing to differentiate
            under torch.compile the call is one chunk (module docstring).

    Returns:
        `(B, N, H, D)` in the dtype of `q`.

    Raises:
        ValueError: `chunk_tokens` is not a positive int.
    """
    _check_chunk_tokens(chunk_tokens)
    convs = (*(params.q_conv or (None, None)), *(params.k_conv or (None, None)))
    with torch.autocast(device_type=q.device.type, enabled=False):
        sampling = not records_autograd(q, k, v, *convs, *params.weights)
        plan = _plan(layout, layout.tokens, chunk_tokens, text=True, sampling=sampling)
        if sampling:
            return _forward_by_heads(layout, plan, q, k, v, params)
        return _ChunkedT5Function.apply(layout, plan, q, k, v, *convs, *params.weights)


def t5_attention_chunked(
    q: Tensor, k: Tensor, v: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, **arguments
) -> Tensor:
    """T5 attention on the torch path in chunks of tokens: `t5core.ttt.t5_attention_ref`'s output and
    gradients, with memory bounded by the chunk size instead of N.

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)` in any float dtype.
        chunk_tokens (`int`, *optional*, defaults to `DEFAULT_CHUNK_TOKENS`): tokens per chunk; with
            locality a chunk is `max(1, chunk_tokens // w)` whole image rows.
        **arguments: the rest of the call contract, checked by `t5core.contract.check_call`:
            `weights` (required), `variant`, `q_conv`, `k_conv`, `grid`, `text_tokens`, `text_first`,
            `key_norm_eps`.

    Returns:
        `(B, N, H, D)` in the dtype of `q`.

    Raises:
        ValueError, TypeError: as `check_call` raises them for a call that breaks the contract, or
            `chunk_tokens` is not a positive int.
    """
    return chunked_attention(q, k, v, *check_call(q, k, v, **arguments), chunk_tokens=chunk_tokens)


def chunked_hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: T5Params,
    layout: T5Layout,
    *,
    merge_bias: Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Hybrid joint attention (`t5core.hybrid.hybrid_attention` with the torch path for its image part)
    in one pass over the image tokens, with nothing to differentiate (sampling).

    The text queries attend over every key in one softmax call, with the keys as they are. The image
    keys' mean and covariance come from the key norm's own pass, and each chunk of image queries is
    merged with its exact attention over the text while its T5 output is in hand: no image-sized
    copy, score matrix or second pass over the image tokens.

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)`, a call `t5core.contract.check_call` has checked, with text.
        params, layout: the call as `check_call` returned it (`layout.text_tokens` > 0).
        merge_bias (`Tensor`, *optional*): `(H,)` learned correction of the image log-partition.
        chunk_tokens (`int`, *optional*, defaults to `DEFAULT_CHUNK_TOKENS`): as for `chunked_attention`.

    Returns:
        `(B, N, H, D)` in the dtype of `q`.

    Raises:
        ValueError: `chunk_tokens` is not a positive int.
    """
    _check_chunk_tokens(chunk_tokens)
    text, first = layout.text_tokens, layout.text_first
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    (q_img, q_txt), (k_img, k_txt), (v_img, v_txt) = (split_image(x, text, first) for x in (q, k, v))
    out_img, out_txt = split_image(out, text, first)
    image_layout = dataclasses.replace(layout, tokens=layout.n_image, text_tokens=0)
    plan = _plan(layout, layout.n_image, chunk_tokens, text=False, sampling=True)
    with torch.autocast(device_type=q.device.type, enabled=False):
        out_txt.copy_(text_rows(q_txt, k, v).transpose(1, 2))
        _forward_by_heads(
            image_layout, plan, q_img, k_img, v_img, params, out=out_img, text=TextPart(k_txt, v_txt, merge_bias)
        )
    return out

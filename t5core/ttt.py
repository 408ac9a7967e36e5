"""The T5 attention math (docs/method.md, "Per converted attention module"), written once, as the reference.

Legend: B batch, N tokens (image h x w row-major, plus T text tokens first or last), H heads,
D head dim, h x w latent grid, T text tokens. Public functions take and return the host layout
(B, N, H, D); internal tensors in head-major layout carry the suffix ``_BHND``.

Per sample and head, with scale = D^-0.5 and lr = 1:

1. key instance norm  k <- (k - mean_N k) / sqrt(var_N k + eps)          (biased variance)
2. locality           q <- q + DWC_q(q),  k <- k + DWC_k(k)              (image tokens only)
3. one inner step     W' = W - dL/dW, closed form:

   swiglu  f(x) = (silu(x W1) * (x W2)) W3,  L = -(scale/N) sum_i v_i . f(k_i)
           e = -(scale/N) v,  z1 = k W1, z2 = k W2, a1 = silu(z1), a2 = a1 * z2, da2 = e W3^T
           g1 = k^T (da2 * z2 * silu'(z1)),  g2 = k^T (da2 * a1),  g3 = a2^T e
   mlp     f(x) = silu(x W1) W2,  L = (scale / 2N) sum_i |f(k_i) - v_i|^2
           e = (f(k) - v) scale/N,  g1 = k^T ((e W2^T) * silu'(z1)),  g2 = a1^T e

   with silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z))).
4. output             o_i = f_{W'}(q_i)

Statistics, fast-weight gradients and W' are fp32 whatever the input dtype; the output is cast
back to the input dtype. Nothing here writes into its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from t5core.contract import T5Layout, T5Params, Variant, check_call, check_variant

__all__ = [
    "apply_locality",
    "inner_apply",
    "inner_grads",
    "inner_loss",
    "inner_step",
    "join_image",
    "key_instance_norm",
    "reference_attention",
    "silu_and_grad_",
    "split_image",
    "t5_attention_ref",
]


def key_instance_norm(k: Tensor, eps: float = 1.0) -> Tensor:
    """Normalise keys per sample and channel over all tokens (biased variance, no affine).

    Args:
        k (`Tensor`): keys `(B, N, H, D)`.
        eps (`float`, *optional*, defaults to 1.0): added to the variance inside the square root.

    Returns:
        `(B, N, H, D)` fp32 normalised keys.
    """
    k32 = k.float()
    var, mean = torch.var_mean(k32, dim=1, keepdim=True, correction=0)
    return (k32 - mean) * torch.rsqrt(var + eps)


def split_image(x: Tensor, text_tokens: int, text_first: bool) -> tuple[Tensor, Tensor]:
    """`(image, text)` token parts of a `(B, N, ...)` sequence with text first or last."""
    n_img = x.shape[1] - text_tokens
    if text_first:
        return x[:, text_tokens:], x[:, :text_tokens]
    return x[:, :n_img], x[:, n_img:]


def join_image(image: Tensor, text: Tensor, text_first: bool) -> Tensor:
    """The sequence `(B, N, ...)` of its image and text parts, text first or last (`split_image`'s inverse)."""
    return torch.cat([text, image], dim=1) if text_first else torch.cat([image, text], dim=1)


def apply_locality(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    grid: tuple[int, int],
    text_tokens: int = 0,
    text_first: bool = True,
) -> Tensor:
    """Residual 3x3 depthwise conv on the image tokens: x + DWC(x); text tokens pass through.

    Args:
        x (`Tensor`): `(B, N, H, D)`; the image tokens are a row-major `h x w` grid.
        weight (`Tensor`): `(H*D, 1, 3, 3)` depthwise kernel, channel `c = head * D + d`.
        bias (`Tensor`, *optional*): `(H*D,)`.
        grid (`tuple[int, int]`): `(h, w)` with `h * w = N - text_tokens`.
        text_tokens (`int`, *optional*, defaults to 0): text tokens in the sequence.
        text_first (`bool`, *optional*, defaults to True): text before (ComfyUI) or after
            (diffusers) the image tokens.

    Returns:
        `(B, N, H, D)` fp32.
    """
    b, _, heads, dim = x.shape
    h, w = grid
    x32 = x.float()
    image, text = split_image(x32, text_tokens, text_first)
    image_BCHW = image.reshape(b, h, w, heads * dim).permute(0, 3, 1, 2)
    bias32 = None if bias is None else bias.float()
    conv = F.conv2d(image_BCHW, weight.float(), bias32, padding=1, groups=heads * dim)
    image = image + conv.permute(0, 2, 3, 1).reshape(b, h * w, heads, dim)
    return join_image(image, text, text_first)


def silu_and_grad_(z: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """silu(z), written over `z`, and silu'(z), from `s` = sigmoid(z): s (1 + z (1 - s)), computed as
    silu + s (1 - silu). `s` is left as it is: autograd keeps it for the sigmoid's backward."""
    a = z.mul_(s)
    return a, (1 - a).mul_(s).add_(a)


def _fast_forward(x_BHND: Tensor, weights: tuple[Tensor, ...], variant: str) -> Tensor:
    if variant == "swiglu":
        w1, w2, w3 = weights
        return (F.silu(x_BHND @ w1) * (x_BHND @ w2)) @ w3
    w1, w2 = weights
    return F.silu(x_BHND @ w1) @ w2


def inner_loss(k_BHND: Tensor, v_BHND: Tensor, weights: tuple[Tensor, ...], variant: Variant) -> Tensor:
    """The inner self-supervised loss summed over batch and heads (the definition the closed form
    differentiates; used by tests to check `inner_step` against autograd).

    Args:
        k_BHND, v_BHND (`Tensor`): normalised keys and values `(B, H, N, D)`.
        weights (`tuple[Tensor, ...]`): `(W1, W2, W3)` for swiglu, `(W1, W2)` for mlp, each
            `(H, D, D)` or `(B, H, D, D)`.
        variant (`"swiglu" | "mlp"`): the inner model.
    """
    n, dim = k_BHND.shape[-2:]
    scale = dim**-0.5
    y = _fast_forward(k_BHND, weights, variant)
    if variant == "swiglu":
        return -(scale / n) * (v_BHND * y).sum()
    return (scale / (2 * n)) * ((y - v_BHND) ** 2).sum()


def inner_grads(
    k_BHND: Tensor, v_BHND: Tensor, weights: tuple[Tensor, ...], variant: Variant, *, c: float
) -> tuple[Tensor, ...]:
    """dL/dW of the inner loss in closed form (module docstring, step 3), summed over the given tokens.

    `inner_step` calls it on all tokens; `t5core.ttt_chunked` calls it per chunk of tokens and adds
    the shares, so both run these same operations. The error scale c multiplies the `(D, D)`
    factors, not the `(N, D)` ones (fewer products per token). Intermediates that autograd does not keep
    are overwritten in place (chunk memory); the inputs never are.

    Args:
        k_BHND, v_BHND (`Tensor`): fp32 normalised keys and values `(B, H, n, D)`: all N tokens, or a chunk.
        weights (`tuple[Tensor, ...]`): fast weights, each `(H, D, D)`, fp32.
        variant (`"swiglu" | "mlp"`): the inner model.
        c (`float`): scale / N, with N the tokens of the whole call (not of a chunk).

    Returns:
        The gradients, each `(B, H, D, D)`.
    """
    k_t = k_BHND.transpose(-1, -2)
    z1 = k_BHND @ weights[0]
    a1, ds = silu_and_grad_(z1, torch.sigmoid(z1))
    if variant == "swiglu":
        _, w2, w3 = weights
        z2 = k_BHND @ w2
        g3 = ((a1 * z2).transpose(-1, -2) @ v_BHND) * -c
        # da2 = e W3^T with e = -c v
        da2 = v_BHND @ (w3.transpose(-1, -2) * -c)
        g2 = k_t @ (da2 * a1)
        return k_t @ (da2 * z2).mul_(ds), g2, g3
    w2 = weights[1]
    # e = c (f(k) - v), the factor c moved onto W2^T and onto g2
    error = (a1 @ w2).sub_(v_BHND)
    return k_t @ (error @ (w2.transpose(-1, -2) * c)).mul_(ds), (a1.transpose(-1, -2) @ error) * c


def inner_step(k_BHND: Tensor, v_BHND: Tensor, weights: tuple[Tensor, ...], variant: Variant) -> tuple[Tensor, ...]:
    """One closed-form gradient step of the inner model over all tokens (lr = 1).

    Args:
        k_BHND, v_BHND (`Tensor`): fp32 normalised keys and values `(B, H, N, D)`.
        weights (`tuple[Tensor, ...]`): initial fast weights, each `(H, D, D)`, fp32.
        variant (`"swiglu" | "mlp"`): the inner model.

    Returns:
        The updated fast weights W' = W - dL/dW, each `(B, H, D, D)`.
    """
    check_variant(variant)
    n, dim = k_BHND.shape[-2:]
    grads = inner_grads(k_BHND, v_BHND, weights, variant, c=dim**-0.5 / n)
    return tuple(w - g for w, g in zip(weights, grads, strict=True))


def inner_apply(q_BHND: Tensor, weights: tuple[Tensor, ...], variant: Variant) -> Tensor:
    """Apply the (updated) inner model to the queries: `(B, H, N, D)` -> `(B, H, N, D)`."""
    return _fast_forward(q_BHND, weights, variant)


def t5_attention_ref(q: Tensor, k: Tensor, v: Tensor, **arguments) -> Tensor:
    """T5 attention, reference path: key norm, locality, one inner step, apply to queries.

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)` in any float dtype.
        **arguments: the rest of the call contract, checked by `t5core.contract.check_call`:
            `weights` (required), `variant`, `q_conv`, `k_conv`, `grid`, `text_tokens`, `text_first`,
            `key_norm_eps`.

    Returns:
        `(B, N, H, D)` in the dtype of `q`.

    Raises:
        ValueError, TypeError: as `check_call` raises them for a call that breaks the contract.
    """
    return reference_attention(q, k, v, *check_call(q, k, v, **arguments))


def reference_attention(q: Tensor, k: Tensor, v: Tensor, params: T5Params, layout: T5Layout) -> Tensor:
    """`t5_attention_ref` on a call `check_call` has already checked (what `t5core.backend` runs).

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)` as checked.
        params (`T5Params`): the fast weights and the locality convs.
        layout (`T5Layout`): grid, text layout, variant and key-norm eps of the call.

    Returns:
        `(B, N, H, D)` in the dtype of `q`.
    """
    token_layout = dict(grid=layout.grid, text_tokens=layout.text_tokens, text_first=layout.text_first)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q32, v32 = q.float(), v.float()
        k32 = k.float() if layout.key_norm_eps is None else key_instance_norm(k, layout.key_norm_eps)
        if layout.locality:
            q32 = apply_locality(q32, *params.q_conv, **token_layout)
            k32 = apply_locality(k32, *params.k_conv, **token_layout)
        weights = tuple(w.float() for w in params.weights)
        fast = inner_step(k32.transpose(1, 2), v32.transpose(1, 2), weights, layout.variant)
        out_BHND = inner_apply(q32.transpose(1, 2), fast, layout.variant)
    return out_BHND.transpose(1, 2).to(q.dtype)

"""The call contract of T5 attention: the inner-model variants and their fast weights, and one call's
layout, checked once here and handed typed to every backend (`t5core.ttt`, `t5kernels`).

Legend: B batch, N tokens (image h x w row-major, plus T text tokens first or last), H heads,
D head dim, h x w latent grid, T text tokens.

`check_call` is the one signature of every T5 attention entry point: `t5core.ttt.t5_attention_ref`
and `t5kernels.t5_attention` take its keyword arguments and pass them here; `T5Attention` calls it
and hands the result to `t5core.backend.attend`. Backends trust a `T5Layout` (cheap asserts only).
This module imports only torch, so `t5kernels` may import it (docs/api.md, "What imports what").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from torch import Tensor

__all__ = [
    "FAST_WEIGHTS",
    "VARIANTS",
    "Conv",
    "T5Layout",
    "T5Params",
    "Variant",
    "check_call",
    "check_variant",
    "fast_weight_names",
]

Variant = Literal["swiglu", "mlp"]
# variant -> number of fast weights: (W1, W2, W3) for swiglu, (W1, W2) for mlp
FAST_WEIGHTS: dict[str, int] = {"swiglu": 3, "mlp": 2}
VARIANTS: tuple[str, ...] = tuple(FAST_WEIGHTS)

# a locality conv: weight (H*D, 1, 3, 3) and bias (H*D,) or None
Conv = tuple[Tensor, Tensor | None]


def check_variant(variant: str) -> None:
    """Raise `ValueError` unless `variant` is one of `VARIANTS`."""
    if variant not in FAST_WEIGHTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}.")


def fast_weight_names(variant: str) -> tuple[str, ...]:
    """The fast weights' parameter names: `("w1", "w2", "w3")` (swiglu) or `("w1", "w2")` (mlp)."""
    check_variant(variant)
    return tuple(f"w{index}" for index in range(1, FAST_WEIGHTS[variant] + 1))


@dataclass(frozen=True)  # no __slots__: torch.compile's guards hold it by weak reference
class T5Layout:
    """Everything about one checked call except its tensors: shapes, token layout and options.

    Parameters:
        batch, tokens, heads, head_dim (`int`): B, N, H, D of q, k and v.
        grid (`tuple[int, int]`, *optional*): the image grid `(h, w)`, h * w = N - T; None only
            without locality.
        text_tokens (`int`): T.
        text_first (`bool`): text before (ComfyUI) or after (diffusers) the image tokens.
        variant (`"swiglu" | "mlp"`): the inner model.
        key_norm_eps (`float`, *optional*): key instance-norm eps; None: no key norm.
        locality (`bool`): whether the call has the two locality convs.
    """

    batch: int
    tokens: int
    heads: int
    head_dim: int
    grid: tuple[int, int] | None
    text_tokens: int
    text_first: bool
    variant: Variant
    key_norm_eps: float | None
    locality: bool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, N, H, D) of q, k, v and the output."""
        return self.batch, self.tokens, self.heads, self.head_dim

    @property
    def n_image(self) -> int:
        return self.tokens - self.text_tokens

    @property
    def n_weights(self) -> int:
        return FAST_WEIGHTS[self.variant]


class T5Params(NamedTuple):
    """The tensors of one call besides q, k, v (as `check_call` received them)."""

    weights: tuple[Tensor, ...]
    q_conv: Conv | None
    k_conv: Conv | None


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be (B, N, H, D); got a tensor with shape {tuple(q.shape)}.")
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k and v must have the same shape (B, N, H, D); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise TypeError(f"q, k and v must be floating point; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}.")


def _check_params(params: T5Params, variant: str, heads: int, head_dim: int) -> None:
    expected = FAST_WEIGHTS[variant]
    if len(params.weights) != expected:
        raise ValueError(f"variant {variant!r} takes {expected} fast weights; got {len(params.weights)}.")
    for index, weight in enumerate(params.weights, start=1):
        if tuple(weight.shape) != (heads, head_dim, head_dim):
            raise ValueError(f"W{index} must be (H, D, D) = {(heads, head_dim, head_dim)}; got {tuple(weight.shape)}.")
    if (params.q_conv is None) != (params.k_conv is None):
        raise ValueError("pass both q_conv and k_conv for locality, or neither.")
    channels = heads * head_dim
    for name, conv in (("q_conv", params.q_conv), ("k_conv", params.k_conv)):
        if conv is None:
            continue
        weight, bias = conv
        if tuple(weight.shape) != (channels, 1, 3, 3):
            raise ValueError(
                f"{name} weight must be (H*D, 1, 3, 3) = {(channels, 1, 3, 3)}; got {tuple(weight.shape)}."
            )
        if bias is not None and tuple(bias.shape) != (channels,):
            raise ValueError(f"{name} bias must be (H*D,) = ({channels},); got {tuple(bias.shape)}.")


def _check_grid(
    grid: tuple[int, int] | None, tokens: int, text_tokens: int, needs_grid: bool
) -> tuple[int, int] | None:
    if not 0 <= text_tokens < tokens:
        raise ValueError(
            f"text_tokens must be in [0, N) = [0, {tokens}); got {text_tokens}. "
            "The sequence must hold at least one image token."
        )
    n_image = tokens - text_tokens
    if grid is None:
        if needs_grid:
            raise ValueError(
                f"grid=(h, w) is required for the locality convs: {n_image} image tokens cannot be laid out "
                "without it. Pass the latent token grid (latent H and W divided by the patch size)."
            )
        return None
    h, w = (int(x) for x in grid)
    if h < 1 or w < 1 or h * w != n_image:
        raise ValueError(
            f"grid {tuple(grid)} holds {h * w} image tokens but the sequence has N - text_tokens = {tokens} - "
            f"{text_tokens} = {n_image}. Pass the latent token grid (latent H and W divided by the patch size)."
        )
    return h, w


def check_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    weights: tuple[Tensor, ...],
    variant: Variant = "swiglu",
    q_conv: Conv | None = None,
    k_conv: Conv | None = None,
    grid: tuple[int, int] | None = None,
    text_tokens: int = 0,
    text_first: bool = True,
    key_norm_eps: float | None = 1.0,
) -> tuple[T5Params, T5Layout]:
    """Check one T5 attention call and describe it for a backend.

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)` in any float dtype, on one device, as the host's attention
            computes them (after its per-head q/k RMSNorm).
        weights (`tuple[Tensor, ...]`): initial fast weights `(W1, W2, W3)` (swiglu) or `(W1, W2)`
            (mlp), each `(H, D, D)`.
        variant (`"swiglu" | "mlp"`, *optional*, defaults to `"swiglu"`): the inner model.
        q_conv, k_conv (`tuple`, *optional*): `(weight (H*D, 1, 3, 3), bias (H*D,) or None)` of the
            locality convs; both None disables locality.
        grid (`tuple[int, int]`, *optional*): image token grid `(h, w)`; required with locality.
        text_tokens (`int`, *optional*, defaults to 0): text tokens in the sequence.
        text_first (`bool`, *optional*, defaults to True): text before or after the image tokens.
        key_norm_eps (`float`, *optional*, defaults to 1.0): key instance-norm eps; None disables
            the key norm (an ablation, unstable on pretrained keys).

    Returns:
        The tensors `T5Params(weights, q_conv, k_conv)` and the call's `T5Layout`.

    Raises:
        ValueError: an unknown variant; shapes, devices, the fast weights or the convs disagree;
            the text length is out of range; the grid is missing or does not cover the image tokens.
        TypeError: q, k or v is not floating point.
    """
    check_variant(variant)
    _check_qkv(q, k, v)
    batch, tokens, heads, head_dim = q.shape
    params = T5Params(tuple(weights), q_conv, k_conv)
    _check_params(params, variant, heads, head_dim)
    grid = _check_grid(grid, tokens, text_tokens, needs_grid=q_conv is not None)
    layout = T5Layout(
        batch=batch,
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        grid=grid,
        text_tokens=text_tokens,
        text_first=text_first,
        variant=variant,
        key_norm_eps=key_norm_eps,
        locality=q_conv is not None,
    )
    return params, layout

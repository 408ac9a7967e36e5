"""Fused T5 attention: the Triton version of `t5core.ttt.t5_attention_ref`, with its backward.

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, NW fast weights.
Forward: key statistics -> inner step (split over tokens, fixed-order combine) -> apply pass.
Backward: apply-pass backward -> inner-step backward -> conv / key-norm backward. Every pass is a
Triton kernel; torch only allocates, reshapes parameters and casts (t5kernels/README.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton.compiler.errors
import triton.runtime.errors
from torch import Tensor

from t5kernels.bwd import inner_apply_bwd, inner_step_bwd
from t5kernels.fwd import inner_apply_fwd, inner_step_fwd
from t5kernels.launch import LaunchSettings, Plan, make_plan
from t5kernels.locality_bwd import conv_param_grads, key_norm_bwd, locality_bwd
from t5kernels.reduce import key_stats_fwd
from t5kernels.support import KernelBuildError, unsupported_reason

__all__ = ["T5AttentionFunction", "t5_attention"]

_N_WEIGHTS = {"swiglu": 3, "mlp": 2}
# Triton's errors for kernels this machine cannot build or launch (PTXASError is newer than 3.1)
_BUILD_ERRORS = tuple(
    error
    for error in (
        triton.compiler.errors.CompilationError,
        triton.runtime.errors.OutOfResources,
        getattr(triton.runtime.errors, "PTXASError", None),
    )
    if error is not None
)


@contextlib.contextmanager
def _build_errors_reported(q: Tensor, phase: str) -> Iterator[None]:
    """Re-raise Triton's compile and launch-resource errors as `KernelBuildError`, naming the fix."""
    try:
        yield
    except _BUILD_ERRORS as error:
        where = torch.cuda.get_device_name(q.device) if q.is_cuda else str(q.device)
        raise KernelBuildError(
            f"the T5 Triton kernels could not be built or launched for the {phase} on {where} "
            f"({type(error).__name__}: {str(error).strip()[:300]}). Use backend='torch' (or T5_BACKEND=torch)."
        ) from error


@dataclass(frozen=True)
class _Layout:
    variant: str
    grid: tuple[int, int] | None
    text_tokens: int
    text_first: bool
    key_norm_eps: float | None
    launch: LaunchSettings | None

    def plan(self, q: Tensor, phase: str) -> Plan:
        """The launch plan of `phase` ("fwd" or "bwd") for queries `q`."""
        return make_plan(
            q,
            grid=self.grid,
            text_tokens=self.text_tokens,
            text_first=self.text_first,
            phase=phase,
            settings=self.launch,
        )


def _taps(weight: Tensor, bias: Tensor | None, heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Conv params (H*D, 1, 3, 3), (H*D,) -> fp32 taps (H, 9, D) and bias (H, D)."""
    taps = weight.detach().float().reshape(heads, head_dim, 9).transpose(1, 2).contiguous()
    if bias is None:
        return taps, torch.zeros(heads, head_dim, device=weight.device, dtype=torch.float32)
    return taps, bias.detach().float().reshape(heads, head_dim).contiguous()


class T5AttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward and backward run the Triton kernels of this package."""

    @staticmethod
    def forward(ctx, layout: _Layout, q, k, v, q_weight, q_bias, k_weight, k_bias, *weights):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        heads, head_dim = q.shape[2], q.shape[3]
        plan = layout.plan(q, "fwd")
        fast_init = torch.stack([w.detach().float() for w in weights], dim=1).contiguous()  # (H, NW, D, D)
        q_conv = _taps(q_weight, q_bias, heads, head_dim) if q_weight is not None else None
        k_conv = _taps(k_weight, k_bias, heads, head_dim) if k_weight is not None else None
        eps = layout.key_norm_eps
        stats = key_stats_fwd(k, plan) if eps is not None else None
        fast = inner_step_fwd(k, v, fast_init, stats, k_conv, plan=plan, variant=layout.variant, eps=eps or 0.0)
        out = inner_apply_fwd(q, fast, q_conv, plan=plan, variant=layout.variant)
        ctx.layout = layout
        ctx.has_bias = (q_bias is not None, k_bias is not None)
        ctx.param_dtypes = tuple(w.dtype for w in weights)
        ctx.conv_dtypes = tuple(p.dtype if p is not None else None for p in (q_weight, q_bias, k_weight, k_bias))
        ctx.save_for_backward(q, k, v, fast_init, fast, stats, *(q_conv or (None, None)), *(k_conv or (None, None)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with _build_errors_reported(grad_out, "backward"):
            return T5AttentionFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, fast_init, fast, stats, q_taps, q_bias, k_taps, k_bias = ctx.saved_tensors
        layout: _Layout = ctx.layout
        plan = layout.plan(q, "bwd")
        eps = layout.key_norm_eps or 0.0
        q_conv = (q_taps, q_bias) if q_taps is not None else None
        k_conv = (k_taps, k_bias) if k_taps is not None else None
        dq2, grad_fast = inner_apply_bwd(q, fast, q_conv, grad_out.contiguous(), plan=plan, variant=layout.variant)
        dk2, dv, grad_init = inner_step_bwd(
            k, v, fast_init, stats, k_conv, grad_fast, plan=plan, variant=layout.variant, eps=eps
        )
        conv_grads: list[Tensor | None] = [None] * 4
        if q_conv is None:
            dq = dq2.to(q.dtype)
        else:
            dq, partials = locality_bwd(dq2, q, q_taps, None, plan=plan, eps=eps, out_dtype=q.dtype)
            conv_grads[0:2] = conv_param_grads(partials, plan)
        if stats is not None:
            dk_hat, partials = locality_bwd(dk2, k, k_taps, stats, plan=plan, eps=eps, out_dtype=torch.float32)
            dk = key_norm_bwd(dk_hat, k, stats, partials, plan=plan, eps=eps)
        elif k_conv is not None:
            dk, partials = locality_bwd(dk2, k, k_taps, None, plan=plan, eps=eps, out_dtype=k.dtype)
        else:
            dk, partials = dk2.to(k.dtype), None
        if k_conv is not None:
            conv_grads[2:4] = conv_param_grads(partials, plan)
        conv_grads[1] = conv_grads[1] if ctx.has_bias[0] else None
        conv_grads[3] = conv_grads[3] if ctx.has_bias[1] else None
        conv_grads = [g.to(dt) if g is not None else None for g, dt in zip(conv_grads, ctx.conv_dtypes, strict=True)]
        weight_grads = [grad_init[:, i].to(dt) for i, dt in enumerate(ctx.param_dtypes)]
        return (None, dq, dk, dv, *conv_grads, *weight_grads)


def _check(q: Tensor, k: Tensor, v: Tensor, weights, variant, q_conv, k_conv, grid, text_tokens) -> None:
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "q, k and v must have the same shape (B, N, H, D); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(
            f"the kernels need q, k and v in one dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them first."
        )
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}.")
    batch, tokens, heads, head_dim = q.shape
    if variant not in _N_WEIGHTS:
        raise ValueError(f"variant must be one of {tuple(_N_WEIGHTS)}; got {variant!r}.")
    if len(weights) != _N_WEIGHTS[variant]:
        raise ValueError(f"variant {variant!r} takes {_N_WEIGHTS[variant]} fast weights; got {len(weights)}.")
    for index, weight in enumerate(weights, start=1):
        if tuple(weight.shape) != (heads, head_dim, head_dim):
            raise ValueError(f"W{index} must be (H, D, D) = {(heads, head_dim, head_dim)}; got {tuple(weight.shape)}.")
    if (q_conv is None) != (k_conv is None):
        raise ValueError("pass both q_conv and k_conv for locality, or neither.")
    for name, conv in (("q_conv", q_conv), ("k_conv", k_conv)):
        if conv is not None and tuple(conv[0].shape) != (heads * head_dim, 1, 3, 3):
            raise ValueError(
                f"{name} weight must be (H*D, 1, 3, 3) = {(heads * head_dim, 1, 3, 3)}; got {tuple(conv[0].shape)}."
            )
    if not 0 <= text_tokens < tokens:
        raise ValueError(f"text_tokens must be in [0, N) = [0, {tokens}); got {text_tokens}.")
    if grid is None:
        if q_conv is not None:
            raise ValueError("grid=(h, w) is required for the locality convs; pass the latent token grid.")
        return
    h, w = grid
    if h < 1 or w < 1 or h * w != tokens - text_tokens:
        raise ValueError(
            f"grid {tuple(grid)} holds {h * w} image tokens but N - text_tokens = {tokens} - {text_tokens} = "
            f"{tokens - text_tokens}. Pass the latent token grid (latent H and W divided by the patch size)."
        )


def t5_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    weights: tuple[Tensor, ...],
    variant: str = "swiglu",
    q_conv: tuple[Tensor, Tensor | None] | None = None,
    k_conv: tuple[Tensor, Tensor | None] | None = None,
    grid: tuple[int, int] | None = None,
    text_tokens: int = 0,
    text_first: bool = True,
    key_norm_eps: float | None = 1.0,
    launch: LaunchSettings | None = None,
) -> Tensor:
    """T5 attention with the fused Triton kernels; same contract and results as
    `t5core.ttt.t5_attention_ref`, differentiable with respect to every tensor argument.

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)`, one dtype (float32, float16 or bfloat16), D a power of
            two in [16, 128]. A non-contiguous input is copied to contiguous first.
        weights (`tuple[Tensor, ...]`): `(W1, W2, W3)` (swiglu) or `(W1, W2)` (mlp), each `(H, D, D)`.
        variant (`"swiglu" | "mlp"`, *optional*, defaults to `"swiglu"`): the inner model.
        q_conv, k_conv (`tuple`, *optional*): `(weight (H*D, 1, 3, 3), bias (H*D,) or None)`; both
            None disables locality.
        grid (`tuple[int, int]`, *optional*): image token grid `(h, w)`; required with locality.
        text_tokens (`int`, *optional*, defaults to 0): text tokens in the sequence.
        text_first (`bool`, *optional*, defaults to True): text before or after the image tokens.
        key_norm_eps (`float`, *optional*, defaults to 1.0): key instance-norm eps; None disables it.
        launch (`LaunchSettings`, *optional*): launch settings for the forward and the backward
            instead of the defaults (for tuning: `benchmarks/sweep_kernels.py`).

    Returns:
        `(B, N, H, D)` in q's dtype.

    Raises:
        RuntimeError: the kernels cannot run this call (`t5kernels.unsupported_reason` says why).
        KernelBuildError: Triton could not compile or launch the kernels on this machine.
        ValueError: inconsistent shapes, dtypes, grid or text length.
    """
    reason = unsupported_reason(q, variant=variant)
    if reason is not None:
        raise RuntimeError(f"the T5 Triton kernels cannot run this call: {reason}. Use t5core.ttt.t5_attention_ref.")
    _check(q, k, v, weights, variant, q_conv, k_conv, grid, text_tokens)
    grid = None if grid is None else (int(grid[0]), int(grid[1]))
    layout = _Layout(variant, grid, text_tokens, text_first, key_norm_eps, launch)
    q_weight, q_bias = q_conv if q_conv is not None else (None, None)
    k_weight, k_bias = k_conv if k_conv is not None else (None, None)
    with _build_errors_reported(q, "forward"):
        return T5AttentionFunction.apply(layout, q, k, v, q_weight, q_bias, k_weight, k_bias, *weights)

"""Fused T5 attention: the Triton version of `t5core.ttt.reference_attention`, with its backward.

Legend: B batch, N tokens, H heads, D head dim, h x w latent grid, T text tokens, NW fast weights.
Forward: key statistics -> inner step (split over tokens, fixed-order combine) -> apply pass.
Backward: apply-pass backward -> inner-step backward -> conv / key-norm backward. Every pass is a
Triton kernel; torch only allocates, reshapes parameters and casts (t5kernels/README.md).

Top to bottom: Triton's build errors, parameter packing, the autograd Function, then the two
entry points: `fused_attention` on a call `t5core.contract.check_call` has checked (what
`t5core.backend` runs) and the public `t5_attention`, which checks the call itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton.compiler.errors
import triton.runtime.errors
from torch import Tensor

from t5core.contract import T5Layout, T5Params, check_call
from t5kernels.bwd import inner_apply_bwd, inner_step_bwd
from t5kernels.fwd import inner_apply_fwd, inner_step_fwd
from t5kernels.launch import LaunchSettings, make_plan
from t5kernels.locality_bwd import conv_param_grads, key_norm_bwd, locality_bwd
from t5kernels.reduce import key_stats_fwd
from t5kernels.support import KernelBuildError, unsupported_reason
from t5kernels.tiles import TAPS

__all__ = ["T5AttentionFunction", "fused_attention", "t5_attention"]

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


def _taps(weight: Tensor, bias: Tensor | None, heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Conv params (H*D, 1, 3, 3), (H*D,) -> fp32 taps (H, 9, D) and bias (H, D)."""
    taps = weight.detach().float().reshape(heads, head_dim, TAPS.value).transpose(1, 2).contiguous()
    if bias is None:
        return taps, torch.zeros(heads, head_dim, device=weight.device, dtype=torch.float32)
    return taps, bias.detach().float().reshape(heads, head_dim).contiguous()


class T5AttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward and backward run the Triton kernels of this package."""

    @staticmethod
    def forward(
        ctx, layout: T5Layout, launch: LaunchSettings | None, q, k, v, q_weight, q_bias, k_weight, k_bias, *weights
    ):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        heads, head_dim = layout.heads, layout.head_dim
        plan = make_plan(q, layout, phase="fwd", settings=launch)
        fast_init = torch.stack([w.detach().float() for w in weights], dim=1).contiguous()  # (H, NW, D, D)
        q_conv = _taps(q_weight, q_bias, heads, head_dim) if q_weight is not None else None
        k_conv = _taps(k_weight, k_bias, heads, head_dim) if k_weight is not None else None
        eps = layout.key_norm_eps
        stats = key_stats_fwd(k, plan) if eps is not None else None
        fast = inner_step_fwd(k, v, fast_init, stats, k_conv, plan=plan, variant=layout.variant, eps=eps or 0.0)
        out = inner_apply_fwd(q, fast, q_conv, plan=plan, variant=layout.variant)
        ctx.layout, ctx.launch = layout, launch
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
        layout: T5Layout = ctx.layout
        plan = make_plan(q, layout, phase="bwd", settings=ctx.launch)
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
        return (None, None, dq, dk, dv, *conv_grads, *weight_grads)


def fused_attention(
    q: Tensor, k: Tensor, v: Tensor, params: T5Params, layout: T5Layout, *, launch: LaunchSettings | None = None
) -> Tensor:
    """`t5_attention` on a call that `t5core.contract.check_call` has checked and for which
    `unsupported_reason` is None (what `t5core.backend.attend` runs).

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)` as checked.
        params (`T5Params`): the fast weights and the locality convs.
        layout (`T5Layout`): grid, text layout, variant and key-norm eps of the call.
        launch (`LaunchSettings`, *optional*): launch settings instead of the defaults.

    Returns:
        `(B, N, H, D)` in q's dtype.

    Raises:
        ValueError: q, k and v differ in dtype (the kernels take one dtype).
        KernelBuildError: Triton could not compile or launch the kernels on this machine.
    """
    assert tuple(q.shape) == layout.shape and len(params.weights) == layout.n_weights
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(
            f"the kernels need q, k and v in one dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them first."
        )
    q_weight, q_bias = params.q_conv if params.q_conv is not None else (None, None)
    k_weight, k_bias = params.k_conv if params.k_conv is not None else (None, None)
    with _build_errors_reported(q, "forward"):
        return T5AttentionFunction.apply(layout, launch, q, k, v, q_weight, q_bias, k_weight, k_bias, *params.weights)


def t5_attention(q: Tensor, k: Tensor, v: Tensor, *, launch: LaunchSettings | None = None, **arguments) -> Tensor:
    """T5 attention with the fused Triton kernels; same contract and results as
    `t5core.ttt.t5_attention_ref`, differentiable with respect to every tensor argument.

    Args:
        q, k, v (`Tensor`): `(B, N, H, D)`, one dtype (float32, float16 or bfloat16), D a power of
            two in [16, 128]. A non-contiguous input is copied to contiguous first.
        launch (`LaunchSettings`, *optional*): launch settings for the forward and the backward
            instead of the defaults (for tuning: `benchmarks/sweep_kernels.py`).
        **arguments: the rest of the call contract, checked by `t5core.contract.check_call`:
            `weights` (required), `variant`, `q_conv`, `k_conv`, `grid`, `text_tokens`, `text_first`,
            `key_norm_eps`.

    Returns:
        `(B, N, H, D)` in q's dtype.

    Raises:
        ValueError, TypeError: the call breaks the contract (`check_call`), or q, k and v differ in
            dtype.
        RuntimeError: the kernels cannot run this call (`t5kernels.unsupported_reason` says why).
        KernelBuildError: Triton could not compile or launch the kernels on this machine.
    """
    params, layout = check_call(q, k, v, **arguments)
    reason = unsupported_reason(q, variant=layout.variant)
    if reason is not None:
        raise RuntimeError(f"the T5 Triton kernels cannot run this call: {reason}. Use t5core.ttt.t5_attention_ref.")
    return fused_attention(q, k, v, params, layout, launch=launch)

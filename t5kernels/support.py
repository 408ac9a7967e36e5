"""What the fused kernels can run, decided without launching anything (imports only torch, and
triton when it is installed).

`TRITON_INTERPRET=1` must be set before `t5kernels` is imported: Triton decides at decoration time
whether a kernel is compiled for the GPU or run by its CPU interpreter. CPU tensors are accepted
only when the kernels were decorated for the interpreter *and* the variable is still set, so a
test process can import the interpreted kernels once and switch CPU dispatch on and off.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["INTERPRETED", "TRITON_AVAILABLE", "interpret_requested", "t5_attention_unavailable", "unsupported_reason"]

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 16, 128
_VARIANTS = ("swiglu", "mlp")


def interpret_requested() -> bool:
    """Whether `TRITON_INTERPRET` is set to a true value now."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _decorated_for_interpreter() -> bool:
    if not TRITON_AVAILABLE:
        return False
    import triton

    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs is not None else interpret_requested()


INTERPRETED = _decorated_for_interpreter()


def unsupported_reason(q: torch.Tensor, *, variant: str) -> str | None:
    """Why the fused kernels cannot run a call with queries `q`, or None when they can.

    Args:
        q (`Tensor`): the queries `(B, N, H, D)` of the call.
        variant (`str`): the inner model, `"swiglu"` or `"mlp"`.

    Returns:
        A short reason naming the problem, or None.
    """
    if not TRITON_AVAILABLE:
        return "triton is not installed (pip install triton)"
    if variant not in _VARIANTS:
        return f"variant {variant!r} is not one of {_VARIANTS}"
    if q.dim() != 4:
        return f"q must be (B, N, H, D); got shape {tuple(q.shape)}"
    if q.device.type != "cuda":
        if not INTERPRETED and interpret_requested():
            return (
                f"q is on {q.device.type} and TRITON_INTERPRET=1 was set after `t5kernels` was imported; "
                "set it before the import"
            )
        if not (INTERPRETED and interpret_requested()):
            return f"q is on {q.device.type}; the kernels need a CUDA tensor (or TRITON_INTERPRET=1)"
    if q.dtype not in _DTYPES:
        return f"dtype {str(q.dtype).removeprefix('torch.')} is not supported (float32, float16, bfloat16 are)"
    if INTERPRETED and q.dtype == torch.bfloat16:
        return "bfloat16 under TRITON_INTERPRET=1 is not supported (the interpreter's bf16 tl.dot is wrong)"
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1) or head_dim < 1:
        return f"head_dim {head_dim} is not a power of two"
    if not _MIN_HEAD_DIM <= head_dim <= _MAX_HEAD_DIM:
        return f"head_dim {head_dim} is outside [{_MIN_HEAD_DIM}, {_MAX_HEAD_DIM}]"
    return None


def t5_attention_unavailable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """Stands in for `t5kernels.t5_attention` when triton is missing: always raises.

    Raises:
        RuntimeError: naming the missing package and its install line.
    """
    raise RuntimeError("the T5 Triton kernels need triton (pip install triton); use t5core.ttt.t5_attention_ref.")

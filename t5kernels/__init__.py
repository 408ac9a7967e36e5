"""Fused Triton kernels for T5 attention (forward and backward) and what they can run.

`t5core.backend` checks a call once (`t5core.contract.check_call`), asks
`unsupported_reason(q, variant=...)` and, when it returns None, calls
`fused_attention(q, k, v, params, layout)`. `t5_attention(q, k, v, **arguments)` takes the keyword
arguments of `t5core.ttt.t5_attention_ref` and checks them itself. This package imports torch,
triton and the call contract `t5core.contract`, and imports cleanly without triton (then every
call is unsupported).
"""

from t5kernels.support import TRITON_AVAILABLE, KernelBuildError, unsupported_reason

if TRITON_AVAILABLE:
    from t5kernels.fused import fused_attention, t5_attention
else:
    from t5kernels.support import t5_attention_unavailable as fused_attention
    from t5kernels.support import t5_attention_unavailable as t5_attention

__all__ = ["KernelBuildError", "fused_attention", "t5_attention", "unsupported_reason"]

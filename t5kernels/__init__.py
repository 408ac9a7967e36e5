"""Fused Triton kernels for T5 attention (forward and backward) and what they can run.

`t5core.backend` asks `unsupported_reason(q, variant=...)` and, when it returns None, calls
`t5_attention(q, k, v, **same arguments as t5core.ttt.t5_attention_ref)`. This package imports only
torch and triton, and imports cleanly without triton (then every call is unsupported).
"""

from t5kernels.support import TRITON_AVAILABLE, KernelBuildError, unsupported_reason

if TRITON_AVAILABLE:
    from t5kernels.fused import t5_attention
else:
    from t5kernels.support import t5_attention_unavailable as t5_attention

__all__ = ["KernelBuildError", "t5_attention", "unsupported_reason"]

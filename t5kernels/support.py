"""What the fused kernels can run, decided without launching anything (imports only torch, the
variants of `t5core.contract`, and triton when it is installed).

`TRITON_INTERPRET=1` must be set before `t5kernels` is imported: Triton decides at decoration time
whether a kernel is compiled for the GPU or run by its CPU interpreter. CPU tensors are accepted
only when the kernels were decorated for the interpreter *and* the variable is still set, so a
test process can import the interpreted kernels once and switch CPU dispatch on and off.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import NoReturn

import torch

from t5core.contract import VARIANTS

__all__ = [
    "INTERPRETED",
    "KernelBuildError",
    "MIN_CAPABILITY",
    "MIN_TRITON",
    "SHARED_KIB_NEEDED",
    "TRITON_AVAILABLE",
    "TRITON_MISSING",
    "cuda_device_reason",
    "interpret_requested",
    "t5_attention_unavailable",
    "unsupported_reason",
]

MIN_TRITON = (3, 1)
"""The oldest Triton the kernels are written for (the `kernels` extra asks for it). Triton 3.0, the one
torch 2.4 pins, is refused: its interpreter rejects the kernels' `tl.arange` over block sizes."""


def _triton_missing() -> str | None:
    """Why no Triton the kernels run on is installed (absent, or older than `MIN_TRITON`), or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    import triton

    version = triton.__version__
    if tuple(int(part) for part in version.split(".")[:2]) < MIN_TRITON:
        return (
            f"triton {version} is older than {'.'.join(map(str, MIN_TRITON))}, the oldest the kernels run on "
            "(torch 2.4 pins triton 3.0; torch 2.5 or newer brings a newer one)"
        )
    return None


TRITON_MISSING = _triton_missing()
"""Why the kernels cannot run on this install at all, or None: the first reason `unsupported_reason` gives."""
TRITON_AVAILABLE = TRITON_MISSING is None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 16, 128
# bf16 MMAs and 3xTF32 products need Ampere or newer.
MIN_CAPABILITY = (8, 0)
# Shared memory per block (KiB) the largest kernel needs at its default launch settings, by
# (fp32 inputs, head dim rounded up to 64 or 128): ptxas for sm_80 and sm_90, the larger of the
# two (`python -m tools.compile_cuda --all`; tests/t5kernels/test_compile_cuda.py keeps
# the first three tight bounds). GPUs allow 99 KiB (sm_86, sm_89), 163 KiB (sm_80) or 227 KiB
# (sm_90) per block, so fp32 at head dim 128 runs nowhere and fp32 at 64 needs an A100 or H100.
SHARED_KIB_NEEDED = {(False, 64): 48, (True, 64): 136, (False, 128): 144, (True, 128): 464}


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or launched on this machine (a Triton compiler or resource
    error, not bad input). `backend="auto"` then takes the torch path; `"triton"` raises this."""


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


def cuda_device_reason(
    *, name: str, capability: tuple[int, int], shared_bytes: int, rocm: bool, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why a GPU with these properties cannot run the kernels for `dtype` and `head_dim`, or None.

    Args:
        name (`str`): the device name, for the message.
        capability (`tuple[int, int]`): CUDA compute capability.
        shared_bytes (`int`): the most shared memory a block may opt in to.
        rocm (`bool`): whether torch runs on ROCm (HIP).
        dtype, head_dim: of the call (already checked to be supported in general).
    """
    if rocm:
        return f"{name} runs ROCm; the kernels are written and tested for NVIDIA GPUs only"
    if capability < MIN_CAPABILITY:
        major, minor = capability
        return f"{name} has compute capability {major}.{minor}; the kernels need 8.0 or newer (Ampere, Ada, Hopper)"
    rounded = 64 if head_dim <= 64 else 128
    need_kib = SHARED_KIB_NEEDED[(dtype == torch.float32, rounded)]
    if need_kib * 1024 <= shared_bytes:
        return None
    half_fits = SHARED_KIB_NEEDED[(False, rounded)] * 1024 <= shared_bytes
    hint = "; run the model in bfloat16 or float16" if dtype == torch.float32 and half_fits else ""
    return (
        f"{str(dtype).removeprefix('torch.')} at head_dim {head_dim} needs {need_kib} KiB of shared memory per block "
        f"and {name} allows {shared_bytes // 1024} KiB{hint}"
    )


@functools.cache
def _cuda_properties(index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    shared = getattr(props, "shared_memory_per_block_optin", None)
    if shared is None:  # older torch: ask Triton's driver, which is what decides at launch
        import triton

        shared = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return {
        "name": props.name,
        "capability": (props.major, props.minor),
        "shared_bytes": int(shared),
        "rocm": torch.version.hip is not None,
    }


def unsupported_reason(q: torch.Tensor, *, variant: str) -> str | None:
    """Why the fused kernels cannot run a call with queries `q`, or None when they can.

    Args:
        q (`Tensor`): the queries `(B, N, H, D)` of the call.
        variant (`str`): the inner model, `"swiglu"` or `"mlp"`.

    Returns:
        A short reason naming the problem, or None.
    """
    if TRITON_MISSING is not None:
        return TRITON_MISSING
    if variant not in VARIANTS:
        return f"variant {variant!r} is not one of {VARIANTS}"
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
    if q.device.type == "cuda":
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        return cuda_device_reason(**_cuda_properties(index), dtype=q.dtype, head_dim=head_dim)
    return None


def t5_attention_unavailable(*args: object, **kwargs: object) -> NoReturn:
    """Stands in for `t5kernels.t5_attention` and `t5kernels.fused_attention` when no Triton they run on
    is installed: always raises.

    Raises:
        RuntimeError: saying why (`TRITON_MISSING`: the package is absent or too old) and the fix.
    """
    raise RuntimeError(f"the T5 Triton kernels cannot run: {TRITON_MISSING}. Use t5core.ttt.t5_attention_ref.")

"""Backend choice for T5 attention, made in one place and reported.

`"torch"` runs `t5core.ttt.t5_attention_ref`; `"triton"` runs the fused kernels of the `t5kernels`
package; `"auto"` picks Triton for CUDA tensors when the kernels support the call, else torch, and
logs once per reason which path runs. The environment variable `T5_BACKEND` overrides `"auto"`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Literal

from torch import Tensor

__all__ = ["Backend", "BACKENDS", "resolve_backend"]

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
ENV_VAR = "T5_BACKEND"


@functools.cache
def _kernels() -> ModuleType | str:
    """The `t5kernels` package, or the reason it cannot be imported."""
    try:
        return importlib.import_module("t5kernels")
    except ImportError as error:
        return f"the Triton kernels are unavailable ({error}); install them with `pip install triton`"


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def resolve_backend(requested: str, q: Tensor, *, variant: str) -> Literal["torch", "triton"]:
    """Resolve `auto | torch | triton` for one call.

    Args:
        requested (`str`): the module's backend setting.
        q (`Tensor`): the queries of the call (device, dtype, shape decide support).
        variant (`str`): the inner model.

    Raises:
        ValueError: an unknown backend name (argument or `T5_BACKEND`).
        RuntimeError: `"triton"` was requested and cannot run this call; says why and what to do.
    """
    if requested == "auto":
        requested = os.environ.get(ENV_VAR, "auto") or "auto"
        if requested not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={requested!r} is not a backend; use one of {BACKENDS}.")
    elif requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {requested!r}.")
    if requested == "torch":
        return "torch"
    package = _kernels()
    reason = package if isinstance(package, str) else package.unsupported_reason(q, variant=variant)
    if requested == "triton":
        if reason is not None:
            raise RuntimeError(
                f"backend 'triton' cannot run this call: {reason}. Use backend='torch' (or T5_BACKEND=torch)."
            )
        return "triton"
    if reason is None:
        _log_once("T5 attention: running the Triton kernels")
        return "triton"
    _log_once(f"T5 attention: running the torch path because {reason}")
    return "torch"

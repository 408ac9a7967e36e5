"""Backend choice for T5 attention, made in one place and reported.

`"torch"` runs `t5core.ttt_chunked.chunked_attention` (the reference math of `t5core.ttt`, over
chunks of tokens, so its memory does not grow with N); `"triton"` runs `t5kernels.fused_attention`;
`"auto"` picks Triton for CUDA tensors when the kernels support the call, else torch, and logs
once per reason which path runs. The environment variable `T5_BACKEND` overrides `"auto"`.
Under `"auto"`, kernels that Triton cannot build or launch on this machine are reported once and
that (device, dtype, head dim, variant) takes the torch path from then on.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from t5core.contract import T5Layout, T5Params
from t5core.ttt_chunked import chunked_attention

__all__ = ["Backend", "BACKENDS", "attend", "describe_backend", "resolve_backend"]

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


# (device, dtype, head dim, variant) -> why the kernels failed to build or launch there
_BUILD_FAILURES: dict[tuple, str] = {}


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def _failure_key(q: Tensor, variant: str) -> tuple:
    return (str(q.device), q.dtype, q.shape[-1], variant)


def _requested(requested: str) -> str:
    """`requested`, or `T5_BACKEND` in its place when it is "auto"; checked against `BACKENDS`."""
    if requested == "auto":
        requested = os.environ.get(ENV_VAR, "auto") or "auto"
        if requested not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={requested!r} is not a backend; use one of {BACKENDS}.")
    elif requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {requested!r}.")
    return requested


def _unsupported(requested: str, q: Tensor, variant: str) -> str | None:
    """Why the kernels cannot run a call like `q` (None when they can), for a normalised `requested`."""
    package = _kernels()
    reason = package if isinstance(package, str) else package.unsupported_reason(q, variant=variant)
    if reason is None and requested == "auto":
        reason = _BUILD_FAILURES.get(_failure_key(q, variant))
    return reason


def _choose(requested: str, q: Tensor, variant: str) -> Literal["torch", "triton"]:
    """The backend for one call, from an already normalised `requested`; asks the kernels once."""
    if requested == "torch":
        return "torch"
    reason = _unsupported(requested, q, variant)
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
    return _choose(_requested(requested), q, variant)


def describe_backend(
    requested: str, device: torch.device | str, dtype: torch.dtype, *, head_dim: int, variant: str
) -> str:
    """Which backend calls on `device` in `dtype` will run, in words, without running one: "Triton
    kernels", or "torch" with the reason (requested, or why the kernels cannot run there).

    Raises:
        ValueError: an unknown backend name (argument or `T5_BACKEND`).
    """
    requested = _requested(requested)
    if requested == "torch":
        return "torch (requested)"
    reason = _unsupported(requested, torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype), variant)
    if reason is None:
        return "Triton kernels"
    return f"torch ({reason})" if requested == "auto" else f"Triton requested, but {reason}"


def attend(requested: str, q: Tensor, k: Tensor, v: Tensor, params: T5Params, layout: T5Layout) -> Tensor:
    """One checked T5 attention call on the backend `requested` resolves to (`resolve_backend`).

    Args:
        requested (`str`): `"auto" | "torch" | "triton"`.
        q, k, v (`Tensor`): `(B, N, H, D)`.
        params, layout: the call as `t5core.contract.check_call` returned it.

    Raises:
        ValueError, RuntimeError: as `resolve_backend` raises them.
        t5kernels.KernelBuildError: `"triton"` was requested and Triton cannot build or launch the
            kernels here. Under `"auto"` that is logged as a warning and the torch path runs.
    """
    requested = _requested(requested)
    if _choose(requested, q, layout.variant) == "triton":
        package = _kernels()
        try:
            return package.fused_attention(q, k, v, params, layout)
        except package.KernelBuildError as error:
            if requested != "auto":
                raise
            _BUILD_FAILURES[_failure_key(q, layout.variant)] = f"the kernels failed to build or launch here: {error}"
            logger.warning("T5 attention: %s; running the torch path for these calls from now on", error)
    return chunked_attention(q, k, v, params, layout)

"""Backend choice for T5 attention, made in one place and reported.

`"torch"` runs `t5core.ttt_chunked.chunked_attention` (the reference math of `t5core.ttt`, over
chunks of tokens, so its memory does not grow with N); `"triton"` runs `t5kernels.fused_attention`;
`"auto"` picks Triton for CUDA tensors when the kernels support the call, else torch, and logs
once per reason which path runs. The environment variable `T5_BACKEND` overrides `"auto"`.
Under `"auto"`, kernels that Triton cannot build or launch on this machine are reported once and
that (device, dtype, head dim, variant) takes the torch path from then on. Under torch.compile the
choice is made while dynamo traces a call and is a constant of the graph (no import, environment
read or log call inside it).
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


# the `t5kernels` package or why it cannot be imported, once `_kernels` has asked
_KERNELS: ModuleType | str | None = None


def _kernels() -> ModuleType | str:
    """The `t5kernels` package, or the reason it cannot be imported. Kept in a module global, not a
    `functools.cache`: torch.compile traces the call past the cache, while it reads a global set by
    `_choose` (which asks first) without importing."""
    global _KERNELS
    if _KERNELS is None:
        try:
            _KERNELS = importlib.import_module("t5kernels")
        except ImportError as error:
            _KERNELS = f"the Triton kernels are unavailable ({error}); install them with `pip install triton`"
    return _KERNELS


# (device, dtype, head dim, variant) -> why the kernels failed to build or launch there
_BUILD_FAILURES: dict[tuple, str] = {}


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def _failure_key(device: torch.device, dtype: torch.dtype, head_dim: int, variant: str) -> tuple:
    return (str(device), dtype, head_dim, variant)


def _requested(requested: str) -> str:
    """`requested`, or `T5_BACKEND` in its place when it is "auto"; checked against `BACKENDS`."""
    if requested == "auto":
        requested = os.environ.get(ENV_VAR, "auto") or "auto"
        if requested not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={requested!r} is not a backend; use one of {BACKENDS}.")
    elif requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {requested!r}.")
    return requested


def _unsupported(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, variant: str) -> str | None:
    """Why the kernels cannot run calls on `device` in `dtype` with `head_dim` (None when they can),
    for a normalised `requested`. The kernels judge a call by its queries' device, dtype and head dim,
    so a (1, 1, 1, D) tensor stands in for them."""
    package = _kernels()
    stand_in = torch.empty((1, 1, 1, head_dim), device=device, dtype=dtype)
    reason = package if isinstance(package, str) else package.unsupported_reason(stand_in, variant=variant)
    if reason is None and requested == "auto":
        reason = _BUILD_FAILURES.get(_failure_key(stand_in.device, dtype, head_dim, variant))
    return reason


def _choose(
    requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, variant: str
) -> tuple[str, Literal["torch", "triton"]]:
    """The normalised `requested` (`_requested`) and the backend it picks for calls on `device` in
    `dtype` with `head_dim`; the first time each reason comes up under `"auto"`, logs it."""
    requested = _requested(requested)
    if requested == "torch":
        return requested, "torch"
    reason = _unsupported(requested, device, dtype, head_dim, variant)
    if requested == "triton":
        if reason is not None:
            raise RuntimeError(
                f"backend 'triton' cannot run this call: {reason}. Use backend='torch' (or T5_BACKEND=torch)."
            )
        return requested, "triton"
    if reason is None:
        _log_once("T5 attention: running the Triton kernels")
        return requested, "triton"
    _log_once(f"T5 attention: running the torch path because {reason}")
    return requested, "torch"


# torch.compile calls `_choose` while it traces a call and keeps the result as a constant of the graph,
# so the import, the questions to the kernels and the log line stay out of the compiled code; eager
# calls run it every time (the environment, the interpreter setting and build failures can change
# between calls). This is the mark `torch.compiler.assume_constant_result` sets, set here directly:
# that function imports torch._dynamo, which t5core does not load otherwise.
_choose._dynamo_marked_constant = True


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
    return _choose(requested, q.device, q.dtype, q.shape[-1], variant)[1]


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
    reason = _unsupported(requested, torch.device(device), dtype, head_dim, variant)
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
    requested, choice = _choose(requested, q.device, q.dtype, q.shape[-1], layout.variant)
    if choice == "triton":
        package = _kernels()
        try:
            return package.fused_attention(q, k, v, params, layout)
        except package.KernelBuildError as error:
            if requested != "auto":
                raise
            key = _failure_key(q.device, q.dtype, q.shape[-1], layout.variant)
            _BUILD_FAILURES[key] = f"the kernels failed to build or launch here: {error}"
            logger.warning("T5 attention: %s; running the torch path for these calls from now on", error)
    return chunked_attention(q, k, v, params, layout)

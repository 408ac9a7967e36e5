"""Fixtures for the kernel tests: where the kernels run, and NaN-poisoned allocations.

Triton decides at decoration time (when `t5kernels` is imported) whether kernels are compiled for
the GPU or run by its CPU interpreter. Without CUDA, tests/conftest.py imports `t5kernels` with
`TRITON_INTERPRET=1` before anything else and then restores the variable, so the rest of the test
process (hosts, trainer) still dispatches CPU tensors to the torch path. The `device` fixture sets the
variable again for each kernel test, which is what `t5kernels.unsupported_reason` checks at call time.
With CUDA, the kernels are compiled and the same cases run on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from t5kernels import support

_CUDA = torch.cuda.is_available()
_ENV = "TRITON_INTERPRET"


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """CUDA when present, else the CPU under the Triton interpreter (skipped if that is impossible)."""
    if _CUDA:
        return torch.device("cuda")
    if not support.TRITON_AVAILABLE:
        pytest.skip(support.TRITON_MISSING)
    if not support.INTERPRETED:
        pytest.skip(
            "`t5kernels` was imported before tests/t5kernels/conftest.py could set TRITON_INTERPRET=1; "
            "run tests/t5kernels in its own pytest process"
        )
    monkeypatch.setenv(_ENV, "1")
    return torch.device("cpu")


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill floating `torch.empty` / `torch.empty_like` allocations with NaN, so a tile a kernel
    forgets to write fails the comparison instead of passing on zeroed memory."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point():
            tensor.fill_(math.nan)
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poisoned(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poisoned(real_empty_like(*args, **kwargs)))

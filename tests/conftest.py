"""Process-wide test setup.

Without CUDA the Triton kernels are tested under Triton's CPU interpreter, and Triton decides
interpreted vs compiled for every `@triton.jit` function, its own `triton.language` helpers
included, when that function is defined. Other code imports Triton and the kernels too (torch,
diffusers, ComfyUI, the benchmarks' tests at collection), so this file imports `t5kernels` first,
with `TRITON_INTERPRET=1`, and then restores the variable: the kernel tests set it again per test
(tests/t5kernels/conftest.py), every other test keeps the torch path.

The shared fixtures (ComfyUI and its tiny model) live in `testing.fixtures`, registered here for every test.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import t5kernels  # noqa: F401  (without triton it imports too; the kernel tests then skip)
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous

pytest_plugins = ["testing.fixtures"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that runs in ComfyUI (it uses the `comfy` fixture, directly or through another
    fixture) as `comfyui`, so CI can run them again on the floor tree with `-m comfyui`."""
    for item in items:
        if "comfy" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.comfyui)

"""The session fixtures of the ComfyUI tests, registered once for the whole suite by
`pytest_plugins` in tests/conftest.py: ComfyUI itself, and the tiny model of `testing.comfy_tiny`
(its diffusers transformer, its checkpoint in ComfyUI's `models/`, the loaded ModelPatcher, its
`BaseArch`, and a T5 weights file converting every attention module)."""

from __future__ import annotations

from pathlib import Path

import pytest
from diffusers import SD3Transformer2DModel

from t5core.config import BaseArch
from testing.comfy_env import ComfyEnv, comfy_env
from testing.comfy_tiny import PRESET, write_checkpoint, write_t5_weights
from testing.models import tiny_transformer


@pytest.fixture(scope="session")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> ComfyEnv:
    """The session's ComfyUI; tests using it, directly or through another fixture, are marked `comfyui`."""
    return comfy_env(tmp_path_factory.mktemp("comfyui"))


@pytest.fixture(scope="session")
def transformer() -> SD3Transformer2DModel:
    return tiny_transformer(PRESET)


@pytest.fixture(scope="session")
def checkpoint(comfy: ComfyEnv, transformer: SD3Transformer2DModel) -> Path:
    return write_checkpoint(comfy.models_dir / "diffusion_models" / "tiny_sd35m.safetensors", transformer)


@pytest.fixture(scope="session")
def model(comfy: ComfyEnv, checkpoint: Path):
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(checkpoint))


@pytest.fixture(scope="session")
def arch(model) -> BaseArch:
    from t5core.hosts.comfy import arch_of

    return arch_of(model)


@pytest.fixture(scope="session")
def weights_all(comfy: ComfyEnv, arch: BaseArch) -> Path:
    return write_t5_weights(comfy.models_dir / "t5_linearize" / "tiny_all.safetensors", arch, arch.attention_modules())

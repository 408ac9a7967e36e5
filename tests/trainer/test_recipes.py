"""The hardware recipes in trainer/configs: each fits the GPU it names, states the plan it gets, and
SD3.5 Large on one 24 GB GPU is refused with a message that says what would fit."""

from __future__ import annotations

import re

import pytest
import torch

from testing.models import shipped_config
from trainer.cli import parse_args
from trainer.config import TrainConfig
from trainer.data import bucket_sizes
from trainer.memory import MemoryPlan, check_plan, count_parameters, run_shape
from trainer.model import CONFIGS_DIR, build_model
from trainer.time_estimate import GPUS

RECIPES = CONFIGS_DIR.parent
TEXT_TOKENS = 77 + 256
PIXELS_PER_TOKEN = 16
"""VAE factor 8 x patch 2."""
CASES = [
    pytest.param("sd35_medium_24gb.toml", "sd3.5_medium", "RTX 4090", 1, id="medium-1xRTX4090"),
    pytest.param("sd35_medium_full_linear_24gb.toml", "sd3.5_medium", "RTX 4090", 1, id="medium-full-linear-1xRTX4090"),
    pytest.param("sd35_medium_80gb.toml", "sd3.5_medium", "H100 80GB", 1, id="medium-1xH100"),
    pytest.param("sd35_medium.toml", "sd3.5_medium", "H20", 4, id="medium-4xH20"),
    pytest.param("sd35_large_80gb.toml", "sd3.5_large", "H100 80GB", 1, id="large-1xH100"),
    pytest.param("sd35_large.toml", "sd3.5_large", "H20", 4, id="large-4xH20"),
]


def _load(recipe: str, *flags: str) -> TrainConfig:
    return parse_args(["--config", str(RECIPES / recipe), "--model.base", "m", "--data.path", "d", *flags])


def _plan(config: TrainConfig, model: str, gpu_name: str, world_size: int) -> MemoryPlan:
    """What `trainer.memory.plan_run` prints on `world_size` of `gpu_name`: the model on the meta device, built
    as the trainer builds it (low-rank deltas included), the largest bucket of the recipe's resolution."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        handle, split = build_model(SD3Transformer2DModel(**shipped_config(model)), config)
    width, height = max(bucket_sizes(config.data.buckets, config.data.resolution, 16), key=lambda s: s[0] * s[1])
    shape = run_shape(
        handle.arch,
        list(handle.modules),
        batch_per_rank=config.training.batch_size // (world_size * config.training.accumulate),
        accumulate=config.training.accumulate,
        image_tokens=(width // PIXELS_PER_TOKEN) * (height // PIXELS_PER_TOKEN),
        text_tokens=TEXT_TOKENS,
    )
    gpu = next(gpu for gpu in GPUS if gpu.name == gpu_name)
    return check_plan(
        config,
        count_parameters(handle, split),
        shape,
        world_size=world_size,
        budget_gib=gpu.memory_gib,
        device_name=gpu.device_names[0],
    )


def _stated(recipe: str, pattern: str) -> float:
    match = re.search(pattern, (RECIPES / recipe).read_text(encoding="utf-8"))
    assert match, f"{recipe}'s header does not state {pattern!r}"
    return float(match.group(1))


@pytest.mark.parametrize(("recipe", "model", "gpu", "world_size"), CASES)
def test_recipe_fits_its_gpu_and_states_its_plan(recipe, model, gpu, world_size):
    config = _load(recipe)
    plan = _plan(config, model, gpu, world_size)
    assert plan.fits
    summary = plan.summary()
    assert "estimated time" in summary and gpu in summary and "an estimate" in summary
    # The header's figures are the plan's, rounded (a recipe edited without its header fails here).
    assert _stated(recipe, r"about ([\d.]+) GiB per GPU") == pytest.approx(plan.total_gib, rel=0.05)
    assert _stated(recipe, r"about ([\d.]+) h") == pytest.approx(plan.time.hours, rel=0.1)


@pytest.mark.parametrize("recipe", ["sd35_medium_24gb.toml", "sd35_medium_full_linear_24gb.toml"])
def test_24gb_recipes_train_the_papers_batch_two_samples_at_a_time(recipe):
    config = _load(recipe)
    assert config.training.batch_size == 16 and config.training.batch_size // config.training.accumulate == 2
    assert config.optim.lr == 1e-4 and config.data.shard_size == 8


def test_every_recipe_file_is_checked():
    checked = {param.values[0] for param in CASES} | {"toy_all_hybrid.toml"}  # the toy's: test_config.py
    assert {path.name for path in RECIPES.glob("*.toml")} == checked


def test_large_on_one_24gb_gpu_is_refused_with_the_reason():
    config = _load("sd35_large_80gb.toml", "--training.batch_size", "1")
    with pytest.raises(RuntimeError, match=r"no flag lowers loading, which needs 3\d\.\d GiB") as caught:
        _plan(config, "sd3.5_large", "RTX 4090", 1)
    assert "at least 33 GiB" in str(caught.value) and "training alone would need" in str(caught.value)


def test_a_run_too_big_for_its_gpu_names_flags_that_fit():
    config = _load("sd35_medium_80gb.toml", "--training.gradient_checkpointing", "false")
    with pytest.raises(RuntimeError, match="needs about") as caught:
        _plan(config, "sd3.5_medium", "RTX 4090", 1)
    fixes = str(caught.value).split("Try: ")[1]
    # Accumulation keeps the recipe's global batch of 16, so it comes before the smaller batch.
    assert fixes.index("--training.accumulate 16 (the same global batch, 1 per GPU at a time; about") < fixes.index(
        "--training.batch_size 1 (1 per GPU; about"
    )
    flags = ("--training.batch_size", "4", "--training.accumulate", "1", "--training.gradient_checkpointing", "false")
    config = _load("sd35_medium_24gb.toml", *flags)
    with pytest.raises(RuntimeError, match="--training.gradient_checkpointing true"):
        _plan(config, "sd3.5_medium", "RTX 4090", 1)

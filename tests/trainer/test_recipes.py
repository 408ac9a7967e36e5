"""The hardware recipes in trainer/configs: each fits the GPU it names, states the plan it gets, and
SD3.5 Large on one 24 GB GPU is refused with a message that says what would fit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from testing.trainer_assets import write_images
from trainer.cli import parse_args
from trainer.config import TrainConfig
from trainer.inputs.sources import PARTS_CONFIG_DIR
from trainer.model import CONFIGS_DIR
from trainer.planning.run_plan import RunPlan, plan_whole_run
from trainer.planning.time_estimate import GPUS

RECIPES = CONFIGS_DIR.parent
CASES = [
    pytest.param("sd35_medium_24gb.toml", "sd3.5_medium", "RTX 4090", 1, id="medium-1xRTX4090"),
    pytest.param("sd35_medium_lowrank_24gb.toml", "sd3.5_medium", "RTX 4090", 1, id="medium-lowrank-1xRTX4090"),
    pytest.param("sd35_medium_80gb.toml", "sd3.5_medium", "H100 80GB", 1, id="medium-1xH100"),
    pytest.param("sd35_medium.toml", "sd3.5_medium", "H20", 4, id="medium-4xH20"),
    pytest.param("sd35_large_80gb.toml", "sd3.5_large", "H100 80GB", 1, id="large-1xH100"),
    pytest.param("sd35_large.toml", "sd3.5_large", "H20", 4, id="large-4xH20"),
]


def _load(recipe: str, *flags: str) -> TrainConfig:
    return parse_args(["--config", str(RECIPES / recipe), "--model.base", "m", "--data.path", "d", *flags])


@pytest.fixture(scope="module")
def base_of(tmp_path_factory):
    """A shipped model as a diffusers pipeline folder of configs alone (no weights): all the plan reads."""
    root = tmp_path_factory.mktemp("bases")

    def folder(model: str) -> Path:
        path = root / model
        if not path.exists():
            shutil.copytree(PARTS_CONFIG_DIR, path)
            (path / "transformer").mkdir()
            shutil.copy(CONFIGS_DIR / model / "config.json", path / "transformer" / "config.json")
            (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
        return path

    return folder


@pytest.fixture
def plan(base_of, tmp_path, monkeypatch):
    """What `trainer.planning.run_plan.plan_whole_run` prints for a recipe on `world_size` of `gpu_name`, before
    loading."""
    images = tmp_path / "images"
    write_images(images, [(32, 32)])

    def make(recipe: str, model: str, gpu_name: str, world_size: int, *flags: str) -> RunPlan:
        gpu = next(gpu for gpu in GPUS if gpu.name == gpu_name)
        monkeypatch.setattr("trainer.planning.run_plan.device_budget", lambda *_: (gpu.memory_gib, gpu.device_names[0]))
        config = _load(recipe, "--model.base", str(base_of(model)), "--data.path", str(images),
                       "--output.dir", str(tmp_path / "out"), *flags)  # fmt: skip
        world = SimpleNamespace(world_size=world_size, rank=0, is_main=True, device=torch.device("cpu"))
        return plan_whole_run(config, world)

    return make


def _stated(recipe: str, pattern: str) -> float:
    match = re.search(pattern, (RECIPES / recipe).read_text(encoding="utf-8"))
    assert match, f"{recipe}'s header does not state {pattern!r}"
    return float(match.group(1))


@pytest.mark.parametrize(("recipe", "model", "gpu", "world_size"), CASES)
def test_recipe_fits_its_gpu_and_states_its_plan(plan, recipe, model, gpu, world_size):
    """Every phase fits, preparing the recipe's data included; the header states the training phase's plan (data
    preparation sizes its VAE calls to what the GPU holds)."""
    whole = plan(recipe, model, gpu, world_size)
    assert whole.over_budget() == [] and "preparation: encoding images" in whole.phases
    summary = whole.summary()
    assert "estimated time" in summary and gpu in summary and "an estimate" in summary
    # The header's figures are the plan's, rounded (a recipe edited without its header fails here).
    assert _stated(recipe, r"about ([\d.]+) GiB per GPU") == pytest.approx(whole.phases["training"], rel=0.05)
    assert whole.notes["preparation: encoding images"].endswith(f"{whole.vae_batch} images a VAE call")
    assert _stated(recipe, r"the VAE encodes (\d+) images a call") == whole.vae_batch
    assert _stated(recipe, r"about ([\d.]+) h") == pytest.approx(whole.training.time.hours, rel=0.1)


@pytest.mark.parametrize("recipe", ["sd35_medium_24gb.toml", "sd35_medium_lowrank_24gb.toml"])
def test_24gb_recipes_train_the_papers_batch_two_samples_at_a_time(recipe):
    config = _load(recipe)
    assert config.training.batch_size == 16 and config.training.batch_size // config.training.accumulate == 2
    assert config.optim.lr == 1e-4 and config.data.shard_size == 8


def test_every_recipe_file_is_checked():
    checked = {param.values[0] for param in CASES} | {"toy_all_hybrid.toml"}  # the toy's: test_config.py
    assert {path.name for path in RECIPES.glob("*.toml")} == checked


def test_large_on_one_24gb_gpu_is_refused_with_the_reason(plan):
    """Loading casts frozen weights before they move, so it is training, not loading, that misses a 24 GB card."""
    whole = plan("sd35_large_80gb.toml", "sd3.5_large", "RTX 4090", 1, "--training.batch_size", "1")
    assert whole.over_budget() == ["validation: samples", "training"] and whole.phases["loading"] < 23.6
    with pytest.raises(RuntimeError, match=r"needs about 47\.7 GiB per GPU but has 23\.6 GiB") as caught:
        whole.check()
    assert "training needs about 47.7 GiB. Try: train fewer weights (--model.trainable t5)." in str(caught.value)


def test_a_run_too_big_for_its_gpu_names_flags_that_fit(plan):
    whole = plan("sd35_medium_80gb.toml", "sd3.5_medium", "RTX 4090", 1, "--training.gradient_checkpointing", "false")
    with pytest.raises(RuntimeError, match="needs about") as caught:
        whole.check()
    fixes = str(caught.value).split("training needs about")[1]
    # Accumulation keeps the recipe's global batch of 16, so it comes before the smaller batch.
    assert fixes.index("--training.accumulate 16 (the same global batch, 1 per GPU at a time; about") < fixes.index(
        "--training.batch_size 1 (1 per GPU; about"
    )
    flags = ("--training.batch_size", "4", "--training.accumulate", "1", "--training.gradient_checkpointing", "false")
    with pytest.raises(RuntimeError, match="--training.gradient_checkpointing true"):
        plan("sd35_medium_24gb.toml", "sd3.5_medium", "RTX 4090", 1, *flags).check()

"""The whole run's memory plan: made from configs alone, a phase for each part of the run, checked before the base
loads or any data is prepared."""

from __future__ import annotations

import shutil

import pytest

from testing.trainer_assets import write_images, write_pipeline
from tests.trainer.test_prepare import T5_TOKENS
from trainer.cli import parse_args
from trainer.distributed import init_world
from trainer.inputs.sources import PARTS_CONFIG_DIR, PipelineFiles
from trainer.model import build_model, load_base
from trainer.planning.memory import GIB, PlanDoesNotFit, count_parameters
from trainer.planning.run_plan import (
    CLIP_TOKENS,
    VAE_LIVE_WIDTHS,
    EncoderCounts,
    RunPlan,
    encoder_counts,
    largest_vae_batch,
    plan_whole_run,
    vae_activations_gib,
)
from trainer.train import run


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return write_pipeline(tmp_path_factory.mktemp("pipeline") / "sd3")


@pytest.fixture(scope="module")
def configs_only(pipeline, tmp_path_factory):
    """The pipeline folder without a single weight: what the plan reads."""
    folder = tmp_path_factory.mktemp("configs") / "sd3"
    shutil.copytree(pipeline, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return folder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    write_images(folder, [(32, 32), (40, 30), (30, 40), (64, 48)])
    return folder


def _config(base, images, out, *flags):
    return parse_args(
        [
            "--model.base", str(base), "--data.source", "images", "--data.path", str(images),
            "--data.resolution", "32", "--data.max_sequence_length", str(T5_TOKENS), "--data.buckets", "4:3",
            "--data.shard_size", "4", "--training.batch_size", "2", "--training.steps", "1",
            "--output.dir", str(out), "--output.progress", "false", "--parallel.device", "cpu", *flags,
        ]
    )  # fmt: skip


@pytest.fixture
def world():
    from trainer.config import ParallelConfig

    world = init_world(ParallelConfig(device="cpu"))
    yield world
    world.close()


def test_the_plan_reads_configs_alone_and_counts_what_the_trainer_builds(
    pipeline, configs_only, images, tmp_path, world
):
    plan = plan_whole_run(_config(configs_only, images, tmp_path / "out"), world)
    assert list(plan.phases) == ["loading", "preparation: encoding images", "training"]
    assert plan.budget_gib is None and plan.vae_batch == 0  # a CPU run: nothing to check, whole shards
    config = _config(pipeline, images, tmp_path / "out")
    built = count_parameters(*build_model(load_base(config.model), config))
    assert plan.training == plan_whole_run(config, world).training
    planned = plan.training.components
    assert planned["trained weights+grads+AdamW"] == pytest.approx(built.trained * 16 / GIB)
    assert planned["frozen weights"] == pytest.approx(built.frozen * 4 / GIB)


def test_each_source_plans_its_own_phases(configs_only, images, tmp_path, world):
    prompts = _config(configs_only, images, tmp_path / "p", "--data.source", "prompts", "--data.path", "")
    assert list(plan_whole_run(prompts, world).phases) == [
        "loading", "preparation: embedding prompts", "preparation: generating latents", "training",
    ]  # fmt: skip
    transfer = _config(configs_only, images, tmp_path / "t", "--transfer.steps", "2", "--training.steps", "0")
    assert list(plan_whole_run(transfer, world).phases) == [
        "loading", "preparation: encoding images", "attention transfer",
    ]  # fmt: skip


def test_validation_plans_its_prompts_and_its_samples_beside_the_training_state(configs_only, images, tmp_path, world):
    config = _config(configs_only, images, tmp_path / "v", "--validation.enabled", "true")
    plan = plan_whole_run(config, world)
    assert list(plan.phases) == [
        "loading", "preparation: encoding images", "validation: embedding prompts", "validation: samples", "training",
    ]  # fmt: skip
    assert plan.notes["validation: embedding prompts"] == "4 prompts and the empty one"
    steady = sum(gib for name, gib in plan.training.components.items() if "activations" not in name)
    assert plan.phases["validation: samples"] > steady
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    two = plan_whole_run(_config(configs_only, images, tmp_path / "w", "--validation.enabled", "true",
                                 "--validation.prompts", str(prompts)), world)  # fmt: skip
    assert two.notes["validation: embedding prompts"] == "2 prompts and the empty one"
    assert two.phases["validation: embedding prompts"] < plan.phases["validation: embedding prompts"]


def test_guidance_doubles_what_generation_runs_at_once(configs_only, images, tmp_path, world):
    flags = ("--data.source", "prompts", "--data.path", "", "--data.shard_size", "8")
    unguided = plan_whole_run(
        _config(configs_only, images, tmp_path / "a", *flags, "--data.guidance_scale", "1"), world
    )
    guided = plan_whole_run(_config(configs_only, images, tmp_path / "b", *flags, "--data.guidance_scale", "4"), world)
    assert unguided.notes["preparation: generating latents"] == "8 samples a call"
    assert guided.notes["preparation: generating latents"] == "16 samples a call"
    phase = "preparation: generating latents"
    assert guided.phases[phase] > unguided.phases[phase]


def test_sd35_parts_are_counted_from_their_shipped_configs():
    counts = encoder_counts(PipelineFiles(configs=PARTS_CONFIG_DIR), max_sequence_length=256)
    # CLIP-L, CLIP-G and T5-XXL's encoder; SD3's VAE (8x, 128 channels at full resolution).
    assert counts.text_params == pytest.approx(5.58e9, rel=0.01)
    assert counts.text_tokens == (CLIP_TOKENS, CLIP_TOKENS, 256) and counts.text_widths == (3072, 5120, 10240)
    assert (counts.vae_factor, counts.vae_width) == (8, 128) and counts.vae_params == pytest.approx(83.8e6, rel=0.01)


def test_the_vae_batch_is_the_most_images_that_fit():
    counts = EncoderCounts(
        text_params=0,
        text_tokens=(),
        text_widths=(),
        text_heads=(),
        text_kept=(),
        vae_params=0,
        vae_width=128,
        vae_factor=8,
    )
    one = vae_activations_gib(counts, 1, 1024 * 1024, dtype_bytes=2)
    assert one == pytest.approx(1024 * 1024 * 128 * VAE_LIVE_WIDTHS * 2 / GIB)
    fit = largest_vae_batch(counts, room_gib=3.5 * one, pixels=1024 * 1024, most=64, dtype_bytes=2)
    assert fit == 3
    assert largest_vae_batch(counts, room_gib=100 * one, pixels=1024 * 1024, most=8, dtype_bytes=2) == 8
    assert largest_vae_batch(counts, room_gib=0.5 * one, pixels=1024 * 1024, most=8, dtype_bytes=2) == 0


def test_check_names_each_phase_over_the_budget_and_what_would_fit():
    from trainer.planning.memory import MemoryPlan

    plan = RunPlan(
        phases={"loading": 3.0, "preparation: encoding images": 9.0, "training": 12.0},
        budget_gib=10.0,
        training=MemoryPlan({"activations": 12.0}, 10.0),
        hints={"loading": "", "preparation: encoding images": "lower it", "training": "--training.accumulate 2"},
    )
    with pytest.raises(PlanDoesNotFit) as caught:
        plan.check()
    message = str(caught.value)
    assert message.startswith("the run needs about 12.0 GiB per GPU but has 10.0 GiB (planned before loading")
    assert message.endswith("training needs about 12.0 GiB. Try: --training.accumulate 2.")
    assert "preparation" not in message and "\n" not in message
    RunPlan(phases={"loading": 3.0}, budget_gib=None, training=plan.training).check()


def test_a_budget_too_small_refuses_before_the_base_loads_or_data_is_prepared(pipeline, images, tmp_path, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("loaded or prepared before the plan was checked")

    monkeypatch.setattr("trainer.train.load_base", refuse)
    monkeypatch.setattr("trainer.inputs.prepare.prepare_data", refuse)
    out = tmp_path / "out"
    with pytest.raises(PlanDoesNotFit, match=r"but has 0\.5 GiB \(planned before loading anything"):
        run(_config(pipeline, images, out, "--parallel.gpu_memory_gib", "0.5"))
    assert not (out / "data-cache").exists()


def test_the_run_encodes_with_the_vae_batch_its_plan_sized(pipeline, images, tmp_path, monkeypatch):
    """With a budget, preparation encodes as many images a VAE call as the plan sized (here made 2 of a shard of 4)."""
    from diffusers import AutoencoderKL

    sized = []
    monkeypatch.setattr(
        "trainer.planning.run_plan.largest_vae_batch", lambda *args, **kwargs: sized.append(kwargs) or 2
    )
    calls = []
    encode = AutoencoderKL.encode
    monkeypatch.setattr(AutoencoderKL, "encode", lambda self, x, **kw: calls.append(len(x)) or encode(self, x, **kw))
    config = _config(pipeline, images, tmp_path / "out", "--parallel.gpu_memory_gib", "80")
    world = init_world(config.parallel)
    try:
        before = plan_whole_run(config, world)
    finally:
        world.close()
    run(config)
    assert sized[0]["most"] == 4 and 0 < sized[0]["room_gib"] < 80 - 2
    assert calls and max(calls) == 2
    # Once the cache is finished, a rerun plans no preparation and reads the cache's shapes.
    world = init_world(config.parallel)
    try:
        again = plan_whole_run(config, world)
    finally:
        world.close()
    assert list(again.phases) == ["loading", "training"] and again.training == before.training

"""Validation of an SD3-family run on the tiny pipeline: sample grids, the held-out loss, the held-out split,
the report and card, and a resume that reuses the encoded prompts."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from t5core.hosts.diffusers import linearize
from testing.trainer_assets import RECIPE_FLAGS, write_cache, write_pipeline
from trainer.cli import parse_args
from trainer.data import BatchPlan
from trainer.inputs.cache import CacheSource
from trainer.metrics import read_metrics
from trainer.model import load_base
from trainer.train import run
from trainer.validation import (
    GRID_HEADER,
    GRID_LABEL_WIDTH,
    GRID_PAD,
    grid_name,
    holdout_batches,
    holdout_indices,
)

# write_cache's buckets are latents (8, 12) and (12, 8): no square one, so samples take the first smallest,
# 8 x 12 latents, which the tiny VAE (2x) decodes to 24 x 16 pixels.
SAMPLE_WIDTH, SAMPLE_HEIGHT = 24, 16
HOLDOUT = 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    return dict(pipeline=write_pipeline(root / "sd3"), cache=write_cache(root / "cache", per_bucket=6))


def config_for(inputs, out, *flags):
    return parse_args(
        [
            "--model.base", str(inputs["pipeline"]),
            "--data.source", "cache",
            "--data.path", str(inputs["cache"]),
            "--data.max_sequence_length", "8",
            "--model.layers", "all",
            "--training.batch_size", "4",
            "--output.dir", str(out),
            "--output.progress", "false",
            *RECIPE_FLAGS,
            "--validation.enabled", "true",
            "--validation.samples_steps", "2",
            "--validation.holdout", str(HOLDOUT),
            *flags,
        ]
    )  # fmt: skip


def grid_size(rows: int, columns: int) -> tuple[int, int]:
    return (
        GRID_LABEL_WIDTH + columns * (SAMPLE_WIDTH + GRID_PAD),
        GRID_HEADER + rows * (SAMPLE_HEIGHT + GRID_PAD),
    )


def direct_loss(model, batches) -> float:
    """The flow-matching loss written out, one sample at a time: x_t = (1 - s) x0 + s eps, target eps - x0."""
    total = []
    with torch.no_grad():
        for batch, noise, sigmas in batches:
            for row, sigma in enumerate(sigmas):
                x0, eps = batch.latents[row : row + 1], noise[row : row + 1]
                velocity = model(
                    hidden_states=(1 - sigma) * x0 + sigma * eps,
                    encoder_hidden_states=batch.context[row : row + 1],
                    pooled_projections=batch.pooled[row : row + 1],
                    timestep=(sigma * 1000).view(1),
                    return_dict=False,
                )[0]
                total.append((velocity - (eps - x0)).square().mean().item())
    return sum(total) / len(total)


def held_out_inputs(inputs, config):
    source = CacheSource(inputs["cache"])
    held = holdout_indices(source.buckets(), count=HOLDOUT, seed=config.validation.seed, batch_size=4)
    return held, holdout_batches(source, held, seed=config.validation.seed, shift=config.loss.shift, batch_size=4)


@pytest.fixture(scope="module")
def finished(inputs, tmp_path_factory):
    """One 4-step run validated every 2 steps."""
    out = tmp_path_factory.mktemp("run")
    config = config_for(inputs, out, "--training.steps", "4", "--validation.every", "2")
    return config, run(config)


def test_grids_at_the_start_every_n_steps_and_the_end(finished):
    config, result = finished
    folder = result.output_dir / "validation"
    for step in (0, 2, 4):
        with Image.open(folder / grid_name(step)) as grid:
            # rows: the 4 default prompts; columns: the teacher and T5 at the step
            assert grid.size == grid_size(4, 2)
    assert sorted(path.name for path in folder.glob("step_*.png")) == [grid_name(s) for s in (0, 2, 4)]
    assert (folder / "latest.png").read_bytes() == (folder / grid_name(4)).read_bytes()


def test_metrics_lines_carry_the_held_out_losses(finished):
    config, result = finished
    lines = {line["step"]: line for line in read_metrics(result.output_dir / "metrics.jsonl")}
    assert sorted(lines) == [0, 1, 2, 3, 4]
    assert set(lines[0]) == {"step", "val/loss", "val/teacher_loss"}
    assert "val/loss" in lines[2] and "val/loss" in lines[4] and "loss/total" in lines[4]
    assert "val/loss" not in lines[1] and "val/loss" not in lines[3]
    assert "val/teacher_loss" not in lines[4]


def test_held_out_loss_is_the_flow_loss_on_the_held_out_samples(inputs, finished):
    config, result = finished
    lines = {line["step"]: line for line in read_metrics(result.output_dir / "metrics.jsonl")}
    _, batches = held_out_inputs(inputs, config)
    assert sum(len(batch) for batch, _, _ in batches) == HOLDOUT
    # Batched in the run, one sample at a time here: the sums differ only in order.
    trained = direct_loss(result.handle.model.eval(), batches)
    assert lines[4]["val/loss"] == pytest.approx(trained, rel=1e-5)
    teacher = direct_loss(load_base(config.model), batches)
    assert lines[0]["val/teacher_loss"] == pytest.approx(teacher, rel=1e-5)
    assert lines[4]["val/loss"] != pytest.approx(lines[0]["val/loss"], rel=1e-6)  # training moved it


def test_report_and_model_card_hold_the_validation(finished):
    config, result = finished
    lines = {line["step"]: line for line in read_metrics(result.output_dir / "metrics.jsonl")}
    entry = json.loads((result.output_dir / "report.json").read_text())["validation"]
    folder = result.output_dir / "validation"
    assert entry["held_out_samples"] == HOLDOUT and entry["prompts"] == 4
    assert entry["teacher_loss"] == lines[0]["val/teacher_loss"]
    assert (entry["start_step"], entry["start_loss"]) == (0, lines[0]["val/loss"])
    assert (entry["end_step"], entry["end_loss"]) == (4, lines[4]["val/loss"])
    assert entry["grids"] == [str(folder / grid_name(step)) for step in (0, 2, 4)]
    card = (result.output_dir / "README.md").read_text()
    section = card[card.index("## Validation") :]
    assert f"| softmax teacher (the base) | {lines[0]['val/teacher_loss']:.4f} |" in section
    assert f"| T5 at step 0 | {lines[0]['val/loss']:.4f} |" in section
    assert f"| T5 at step 4 | {lines[4]['val/loss']:.4f} |" in section
    assert f"`validation/{grid_name(4)}`" in section


def test_held_out_samples_never_reach_a_training_batch():
    buckets = {(8, 12): list(range(0, 9)), (12, 8): list(range(9, 30))}
    held = holdout_indices(buckets, count=6, seed=3, batch_size=4)
    assert len(held) == 6 and held == holdout_indices(buckets, count=6, seed=3, batch_size=4)
    assert held != holdout_indices(buckets, count=6, seed=4, batch_size=4)
    plan = BatchPlan(buckets, batch_size=4, seed=0, exclude=held)
    drawn = {index for step in range(3 * plan.batches_per_epoch) for index in plan.global_indices(step)}
    assert not drawn & set(held)


def test_a_bucket_left_without_a_full_batch_is_skipped_not_an_error():
    buckets = {(8, 12): [0, 1, 2, 3], (12, 8): list(range(4, 12))}
    plan = BatchPlan(buckets, batch_size=4, seed=0, exclude=[2])
    assert plan.batches_per_epoch == 2
    assert all(min(plan.global_indices(step)) >= 4 for step in range(6))


def test_holding_out_too_many_samples_is_a_clear_error(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"--validation.holdout 9: the data has 12 samples.*Lower --validation"):
        run(config_for(inputs, tmp_path, "--training.steps", "1", "--validation.holdout", "9"))
    assert not (tmp_path / "validation").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--validation.holdout", "-1"], "--validation.holdout: must not be negative", id="holdout"),
        pytest.param(["--validation.every", "-5"], "--validation.every: must not be negative", id="every"),
        pytest.param(["--validation.guidance_scale", "0.5"], "--validation.guidance_scale", id="guidance"),
        pytest.param(["--validation.enabled", "true"], "--validation.enabled: the toy base is evaluated", id="toy"),
    ],
)
def test_bad_validation_settings_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args(flags)


def test_a_run_from_a_file_validates_without_a_teacher(inputs, finished, tmp_path):
    _, trained = finished
    config = config_for(inputs, tmp_path, "--training.steps", "2", "--model.start_from", str(trained.weights))
    run(config)
    lines = {line["step"]: line for line in read_metrics(tmp_path / "metrics.jsonl")}
    # The file's deltas are in the inherited weights from the start: no softmax teacher to sample or measure.
    assert set(lines[0]) == {"step", "val/loss"} and "val/loss" in lines[2]
    assert not (tmp_path / "validation" / "teacher.safetensors").exists()
    # Step 0 measures the file as it is on this base.
    _, batches = held_out_inputs(inputs, config)
    as_is = linearize(load_base(config.model), weights=trained.weights).model.eval()
    assert lines[0]["val/loss"] == pytest.approx(direct_loss(as_is, batches), rel=1e-4)
    for step in (0, 2):
        with Image.open(tmp_path / "validation" / grid_name(step)) as grid:
            assert grid.size == grid_size(4, 1)  # T5's column only
    entry = json.loads((tmp_path / "report.json").read_text())["validation"]
    assert "teacher_loss" not in entry and (entry["start_loss"], entry["end_loss"]) == (
        lines[0]["val/loss"],
        lines[2]["val/loss"],
    )


def test_resume_reuses_the_encoded_prompts_and_the_teacher_samples(inputs, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n# not a prompt\na blue boat\n\na green hill\n")
    out = tmp_path / "run"
    flags = ("--validation.prompts", str(prompts), "--validation.every", "2")
    run(config_for(inputs, out, "--training.steps", "2", *flags))
    folder = out / "validation"
    stamps = {name: (folder / name).stat().st_mtime_ns for name in ("prompts.safetensors", "teacher.safetensors")}

    def no_text_encoders(*args, **kwargs):
        raise AssertionError("the resumed run loaded the text encoders again")

    monkeypatch.setattr("trainer.inputs.prepare.load_encoding_pipeline", no_text_encoders)
    result = run(config_for(inputs, out, "--training.steps", "4", *flags))
    assert result.step == 4
    assert {name: (folder / name).stat().st_mtime_ns for name in stamps} == stamps
    lines = {line["step"]: line for line in read_metrics(out / "metrics.jsonl")}
    assert sorted(lines) == [0, 1, 2, 3, 4] and "val/loss" in lines[4]
    with Image.open(folder / grid_name(0)) as start, Image.open(folder / grid_name(4)) as end:
        assert start.size == end.size == grid_size(3, 2)
        # The teacher's column of the resumed run's grid: the start's samples, read back and decoded alike.
        teacher = (GRID_LABEL_WIDTH, GRID_HEADER, GRID_LABEL_WIDTH + SAMPLE_WIDTH, start.height)
        assert start.crop(teacher).tobytes() == end.crop(teacher).tobytes()
    entry = json.loads((out / "report.json").read_text())["validation"]
    assert entry["teacher_loss"] == lines[0]["val/teacher_loss"] and entry["end_step"] == 4

"""ToyEval reads attributes off pixels: perfect renders score near 1, noise and wrong captions near chance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sd3_testbed.data import COLORS, Caption, decode_latents, make_batch, render
from sd3_testbed.eval import read_images, sample_hits, score_images, teacher_distance, validation_loss
from sd3_testbed.model import build_toy_model

CHANCE = {"color": 1 / 6, "shape": 1 / 3, "position": 1 / 5, "size": 1 / 2}


def test_perfect_renders_score_near_one():
    batch = make_batch(360, seed=123)
    score = score_images(batch.images, batch.captions)
    assert score.readable == 1.0
    # Rasterisation makes a rare small circle look square (fill ratio); 2 % covers that.
    for name in ("color", "shape", "position", "size", "overall"):
        assert getattr(score, name) >= 0.98, (name, score)


@pytest.mark.parametrize(
    "images",
    [
        pytest.param(lambda g: torch.rand(200, 3, 32, 32, generator=g), id="uniform-pixels"),
        pytest.param(lambda g: decode_latents(torch.randn(200, 16, 16, 16, generator=g)), id="gaussian-latents"),
        pytest.param(lambda g: torch.zeros(200, 3, 32, 32), id="black"),
    ],
)
def test_noise_scores_at_most_chance(images):
    captions = make_batch(200, seed=5).captions
    score = score_images(images(torch.Generator().manual_seed(0)), captions)
    assert score.overall <= 1 / 180 + 0.01
    for name, chance in CHANCE.items():
        assert getattr(score, name) <= chance + 0.05, (name, score)


def test_renders_against_unrelated_captions_score_near_chance():
    images = make_batch(720, seed=1).images
    captions = make_batch(720, seed=2).captions
    score = score_images(images, captions)
    for name, chance in CHANCE.items():
        assert abs(getattr(score, name) - chance) < 0.07, (name, score)
    assert score.overall < 0.03


@pytest.mark.parametrize(
    "field, wrong",
    [
        pytest.param("color", "green", id="color"),
        pytest.param("shape", "triangle", id="shape"),
        pytest.param("position", "center", id="position"),
        pytest.param("size", "small", id="size"),
    ],
)
def test_one_wrong_attribute_fails_only_that_attribute(field, wrong):
    truth = Caption(size="large", color="red", shape="circle", position="top right")
    image = render([truth], generator=torch.Generator().manual_seed(0))
    hits = sample_hits(image, [dataclasses.replace(truth, **{field: wrong})])[0]
    assert hits[field] is False and hits["overall"] is False
    assert all(hits[name] for name in CHANCE if name != field)


def test_reading_ignores_a_stray_pixel_blob():
    truth = Caption(size="large", color="yellow", shape="triangle", position="bottom left")
    image = render([truth], generator=torch.Generator().manual_seed(0)).clone()
    image[0, :, 1:3, 28:30] = torch.tensor(COLORS["cyan"]).view(3, 1, 1)
    reading = read_images(image)[0]
    assert (reading.color, reading.shape, reading.position, reading.size) == (
        "yellow",
        "triangle",
        "bottom left",
        "large",
    )


def test_score_rejects_caption_count_mismatch():
    with pytest.raises(ValueError, match="one caption per image"):
        score_images(torch.zeros(3, 3, 32, 32), make_batch(2, seed=0).captions)


def test_teacher_distance():
    images = make_batch(4, seed=0).images
    assert teacher_distance(images, images) == 0.0
    assert teacher_distance(images, 1 - images) > 0.1
    with pytest.raises(ValueError, match="differ in shape"):
        teacher_distance(images, images[:2])


def test_validation_loss_is_deterministic():
    model = build_toy_model(seed=0).eval()
    first = validation_loss(model, batches=1, batch_size=4)
    assert first == validation_loss(model, batches=1, batch_size=4)
    assert 0.0 < first < 10.0

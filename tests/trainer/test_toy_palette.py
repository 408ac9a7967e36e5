"""Toy palettes: the default leaves every batch as it was, another palette renders each colour word in its
colour and ToyEval reads it back in that palette; a fine-tune of the teacher trains on one."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace

import pytest
import torch

from sd3_testbed import pretrain
from sd3_testbed.data import COLORS, PALETTES, make_batch
from sd3_testbed.eval import score_images
from sd3_testbed.model import load_toy_base
from sd3_testbed.pretrain import PretrainConfig, train_teacher

DEFAULT_IMAGES_SHA256 = "38b0d38f0669c08400738860b420526a2f9253882fff8b0e472b02c941b402f5"
"""sha256 of `make_batch(64, seed=2026, drop_text=0.3).images` as rendered before palettes existed."""


def test_the_default_palette_renders_what_the_toy_always_rendered():
    assert PALETTES["default"] is COLORS
    images = make_batch(64, seed=2026, drop_text=0.3).images
    assert hashlib.sha256(images.numpy().tobytes()).hexdigest() == DEFAULT_IMAGES_SHA256
    assert torch.equal(make_batch(64, seed=2026, drop_text=0.3, palette=COLORS).images, images)


@pytest.mark.parametrize("name", [pytest.param(name, id=name) for name in PALETTES])
def test_a_palette_renders_each_word_in_its_colour_and_is_read_back(name):
    palette = PALETTES[name]
    batch = make_batch(360, seed=123, palette=palette)
    for image, caption in zip(batch.images, batch.captions, strict=True):
        colours = image[:, image.amax(0) > 0].T.unique(dim=0)
        torch.testing.assert_close(colours, torch.tensor([palette[caption.color]]), rtol=0, atol=0)
    score = score_images(batch.images, batch.captions, palette=palette)
    # as for the default palette: rasterisation makes a rare small circle look square
    for attribute in ("color", "shape", "position", "size", "overall"):
        assert getattr(score, attribute) >= 0.98, (attribute, score)


def test_the_rotated_palette_gives_every_word_another_colour_in_the_same_scene():
    default, rotated = make_batch(48, seed=7), make_batch(48, seed=7, palette=PALETTES["rotated"])
    assert rotated.captions == default.captions
    assert torch.equal(rotated.images.amax(1) > 0, default.images.amax(1) > 0)
    assert torch.equal(rotated.encoder_hidden_states, default.encoder_hidden_states)
    # read in the teacher's palette, no object has its caption's colour
    assert score_images(rotated.images, rotated.captions).color == 0.0
    assert score_images(rotated.images, rotated.captions, palette=PALETTES["rotated"]).color == 1.0


@pytest.mark.parametrize(
    ("palette", "match"),
    [
        pytest.param({k: v for k, v in COLORS.items() if k != "cyan"}, "exactly the words", id="missing-word"),
        pytest.param({**COLORS, "orange": (1.0, 0.5, 0.0)}, "exactly the words", id="extra-word"),
        pytest.param({**COLORS, "red": (1.5, 0.1, 0.1)}, "'red' .* in \\[0, 1\\]", id="out-of-range"),
        pytest.param({**COLORS, "red": (1.0, 0.1)}, "'red' .* three RGB values", id="two-channels"),
    ],
)
def test_a_bad_palette_is_refused_when_rendering_and_reading(palette, match):
    with pytest.raises(ValueError, match=match):
        make_batch(2, seed=0, palette=palette)
    batch = make_batch(2, seed=0)
    with pytest.raises(ValueError, match=match):
        score_images(batch.images, batch.captions, palette=palette)


def test_pretrain_refuses_an_unknown_palette_and_a_fine_tune_over_the_shipped_teacher(capsys):
    with pytest.raises(ValueError, match="--palette must be one of \\('default', 'rotated'\\); got 'sepia'"):
        PretrainConfig(palette="sepia")
    with pytest.raises(SystemExit):
        pretrain.main(["--init", "teacher", "--palette", "rotated"])
    assert "--init teacher fine-tunes the shipped teacher" in capsys.readouterr().err


def test_a_fine_tune_starts_from_the_teacher_and_trains_on_its_palette(monkeypatch):
    palettes = []

    def recorded(*args, palette, **kwargs):
        palettes.append(palette)
        return make_batch(*args, palette=palette, **kwargs)

    monkeypatch.setattr(pretrain, "make_batch", recorded)
    cfg = PretrainConfig(init="teacher", palette="rotated", steps=2, batch_size=2, lr=1e-9, warmup=0)
    model, _ = train_teacher(cfg, progress=False)
    assert palettes == [PALETTES["rotated"]] * 2
    teacher = load_toy_base().state_dict()
    # two steps at lr 1e-9 move no weight by more than 2e-9 (Adam's step is at most the rate)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, teacher[name], rtol=0, atol=1e-8)


def test_record_only_keeps_the_recorded_recipe_and_takes_the_evaluation_flags(tmp_path):
    trained = PretrainConfig(init="teacher", palette="rotated", steps=7, eval_count=180)
    assert "eval_count" not in trained.training() and trained.training()["palette"] == "rotated"
    out = pretrain.export_teacher(load_toy_base(), tmp_path / "ft.safetensors", trained)
    record = {"recipe": asdict(trained), "train_seconds": 1.0, "final_train_loss": 0.5}
    out.with_suffix(".json").write_text(json.dumps(record))
    assert pretrain.main(["--record-only", "--out", str(out), "--eval-count", "2", "--eval-steps", "1"]) == 0
    recorded = json.loads(out.with_suffix(".json").read_text())
    assert recorded["recipe"] == asdict(replace(trained, eval_count=2, eval_steps=1))
    assert recorded["toyeval"]["count"] == 2

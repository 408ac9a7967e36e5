"""The shipped teacher's stored ToyEval samples: the run's evaluation takes them only when they fit."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from sd3_testbed.eval import eval_set, generate
from sd3_testbed.model import WEIGHTS_FILE, load_toy_base
from sd3_testbed.reference import TOY_EVAL, EvalSettings, samples_file, save_teacher_samples, teacher_samples


@pytest.fixture
def teacher_file(tmp_path):
    path = tmp_path / "teacher.safetensors"
    shutil.copyfile(WEIGHTS_FILE, path)
    return path


def test_the_shipped_samples_are_the_shipped_teacher_sampled_here():
    stored = teacher_samples(180)
    assert stored is not None, (
        f"{samples_file(WEIGHTS_FILE)} is missing or stale: python -m sd3_testbed.pretrain --record-only"
    )
    captions, noise = eval_set(4, seed=TOY_EVAL.seed)
    fresh = generate(load_toy_base(), captions, noise, steps=TOY_EVAL.steps, cfg=TOY_EVAL.cfg, clamp=False)
    # another CPU or torch build rounds differently over the 20 steps; the scores read far coarser levels
    torch.testing.assert_close(stored[:4], fresh, atol=2e-3, rtol=0)


def test_stored_samples_round_trip_and_serve_any_smaller_set(teacher_file):
    raw = torch.randn(6, 3, 48, 48)
    save_teacher_samples(raw, TOY_EVAL, teacher=teacher_file)
    assert torch.equal(teacher_samples(6, teacher=teacher_file), raw)
    assert torch.equal(teacher_samples(4, teacher=teacher_file), raw[:4])
    assert teacher_samples(7, teacher=teacher_file) is None


@pytest.mark.parametrize(
    "other", [EvalSettings(seed=1), EvalSettings(steps=10), EvalSettings(cfg=1.0), EvalSettings(size=32)]
)
def test_samples_made_with_other_settings_are_not_used(teacher_file, other, caplog):
    caplog.set_level(logging.INFO, logger="sd3_testbed.reference")
    save_teacher_samples(torch.zeros(2, 3, 48, 48), TOY_EVAL, teacher=teacher_file)
    assert teacher_samples(2, other, teacher=teacher_file) is None
    assert "do not fit" in caplog.text


def test_samples_of_another_teacher_are_not_used(teacher_file):
    save_teacher_samples(torch.zeros(2, 3, 48, 48), TOY_EVAL, teacher=teacher_file)
    teacher_file.write_bytes(teacher_file.read_bytes() + b" ")  # the teacher retrained: another file
    assert teacher_samples(2, teacher=teacher_file) is None
    assert teacher_samples(2, teacher=teacher_file.with_name("absent.safetensors")) is None

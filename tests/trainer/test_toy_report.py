"""Teacher vs student comparison and its PNG grid."""

from __future__ import annotations

import copy

import torch
from PIL import Image

from trainer.toy.model import build_toy_model
from trainer.toy.report import compare, write_grid


def test_compare_same_model_has_zero_distance_and_equal_scores(tmp_path):
    teacher = build_toy_model(seed=0).eval()
    student = copy.deepcopy(teacher)
    result = compare(teacher, student, count=5, steps=1)
    assert result.distance == 0.0
    assert result.teacher_score == result.student_score
    assert result.teacher_val_loss == result.student_val_loss
    assert "| T5 |" in result.table()
    path = write_grid(tmp_path / "grid.png", result, columns=4, scale=2)
    with Image.open(path) as image:
        # 2 row pairs (5 samples, 4 columns), each 32 + 32 pixels plus a 2-pixel separator, x2.
        assert image.size == (4 * 32 * 2, 2 * 66 * 2)


def test_compare_different_students_differ():
    teacher = build_toy_model(seed=0).eval()
    student = build_toy_model(seed=1).eval()
    result = compare(teacher, student, count=3, steps=1)
    assert result.distance > 0
    assert not torch.equal(result.teacher_images, result.student_images)

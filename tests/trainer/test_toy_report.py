"""Teacher vs student comparison and its PNG grid."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from sd3_testbed.artifacts import background_level, open_background_level, token_period_energy
from sd3_testbed.data import IMAGE_SIZE
from sd3_testbed.eval import eval_set, generate, sample_hits
from sd3_testbed.model import build_toy_model
from sd3_testbed.reference import EvalSettings
from sd3_testbed.report import compare, write_grid
from trainer.publishing.export import write_report

ONE_STEP = EvalSettings(steps=1)


def test_compare_same_model_has_zero_distance_and_equal_scores(tmp_path):
    teacher = build_toy_model(seed=0).eval()
    student = copy.deepcopy(teacher)
    result = compare(teacher, student, count=5, settings=ONE_STEP)
    assert result.distance == 0.0
    assert result.teacher_score == result.student_score
    assert result.teacher_val_loss == result.student_val_loss
    assert "| T5 |" in result.table()
    path = write_grid(tmp_path / "grid.png", result, columns=4, scale=2)
    with Image.open(path) as image:
        pixels = torch.from_numpy(np.asarray(image.convert("RGB"))).permute(2, 0, 1).float() / 255
    # 2 blocks (5 samples, 4 columns) of tiles (image side x 2, 4 pixels apart) after a title margin,
    # each block a caption band, then the teacher's and the student's row; the sample pixels unchanged.
    tile = 2 * IMAGE_SIZE
    width, height = pixels.shape[2], pixels.shape[1]
    margin = width - 4 * (tile + 4)
    assert margin > 0 and height % 2 == 0
    block = height // 2
    band = block - 2 * tile - 2 * 4
    first = pixels[:, band : band + tile : 2, margin : margin + tile : 2]
    torch.testing.assert_close(first, result.teacher_images[0].clamp(0, 1), atol=1 / 255, rtol=0)
    # the titles and captions are drawn: the margin and the caption band are not blank
    assert pixels[:, band:, :margin].std() > 0 and pixels[:, :band, margin:].std() > 0


def test_compare_different_students_differ():
    teacher = build_toy_model(seed=0).eval()
    student = build_toy_model(seed=1).eval()
    result = compare(teacher, student, count=3, settings=ONE_STEP)
    assert result.distance > 0
    assert not torch.equal(result.teacher_images, result.student_images)


def test_the_comparison_reports_the_paired_interval_and_the_artifact_measures(capsys):
    teacher = build_toy_model(seed=0).eval()
    student = build_toy_model(seed=1).eval()
    result = compare(teacher, student, count=3, settings=ONE_STEP, progress=True)
    report = result.as_dict()
    student_hits, teacher_hits = (
        [int(hit["overall"]) for hit in sample_hits(images, result.captions)]
        for images in (result.student_images, result.teacher_images)
    )
    difference = (sum(student_hits) - sum(teacher_hits)) / 3
    paired = report["paired"]
    assert paired["mean"] == difference and paired["low"] <= difference <= paired["high"] and paired["samples"] == 3
    assert report["teacher"]["background"] == background_level(result.teacher_images, result.teacher_images)
    assert report["student"]["open_background"] == open_background_level(result.student_images, result.teacher_images)
    assert report["student"]["token_period_energy"] == token_period_energy(result.student_images, result.teacher_images)
    for key, images in (("teacher", result.teacher_images), ("student", result.student_images)):
        # before the clamp: the mean cannot exceed the mean of its part above black, which is the level seen
        error, level = report[key]["background_error"], open_background_level(images, result.teacher_images)
        assert error["bias"] <= level + 1e-7 and (error["lit"] > 0) == (level > 0) and error["noise"] >= 0
    table = result.table()
    assert "95% interval" in table and "| background | open background | token-period energy |" in table
    assert "| model | bias | noise | token pattern | share above black |" in table
    # the progress bar counts the sampling batches of both models
    assert "ToyEval: 100%" in capsys.readouterr().err


def test_the_run_report_renders_sections_as_tables(tmp_path):
    report = {"step": 2, "stop_reason": "steps", "toy_eval": {"teacher": {"toyeval": {"overall": 0.70612}}}}
    _, markdown = write_report(tmp_path, report)
    text = markdown.read_text()
    assert "## toy_eval\n\n| | |\n|---|---|\n| teacher.toyeval.overall | 0.7061 |" in text
    assert "{" not in text


def test_known_teacher_samples_give_the_same_comparison_without_sampling_the_teacher():
    teacher = build_toy_model(seed=0).eval()
    student = build_toy_model(seed=1).eval()
    sampled = compare(teacher, student, count=3, settings=ONE_STEP)
    captions, noise = eval_set(3)
    teacher_raw = generate(teacher, captions, noise, steps=1, clamp=False)
    calls = []
    teacher.register_forward_hook(lambda *_: calls.append(1))
    known = compare(teacher, student, count=3, settings=ONE_STEP, teacher_raw=teacher_raw)
    assert known.as_dict() == sampled.as_dict()
    assert len(calls) == 4  # the validation loss's 4 batches; no sampling step


def test_known_teacher_samples_of_another_set_are_refused():
    teacher = build_toy_model(seed=0).eval()
    with pytest.raises(ValueError, match="3 samples of 48 px expected"):
        compare(teacher, teacher, count=3, settings=ONE_STEP, teacher_raw=torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE))

"""The frontier picture: points are each row's means over seeds, and every recipe's line is drawn."""

from __future__ import annotations

import pytest
from PIL import Image

from experiments.frontier_plot import COLOURS, RECIPE_LINES, draw_frontier, frontier_points


def _row(name: str, seed: int, seconds: float, toyeval: float, val_loss: float) -> dict:
    return {"row": name, "seed": seed, "train_seconds": seconds, "toyeval": {"overall": toyeval}, "val_loss": val_loss}


RESULTS = [
    _row("teacher", 0, 3, 0.70, 0.02),
    _row("run-paper", 0, 100, 0.68, 0.03),
    _row("run-paper", 1, 110, 0.66, 0.03),
    _row("run-all-hybrid", 0, 150, 0.60, 0.04),
    _row("run-all-hybrid-4x", 0, 600, 0.71, 0.021),
    _row("run-all-hybrid-transfer", 0, 50, 0.30, 0.08),
    _row("run-all-hybrid-transfer-r16-1x", 0, 200, 0.62, 0.035),
    _row("run-all-hybrid-transfer-r16-1x-lr10", 0, 200, 0.64, 0.032),
    _row("run-all-hybrid-transfer40-full", 0, 120, 0.62, 0.03),
]


def test_points_are_means_over_seeds_against_the_teacher():
    points, teacher = frontier_points(RESULTS)
    assert teacher == 0.70 and "teacher" not in points
    paper = points["run-paper"]
    assert paper.seconds == 105 and paper.toyeval == pytest.approx(0.67) and paper.loss_ratio == pytest.approx(1.5)


def test_results_without_the_teacher_are_refused():
    with pytest.raises(ValueError, match="no `teacher` row"):
        frontier_points(RESULTS[1:])


def test_the_picture_draws_every_recipe(tmp_path):
    path = draw_frontier(*frontier_points(RESULTS), tmp_path / "frontier.png")
    with Image.open(path) as image:
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 16)}
    assert len(RECIPE_LINES) == len(COLOURS) and set(COLOURS) <= colours

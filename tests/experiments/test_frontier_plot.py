"""The frontier: points are each row's means over seeds, the table names the goals each row misses, and
every recipe's line is drawn."""

from __future__ import annotations

import math

import pytest
from PIL import Image

from experiments.ablations import FRONTIER_ROWS
from experiments.frontier_plot import (
    COLOURS,
    RECIPE_LINES,
    draw_frontier,
    frontier_points,
    frontier_table,
    missed_goals,
    nice_ticks,
)
from sd3_testbed.stats import paired_difference, paired_runs


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


def test_every_recipe_line_runs_through_frontier_rows():
    frontier = {row.name for row in FRONTIER_ROWS}
    assert all(set(rows) <= frontier for rows in RECIPE_LINES.values())


def test_the_legend_names_only_the_recipes_with_rows(tmp_path):
    drawn = [r for r in RESULTS if not r["row"].endswith("-lr10")]
    path = draw_frontier(*frontier_points(drawn), tmp_path / "frontier.png")
    lr10 = list(RECIPE_LINES).index("all hybrid, transfer then rank 16, factors 10x")
    with Image.open(path) as image:
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 16)}
    assert COLOURS[lr10] not in colours and set(COLOURS) - {COLOURS[lr10]} <= colours


@pytest.mark.parametrize(("low", "high"), [(0, 239), (0.59, 0.75), (0.9, 1.66), (0, 630), (0.6312, 0.6318), (3, 4e4)])
def test_ticks_are_round_and_cover_the_range(low, high):
    ticks = nice_ticks(low, high)
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1 and ticks[0] <= low and ticks[-1] >= high and 4 <= len(ticks) <= 8
    (step,) = steps
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5))
    assert ticks[0] + step > low and ticks[-1] - step < high


TEACHER_HITS = [1, 1, 0, 1, 0, 1, 1, 0]


def _kept(name: str, seed: int, seconds: float, hits: list[int], val_loss: float, noise: float, token: float) -> dict:
    """A row with per-sample hits and raw-decode background errors, as the sweep writes them."""
    row = _row(name, seed, seconds, sum(hits) / len(hits), val_loss)
    return row | {"hits": hits, "background_error": {"noise": noise, "token_pattern": token}}


KEPT = [
    _kept("teacher", 0, 3, TEACHER_HITS, 0.02, 0.010, 0.004),
    _kept("run-paper", 0, 100, TEACHER_HITS, 0.03, 0.015, 0.006),
    _kept("run-paper", 1, 100, [1, 1, 0, 1, 0, 1, 0, 0], 0.03, 0.014, 0.006),
    _kept("run-all-hybrid", 0, 90, TEACHER_HITS, 0.021, 0.012, 0.005),
    _kept("run-all-hybrid-4x", 1, 400, TEACHER_HITS, 0.021, 0.012, 0.005),
    _kept("run-all-hybrid-4x", 0, 400, [1, 1, 1, 1, 1, 1, 1, 1], 0.023, 0.013, 0.003),
]


def test_points_pair_each_row_with_the_teacher_by_seed():
    points, _ = frontier_points(KEPT)
    wide = points["run-all-hybrid-4x"]
    assert wide.seeds == (0, 1)
    assert wide.paired == paired_difference([[1] * 8, TEACHER_HITS], TEACHER_HITS)
    assert wide.loss_ratios == pytest.approx((1.15, 1.05)) and wide.noise_ratios == pytest.approx((1.3, 1.2))
    assert wide.token_ratios == pytest.approx((0.75, 1.25))
    # against the paper run on the seeds both have: seed 0 all hits against 5 of 8, seed 1 5 of 8 against 4
    assert wide.versus_paper == paired_runs([[1] * 8, TEACHER_HITS], [TEACHER_HITS, KEPT[2]["hits"]])
    assert wide.versus_paper.mean == pytest.approx(0.25) and points["run-paper"].versus_paper is None


def test_the_goals_missed_are_named_and_the_time_goal_is_the_paper_runs():
    points, teacher = frontier_points(KEPT)
    # the teacher's own hits: the interval is [0, 0]; loss 1.05x, noise 1.2x, token 1.25x are within the goals
    assert missed_goals(points["run-all-hybrid"], budget_seconds=100) == []
    assert missed_goals(points["run-all-hybrid"], budget_seconds=80) == ["time"]
    assert missed_goals(points["run-paper"], budget_seconds=100) == ["ToyEval", "val loss", "noise", "token pattern"]
    # noise 1.25x on average (1.3 and 1.2) is at the goal; the loss (1.10x) too
    assert missed_goals(points["run-all-hybrid-4x"], budget_seconds=None) == []
    table = frontier_table(points, teacher)
    exact = "+0.000 [+0.000, +0.000]"
    assert f"| run-all-hybrid | 0 | 90 (0.90x) | 0.625 | {exact} | {exact} | 1.05x | 1.20x | 1.25x | none |" in table
    # the paper run has no difference against itself
    assert "| run-paper | 0, 1 | 100 (1.00x) | 0.562 | " in table and "| - | 1.50x (1.50-1.50) |" in table
    wide = "| run-all-hybrid-4x | 0, 1 | 400 (4.00x) | 0.812 | "
    assert wide in table and "| 1.10x (1.05-1.15) | 1.25x (1.20-1.30) | 1.00x (0.75-1.25) | time |" in table


def test_teacher_rows_of_different_evaluations_are_refused():
    other = _kept("teacher", 0, 3, [0] * 8, 0.02, 0.010, 0.004)
    with pytest.raises(ValueError, match="different evaluations"):
        frontier_points([*KEPT, other])

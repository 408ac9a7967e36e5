"""The frontier of full linear time on the toy as a table and a picture: ToyEval and validation loss (over
the teacher's) against total training time, one line per recipe, from the trainer-run rows of ablation results.

    python -m experiments.frontier_plot --json ablations_frontier --out docs/toy_frontier.png

Each point is one row's mean over its seeds, its bar the paired 95% interval against the teacher (ToyEval)
or the seeds' range (loss); a recipe's line joins its rows in order of training time. The dashed lines are
the teacher (ToyEval, and val loss 1.0x) and the goal's 1.10x; the dotted vertical lines are the paper run's
training time (the `run-paper` row), the budget the goal allows, and twice it, the budget of the recipe
shipped when no row meets the goals. The table gives each row's paired ToyEval difference against the
teacher and the goals it misses (docs/toy.md, "Full linear time at the paper run's budget").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from experiments import RESULTS_DIR
from sd3_testbed.stats import PairedDifference, paired_difference, paired_runs

__all__ = [
    "GOALS",
    "RECIPE_LINES",
    "Point",
    "draw_frontier",
    "frontier_points",
    "frontier_table",
    "main",
    "missed_goals",
    "nice_ticks",
]

PAPER_ROW = "run-paper"
"""The paper's recipe (`paper` layers, 120 full steps): the time goal, and the reference of each row's paired
difference to it."""
GOALS = {"toyeval_low": -0.02, "loss_ratio": 1.10, "noise_ratio": 1.25, "token_ratio": 1.25}
"""The toy's goals for full linear time: the paired interval's lower end against the teacher, and the
ceilings of validation loss, background noise and token pattern over the teacher's; the time goal is the
paper run's training time (`PAPER_ROW`)."""

RECIPE_LINES: dict[str, tuple[str, ...]] = {
    "paper, full fine-tune": ("run-paper",),
    "all hybrid, full fine-tune": (
        "run-all-hybrid",
        "run-all-hybrid-1.25x",
        "run-all-hybrid-2x",
        "run-all-hybrid-4x",
    ),
    "all hybrid, transfer then rank 16": (
        "run-all-hybrid-transfer",
        "run-all-hybrid-transfer-r16-0.5x",
        "run-all-hybrid-transfer-r16-1x",
    ),
    "all hybrid, transfer then rank 16, factors 10x": (
        "run-all-hybrid-transfer",
        "run-all-hybrid-transfer-r16-1x-lr10",
    ),
    "all hybrid, transfer 40 then full fine-tune": ("run-all-hybrid-transfer40-full",),
}
"""The recipes drawn, each a line through its rows (`experiments.ablations.FRONTIER_ROWS`)."""
COLOURS = ((90, 90, 90), (31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189))


@dataclass(frozen=True, slots=True)
class Point:
    """One row over its seeds: mean training seconds, ToyEval overall and val loss over the teacher's; the
    paired ToyEval difference against the teacher and against the paper run (on the seeds both have), and
    per seed the val loss, background noise and token pattern over the teacher's (where the rows keep hits
    and background errors)."""

    row: str
    seconds: float
    toyeval: float
    loss_ratios: tuple[float, ...]
    seeds: tuple[int, ...] = ()
    paired: PairedDifference | None = None
    versus_paper: PairedDifference | None = None
    noise_ratios: tuple[float, ...] = ()
    token_ratios: tuple[float, ...] = ()

    @property
    def loss_ratio(self) -> float:
        """Val loss over the teacher's, the mean over seeds."""
        return statistics.mean(self.loss_ratios)


def _teacher_hits(teacher: list[dict]) -> list[int] | None:
    """The teacher's per-sample hits, one list for every teacher row (the results of one evaluation)."""
    hits = [r["hits"] for r in teacher if "hits" in r]
    if any(h != hits[0] for h in hits):
        raise ValueError(
            "the teacher rows hold different per-sample hits, so the results come from different evaluations: "
            "give results of one --eval-count only."
        )
    return hits[0] if hits else None


def _ratios(rows: list[dict], teacher: list[dict], key: str) -> tuple[float, ...]:
    """Per seed, a row's background error `key` over the teacher's mean (none where a row lacks it)."""
    if not all("background_error" in r for r in rows + teacher):
        return ()
    reference = statistics.mean(r["background_error"][key] for r in teacher)
    return tuple(r["background_error"][key] / reference for r in rows)


def _versus(rows: list[dict], reference: list[dict]) -> PairedDifference | None:
    """`rows` minus `reference` (another row), paired on the seeds both have; None where they share no seed
    or lack hits."""
    hits = {r["seed"]: r["hits"] for r in reference if "hits" in r}
    shared = [r for r in rows if r["seed"] in hits and "hits" in r]
    if not shared:
        return None
    return paired_runs([r["hits"] for r in shared], [hits[r["seed"]] for r in shared])


def frontier_points(results: list[dict]) -> tuple[dict[str, Point], float]:
    """Each trainer row's `Point` and the teacher's ToyEval, from ablation rows (one dict per row and seed).

    Raises:
        ValueError: no teacher row, or teacher rows of different evaluations.
    """
    teacher = [r for r in results if r["row"] == "teacher"]
    if not teacher:
        raise ValueError("the results hold no `teacher` row: run the ablations with --rows teacher ...")
    teacher_loss = statistics.mean(r["val_loss"] for r in teacher)
    teacher_hits = _teacher_hits(teacher)
    by_row = {
        name: sorted((r for r in results if r["row"] == name), key=lambda r: r["seed"])
        for name in {r["row"] for r in results} - {"teacher"}
    }
    paper = by_row.get(PAPER_ROW)
    points = {}
    for name, rows in by_row.items():
        kept = teacher_hits is not None and all("hits" in r for r in rows)
        points[name] = Point(
            name,
            statistics.mean(r["train_seconds"] for r in rows),
            statistics.mean(r["toyeval"]["overall"] for r in rows),
            tuple(r["val_loss"] / teacher_loss for r in rows),
            seeds=tuple(r["seed"] for r in rows),
            paired=paired_difference([r["hits"] for r in rows], teacher_hits) if kept else None,
            versus_paper=_versus(rows, paper) if paper and name != PAPER_ROW else None,
            noise_ratios=_ratios(rows, teacher, "noise"),
            token_ratios=_ratios(rows, teacher, "token_pattern"),
        )
    return points, statistics.mean(r["toyeval"]["overall"] for r in teacher)


def missed_goals(point: Point, budget_seconds: float | None) -> list[str]:
    """The `GOALS` a row misses (by its seeds' mean), and the time goal where the paper run was measured; a
    goal its results cannot tell (no hits, no background errors) is not named."""
    checks = {
        "ToyEval": point.paired is not None and point.paired.low < GOALS["toyeval_low"],
        "val loss": point.loss_ratio > GOALS["loss_ratio"],
        "noise": bool(point.noise_ratios) and statistics.mean(point.noise_ratios) > GOALS["noise_ratio"],
        "token pattern": bool(point.token_ratios) and statistics.mean(point.token_ratios) > GOALS["token_ratio"],
        "time": budget_seconds is not None and point.seconds > budget_seconds,
    }
    return [goal for goal, missed in checks.items() if missed]


def _spread(ratios: tuple[float, ...]) -> str:
    """`1.24x` for one seed, `1.24x (1.23-1.25)` (mean, then the seeds' range) for several, `-` for none."""
    if not ratios:
        return "-"
    mean = f"{statistics.mean(ratios):.2f}x"
    return mean if len(ratios) == 1 else f"{mean} ({min(ratios):.2f}-{max(ratios):.2f})"


def frontier_table(points: dict[str, Point], teacher_toyeval: float) -> str:
    """A markdown table of `frontier_points`, in order of training time: each row's seeds, training time (and
    over the paper run's), ToyEval and its paired differences against the teacher and the paper run, the
    ratios over the teacher and the goals missed."""
    budget = points[PAPER_ROW].seconds if PAPER_ROW in points else None
    lines = [
        f"teacher ToyEval {teacher_toyeval:.3f}",
        "",
        "| row | seeds | training s | ToyEval | vs teacher, paired [95% CI] | vs paper run, paired "
        "| val loss / teacher's | noise / teacher's | token pattern / teacher's | goals missed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in sorted(points.values(), key=lambda p: p.seconds):
        time = f"{point.seconds:.0f}" + (f" ({point.seconds / budget:.2f}x)" if budget else "")
        missed = ", ".join(missed_goals(point, budget)) or "none"
        lines.append(
            f"| {point.row} | {', '.join(map(str, point.seeds))} | {time} | {point.toyeval:.3f} | "
            f"{point.paired or '-'} | {point.versus_paper or '-'} | {_spread(point.loss_ratios)} | "
            f"{_spread(point.noise_ratios)} | {_spread(point.token_ratios)} | {missed} |"
        )
    return "\n".join(lines)


_PANEL, _MARGIN = (460, 320), (64, 36, 24, 48)
"""Plot area in pixels; margins left, top, right, bottom."""
_BLACK, _GREY, _LIGHT = (0, 0, 0), (120, 120, 120), (160, 160, 160)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Ticks at a round step (1, 2, 2.5 or 5 times a power of ten) covering `[low, high]`, about `count` to
    `count + 2` of them; the first and last are the axis ends."""
    raw = 0.75 * (high - low) / (count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    start, stop = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [round(i * step, 9) for i in range(start, stop + 1)]


def _panel(draw, font, origin, x_ticks, y_ticks, title):
    """Axes with ticks at `x_ticks` and `y_ticks` (their ends are the panel's); returns the data-to-pixel map."""
    left, top = origin[0] + _MARGIN[0], origin[1] + _MARGIN[1]
    width, height = _PANEL
    (x0, x1), (y0, y1) = (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1])

    def to_pixel(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * width, top + height - (y - y0) / (y1 - y0) * height

    draw.rectangle((left, top, left + width, top + height), outline=_BLACK)
    for x in x_ticks:
        px, _ = to_pixel(x, y0)
        draw.line((px, top + height, px, top + height + 4), fill=_BLACK)
        draw.text((px - 10, top + height + 6), f"{x:g}", fill=_BLACK, font=font)
    for y in y_ticks:
        _, py = to_pixel(x0, y)
        draw.line((left - 4, py, left, py), fill=_BLACK)
        draw.text((left - 40, py - 6), f"{y:g}", fill=_BLACK, font=font)
    draw.text((left, top - 22), title, fill=_BLACK, font=font)
    draw.text((left + width // 2 - 70, top + height + 24), "total training time (s)", fill=_BLACK, font=font)
    return to_pixel


def _dashed(draw, start, end, colour, *, dash: int = 6):
    (xa, ya), (xb, yb) = start, end
    steps = max(int(max(abs(xb - xa), abs(yb - ya)) // dash), 1)
    for i in range(0, steps, 2):
        t0, t1 = i / steps, min(i + 1, steps) / steps
        draw.line((xa + (xb - xa) * t0, ya + (yb - ya) * t0, xa + (xb - xa) * t1, ya + (yb - ya) * t1), fill=colour)


def _toyeval_bar(point: Point) -> tuple[float, float]:
    """The paired 95% interval against the teacher, placed around the row's ToyEval (the point alone where
    the row keeps no hits)."""
    if point.paired is None:
        return point.toyeval, point.toyeval
    return point.toyeval + point.paired.low - point.paired.mean, point.toyeval + point.paired.high - point.paired.mean


def _loss_bar(point: Point) -> tuple[float, float]:
    """The seeds' range of val loss over the teacher's."""
    return min(point.loss_ratios), max(point.loss_ratios)


def draw_frontier(points: dict[str, Point], teacher_toyeval: float, path: Path) -> Path:
    """Write the two-panel PNG (ToyEval, val loss / teacher's against seconds) of `frontier_points`: a line
    per recipe that has rows, each point with its bar (ToyEval: the paired 95% interval against the teacher;
    loss: the seeds' range), the legend naming only the recipes drawn (those with a row no earlier line has)."""
    drawn, shown = {}, set()
    for (name, rows), colour in zip(RECIPE_LINES.items(), COLOURS, strict=True):
        present = [r for r in rows if r in points]
        if set(present) - shown:  # a recipe whose rows an earlier line drew already adds nothing
            drawn[name] = colour, sorted((points[r] for r in present), key=lambda p: p.seconds)
            shown.update(present)
    font = ImageFont.load_default()
    panel_width = _MARGIN[0] + _PANEL[0] + _MARGIN[2]
    legend_height = 18 * len(drawn) + 12
    image = Image.new("RGB", (2 * panel_width, _MARGIN[1] + _PANEL[1] + _MARGIN[3] + legend_height), "white")
    draw = ImageDraw.Draw(image)
    x_ticks = nice_ticks(0, max(p.seconds for p in points.values()) * 1.05)
    toyevals = [v for p in points.values() for v in _toyeval_bar(p)] + [teacher_toyeval]
    ratios = [v for p in points.values() for v in _loss_bar(p)] + [1.0, GOALS["loss_ratio"]]
    panels = {
        "toyeval": (
            _toyeval_bar,
            (min(toyevals) - 0.01, max(toyevals) + 0.01),
            "ToyEval overall",
            {"teacher": teacher_toyeval},
        ),
        "loss_ratio": (
            _loss_bar,
            (min(ratios) - 0.05, max(ratios) + 0.05),
            "val loss / teacher's",
            {
                "teacher": 1.0,
                "goal": GOALS["loss_ratio"],
            },
        ),
    }
    budget = points.get(PAPER_ROW)
    for index, (field, (bar, y_range, title, references)) in enumerate(panels.items()):
        y_ticks = nice_ticks(*y_range)
        to_pixel = _panel(draw, font, (index * panel_width, 0), x_ticks, y_ticks, title)
        for label, value in references.items():
            start, end = to_pixel(x_ticks[0], value), to_pixel(x_ticks[-1], value)
            _dashed(draw, start, end, _GREY)
            draw.text((end[0] - 6 * len(label) - 4, end[1] - 13), label, fill=_GREY, font=font)
        for multiple, label in ((1, "paper run"), (2, "2x")) if budget is not None else ():
            seconds = multiple * budget.seconds
            if seconds <= x_ticks[-1]:
                top, bottom = to_pixel(seconds, y_ticks[-1]), to_pixel(seconds, y_ticks[0])
                _dashed(draw, bottom, top, _LIGHT, dash=3)
                draw.text((top[0] + 4, top[1] + 4), label, fill=_LIGHT, font=font)
        for colour, line in drawn.values():
            pixels = [to_pixel(p.seconds, getattr(p, field)) for p in line]
            if len(pixels) > 1:
                draw.line(pixels, fill=colour, width=2)
            for point, (x, y) in zip(line, pixels, strict=True):
                (_, low), (_, high) = (to_pixel(point.seconds, v) for v in bar(point))
                draw.line((x, low, x, high), fill=colour, width=1)
                draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)
    legend_top = _MARGIN[1] + _PANEL[1] + _MARGIN[3]
    for index, (name, (colour, _)) in enumerate(drawn.items()):
        y = legend_top + 18 * index
        draw.line((_MARGIN[0], y + 6, _MARGIN[0] + 24, y + 6), fill=colour, width=3)
        draw.text((_MARGIN[0] + 32, y), name, fill=_BLACK, font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", nargs="+", required=True, help="ablation result names under --results-dir")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--out", type=Path, default=Path("docs/toy_frontier.png"))
    args = parser.parse_args(argv)
    results = []
    for name in args.json:
        results += json.loads((args.results_dir / f"{name}.json").read_text(encoding="utf-8"))["rows"]
    points, teacher = frontier_points(results)
    print(frontier_table(points, teacher))
    print(f"wrote {draw_frontier(points, teacher, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`experiments/ablations.py`: an interrupted sweep resumes from its results file, and only when the
budget and the evaluation are the same; the teacher row is the cached reference every row is compared with.

Run as subprocesses: tests do not import `experiments/`. The row is `t5-zero-ft` (converted, not
fine-tuned), so each run is an evaluation of two samples; `--steps` still changes the budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = "t5-zero-ft"


def _sweep(results: Path, *flags: str, row: str = ROW) -> str:
    """Run the sweep on one row and seed 0 into `results`/sweep.json; returns its stdout."""
    command = [sys.executable, "-m", "experiments.ablations", "--rows", row, "--seeds", "0", "--wide-count", "0"]
    command += ["--results-dir", str(results), "--json", "sweep", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _ran(stdout: str) -> bool:
    return any(line.startswith(ROW) and "seed 0:" in line for line in stdout.splitlines())


def test_a_sweep_resumes_only_with_the_same_budget_and_evaluation(tmp_path):
    assert _ran(_sweep(tmp_path, "--eval-count", "2"))
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [(row["row"], row["seed"]) for row in rows] == [(ROW, 0)]
    assert not _ran(_sweep(tmp_path, "--eval-count", "2"))
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"] == rows
    assert _ran(_sweep(tmp_path, "--eval-count", "3"))
    assert _ran(_sweep(tmp_path, "--eval-count", "3", "--steps", "5"))


def test_the_teacher_row_is_the_cached_reference(tmp_path):
    """The teacher row reports the reference samples every row is compared with (cached, not resampled)."""
    _sweep(tmp_path, "--eval-count", "2", row="teacher")
    result = json.loads((tmp_path / "sweep.json").read_text())
    (row,) = result["rows"]
    assert row["teacher_distance"] == 0.0
    assert row["hits"] == result["meta"]["teacher_hits"]
    assert row["background"] == result["meta"]["teacher_background"]
    assert row["toyeval"] == result["meta"]["teacher_toyeval"]
    assert list((tmp_path / ".cache").glob("softmax-*-seed0-2-raw.safetensors"))


_TRAINER_ROW = """
import math
from experiments.ablations import ROWS, Row, train_row
from trainer.cli import parse_args
for row in ROWS:
    parse_args(["--training.steps", "3", *row.flags])
flags = ("--model.layers", "all", "--model.joint_mode", "hybrid", "--transfer.steps", "1", "--model.rank", "2",
         "--training.steps", "1")
model, names, loss = train_row(Row("tiny", "a tiny trainer run", flags), 0, ("--training.batch_size", "2"))
assert not model.training and math.isfinite(loss)
print(len(names))
"""


def test_every_row_is_a_trainer_run_and_returns_its_model():
    """Each row's flags are a valid trainer config; a row trains with the trainer on the sweep's budget."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _TRAINER_ROW], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["6"]  # every attention module of the toy

"""`experiments/schedule.py` end to end on a handful of samples: a toy delta file from a short trainer run,
T5 on every step, and softmax on every step with the file's weight changes kept (start 100%).

The script runs as a subprocess: tests do not import `experiments/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from sd3_testbed.eval import eval_set, generate, teacher_distance
from sd3_testbed.model import load_toy_base
from t5core.hosts.diffusers import linearize
from trainer.cli import parse_args
from trainer.train import run as train

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 3


def test_rows_match_t5_and_softmax_with_the_files_weights_at_the_ends(tmp_path):
    flags = ["--model.layers", "all", "--model.joint_mode", "hybrid", "--model.rank", "4", "--transfer.steps", "1"]
    flags += ["--training.steps", "1", "--training.batch_size", "2", "--output.toy_eval_samples", "0"]
    flags += ["--output.progress", "false", "--checkpoint.every", "0", "--output.dir", str(tmp_path / "run")]
    t5_file = train(parse_args(flags)).weights
    command = [sys.executable, "-m", "experiments.schedule", "--t5-file", str(t5_file), "--samples", str(SAMPLES)]
    command += ["--starts", "0", "1", "--rounds", "2", "--timed-batch", "1", "--results-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "T5_BACKEND": "torch"})
    assert done.returncode == 0, done.stderr
    rows = {row["row"]: row for row in json.loads((tmp_path / "schedule.json").read_text())["rows"]}
    assert list(rows) == ["teacher", "start 0%", "start 100%"]

    captions, noise = eval_set(SAMPLES, seed=0)
    with torch.no_grad():
        teacher = generate(load_toy_base(), captions, noise).clamp(0.0, 1.0)
        handle = linearize(load_toy_base(), weights=t5_file, backend="torch")
        t5 = generate(handle.model, captions, noise).clamp(0.0, 1.0)
        with handle.softmax():
            softmax_with_changes = generate(handle.model, captions, noise).clamp(0.0, 1.0)
    assert rows["teacher"]["teacher_distance"] == 0.0
    assert rows["start 0%"]["teacher_distance"] == teacher_distance(t5, teacher)
    assert rows["start 100%"]["teacher_distance"] == teacher_distance(softmax_with_changes, teacher)
    assert teacher_distance(t5, softmax_with_changes) > 1e-3, "the rows must differ for the test to mean anything"
    assert all(len(row["hits"]["overall"]) == SAMPLES for row in rows.values())

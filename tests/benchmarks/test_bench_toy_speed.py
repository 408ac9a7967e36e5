"""`benchmarks/bench_toy_speed.py` end to end at the smallest sizes: the check before timing, the per-round
ratios and the table, as a subprocess (tests do not import `benchmarks/`). It runs as a file, not with
`python -m`, so the result's owner module is named from the script's path. No timing is asserted."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_softmax_and_t5_are_timed_in_turn_and_rendered(tmp_path):
    command = [sys.executable, "benchmarks/bench_toy_speed.py", "--sizes", "16", "--steps", "1", "--reps", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [*command, f"--results-dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| 16 px | 16 |" in done.stdout
    result = json.loads((tmp_path / "bench_toy_speed.json").read_text())
    assert result["meta"]["script"] == "benchmarks.bench_toy_speed" and result["meta"]["rounds"] == 3
    (row,) = result["rows"]
    times = row["times_ms"]
    assert len(times["softmax"]) == len(times["t5"]) == 3
    ratios = [soft / t5 for soft, t5 in zip(times["softmax"], times["t5"], strict=True)]
    assert row["speedup_vs_softmax"] == pytest.approx(statistics.median(ratios))
    assert row["t5"]["median_ms"] == pytest.approx(statistics.median(times["t5"]))

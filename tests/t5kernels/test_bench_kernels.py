"""`benchmarks/bench_kernels.py` end to end with the kernels under Triton's interpreter, at tiny
shapes: every branch a GPU run takes (check against the reference, Triton timing columns, bandwidth,
forward + backward, the whole-transformer rows with the Triton backend) runs before a GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_runs_every_triton_branch_under_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("diffusers")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_kernels.py"),
        "--device=cpu",
        "--grids", "3x5", "1x6",
        "--heads=2", "--head-dim=16", "--text=4", "--reps=2", "--warmup=0",
        "--backward", "--model-step", "--model-res", "64", "--peak-gbs=100",
        f"--results-dir={tmp_path}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "FAIL" not in result.stdout
    rows = json.loads((tmp_path / "kernels_cpu.json").read_text())["rows"]
    attention = [row for row in rows if "model" not in row]
    model = [row["model"] for row in rows if "model" in row]
    assert [row["grid"] for row in attention] == ["3x5", "1x6"]
    for row in attention:
        assert row["status"] == "ok"
        assert row["triton_rel_err"] <= 1e-5
        assert {"triton_median_ms", "triton_fwdbwd_median_ms", "torch_over_triton", "triton_gbs"} <= row.keys()
        assert row["bytes"] == 5 * 2 * row["tokens"] * 2 * 16 * 4
    assert len(model) == 1 and model[0]["status"] == "ok"
    for spec in ("paper", "all"):
        assert model[0][f"{spec}_triton_rel_err"] <= 1e-4
        assert {f"{spec}_triton_speedup", f"{spec}_torch_speedup"} <= model[0].keys()

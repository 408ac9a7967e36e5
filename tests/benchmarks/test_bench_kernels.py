"""`benchmarks/bench_attention.py --paths ...,triton --model-step` and `benchmarks/sweep_kernels.py` end
to end with the kernels under Triton's interpreter, at tiny shapes: every branch a GPU run takes (check
against the reference, Triton timing columns, bandwidth, forward + backward, the whole-transformer rows
with the Triton backend, each sweep and its budget) runs before a GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from t5kernels import support

ROOT = Path(__file__).resolve().parents[2]


def _run_interpreted(script: str, *args: str) -> subprocess.CompletedProcess:
    if not support.TRITON_AVAILABLE:
        pytest.skip(support.TRITON_MISSING)
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "-m", f"benchmarks.{script.removesuffix('.py')}", "--device=cpu", *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_attention_paths_run_every_triton_branch_under_the_interpreter(tmp_path):
    result = _run_interpreted(
        "bench_attention.py",
        "--paths=sdpa,t5,triton,hybrid", "--grids", "3x5", "1x6",
        "--heads=2", "--head-dim=16", "--text=4", "--batch=2", "--rounds=2", "--backward", "--peak-gbs=100",
        f"--results-dir={tmp_path}",
    )  # fmt: skip
    assert "FAIL" not in result.stdout
    meta, rows = (json.loads((tmp_path / "attention_cpu.json").read_text())[key] for key in ("meta", "rows"))
    assert meta["script"] == "benchmarks.bench_attention" and meta["peak_gbs"] == 100
    assert [row["grid"] for row in rows] == ["3x5", "1x6"]
    for row in rows:
        assert row["status"] == "ok" and "skipped" not in row
        assert row["errors"]["triton"] <= 1e-5 and row["errors"]["t5"] <= 1e-5 and row["errors"]["hybrid"] <= 1e-5
        assert set(row["ms"]) == {"fwd", "fwdbwd"}
        assert all(set(times) == {"sdpa", "t5", "triton", "hybrid"} for times in row["ms"].values())
        # q, k, v read (k twice) and the output written: 5 tensors of B x N x H x D fp32 values
        assert row["triton_bytes"] == 5 * 2 * (row["image_tokens"] + 4) * 2 * 16 * 4


def test_model_step_runs_the_triton_backend_under_the_interpreter(tmp_path):
    pytest.importorskip("diffusers")
    result = _run_interpreted(
        "bench_attention.py", "--paths=sdpa,triton", "--grids=1x2", "--heads=2", "--head-dim=16", "--text=4",
        "--rounds=2", "--model-step", "64", f"--results-dir={tmp_path}",
    )  # fmt: skip
    assert "FAIL" not in result.stdout and "| 64 | 20 |" in result.stdout
    (row,) = json.loads((tmp_path / "attention_cpu.json").read_text())["meta"]["model_step"]
    assert row["status"] == "ok" and row["tokens"] == (64 // 8 // 2) ** 2 + 4
    for spec in ("paper", "all"):
        assert row[f"{spec}_triton_rel_err"] <= 1e-4
        assert {f"{spec}_triton_median_ms", f"{spec}_torch_median_ms"} <= row.keys()


def _sweep(tmp_path: Path, *args: str) -> dict:
    _run_interpreted(
        "sweep_kernels.py", "--fwd-block-n=16,32", "--bwd-block-n=16", "--map-block-n=16,64", "--warps=4",
        "--stages=1", "--programs-per-sm=1,8", f"--results-dir={tmp_path}", *args,
    )  # fmt: skip
    return json.loads((tmp_path / "kernels_sweep_cpu.json").read_text())


def test_sweep_checks_and_times_every_setting_default_first(tmp_path):
    result = _sweep(tmp_path)
    rows = result["rows"]
    assert [row["sweep"] for row in rows] == ["fwd"] * 5 + ["map"] * 2 + ["bwd"]
    for sweep in ("fwd", "map", "bwd"):
        first = next(row for row in rows if row["sweep"] == sweep)
        assert first["default"] and sum(row["default"] for row in rows if row["sweep"] == sweep) == 1
    assert all(row["status"] == "ok" and row["rel_err"] <= 1e-5 for row in rows)
    fwd = {(row["block_n"], row["programs_per_sm"]) for row in rows if row["sweep"] == "fwd"}
    assert fwd == {(16, 2), (16, 1), (16, 8), (32, 1), (32, 8)}
    assert {row["map_block_n"] for row in rows if row["sweep"] == "map"} == {16, 64}
    summaries = result["meta"]["summaries"]
    assert [s["sweep"] for s in summaries] == ["fwd", "map", "bwd"]
    assert all(s["best_ms"] <= s["default_ms"] for s in summaries)


def test_sweep_spent_budget_still_times_the_defaults(tmp_path):
    rows = _sweep(tmp_path, "--budget-s=0", "--sweeps", "fwd")["rows"]
    assert [row["status"] for row in rows] == ["ok"] + ["not run: --budget-s spent"] * 4

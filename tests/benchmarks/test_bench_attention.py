"""`benchmarks/bench_attention.py` end to end at tiny shapes on CPU, and `benchmarks/report.py` rendering
what it wrote from the owner the file names.

Run as subprocesses: tests do not import `benchmarks/`. No timing is asserted, only what was checked,
measured and recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["sdpa", "ref", "chunked", "t5", "hybrid", "hybrid_na"]


def _run(module: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 or not check, result.stderr[-4000:]
    return result


def test_every_torch_path_is_checked_timed_and_rendered(tmp_path):
    out = _run(
        "benchmarks.bench_attention",
        f"--paths={','.join(PATHS)}", "--grids", "2x2", "9", "--heads=1", "--head-dim=8", "--text=2", "--rounds=2",
        "--backward", "--chunk-sweep", "4", "8", "--resident=chunked", "--threads=1", f"--results-dir={tmp_path}",
    ).stdout  # fmt: skip
    assert "FAIL" not in out and "| grid | N | pass |" in out
    result = json.loads((tmp_path / "attention_cpu.json").read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["script"] == "benchmarks.bench_attention" and meta["paths"] == PATHS and meta["text_tokens"] == 2
    assert [row["grid"] for row in rows] == ["2x2", "3x3"]
    for row in rows:
        assert row["status"] == "ok"
        # every T5 path is compared before it is timed; sdpa and ref are the references themselves
        assert set(row["errors"]) == {"chunked", "t5", "hybrid", "hybrid_na"}
        assert all(error <= 1e-5 for error in row["errors"].values())
        assert {kind: set(times) for kind, times in row["ms"].items()} == {"fwd": set(PATHS), "fwdbwd": set(PATHS)}
        assert set(row["peak_mib"]) == set(PATHS) and set(row["resident_mib"]) == {"chunked"}
        assert row["input_mib"] == 1 * (row["image_tokens"] + 2) * 1 * 8 * 4 / 2**20
    assert [(row["tokens"], row["chunk_tokens"]) for row in meta["chunk_sweep"]] == [(11, 4), (11, 8)]
    assert any(line.startswith("forward, `chunked` speedup at 3x3:") for line in meta["goals"])

    report = _run("benchmarks.report", f"--results-dir={tmp_path}").stdout
    assert "## T5 attention paths vs SDPA (`attention_cpu.json`)" in report
    assert "`python -m benchmarks.bench_attention`." in report
    assert "\n".join(out.splitlines()[1:4]) in report, "the report shows the table the script printed"


def test_paths_need_the_softmax_baseline():
    result = _run("benchmarks.bench_attention", "--paths=ref,chunked", check=False)
    assert result.returncode == 2 and "give sdpa (the baseline)" in result.stderr


def test_hybrid_parts_are_checked_against_the_whole_and_summed(tmp_path):
    # 48x48 image tokens are two of the merge's chunks
    parts = ["sdpa", "t5_image", "text_rows", "merge", "hybrid"]
    out = _run(
        "benchmarks.bench_attention", f"--paths={','.join(parts)}", "--grids", "2x2", "48x48", "--heads=1",
        "--head-dim=8", "--text=3", "--rounds=2", "--resident=", "--threads=1", f"--results-dir={tmp_path}",
    ).stdout  # fmt: skip
    assert "FAIL" not in out and "`hybrid` / timed parts |" in out
    rows = json.loads((tmp_path / "attention_cpu.json").read_text())["rows"]
    for row in rows:
        assert set(row["errors"]) == {"t5_image", "text_rows", "merge", "hybrid"}
        assert all(error <= 1e-5 for error in row["errors"].values())
        assert set(row["ms"]["fwd"]) == set(parts)


def test_hybrid_parts_need_text_and_run_forward_only():
    for flags in (["--paths=sdpa,merge"], ["--paths=sdpa,text_rows", "--text=3", "--backward"]):
        result = _run("benchmarks.bench_attention", *flags, check=False)
        assert result.returncode == 2 and "forward only, --text > 0" in result.stderr

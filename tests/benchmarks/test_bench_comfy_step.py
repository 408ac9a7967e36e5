"""`benchmarks/bench_comfy_step.py`: the kinds of block each path composes for SD3.5 Medium, and the
whole script at toy size, whole, composed and compiled, with its JSON and the report's table.

Run as subprocesses: tests do not import `benchmarks/`. Every expectation here is written from the
model's definition (attn2 on blocks 0-12, `paper` = attn2 0-12 plus joint 19-23, the last block's
text stream pre-only), not from the script's code. No timing is asserted, only what was measured and
how it adds up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from testing import comfy_env

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_plan_counts_sd35_mediums_blocks_by_kind():
    out = _run("benchmarks.bench_comfy_step", "--plan", "--specs", "paper", "all-hybrid").stdout
    assert out.splitlines() == [
        "softmax: 0 modules converted",
        "   13 x attn2 block: joint softmax, attn2 softmax",
        "   10 x block: joint softmax",
        "    1 x last block: joint softmax",
        "paper: 18 modules converted",
        "   13 x attn2 block: joint softmax, attn2 T5",
        "    6 x block: joint softmax",
        "    4 x block: joint T5",
        "    1 x last block: joint T5",
        "all-hybrid: 37 modules converted",
        "   13 x attn2 block: joint hybrid, attn2 T5",
        "   10 x block: joint hybrid",
        "    1 x last block: joint hybrid",
    ]


# The 2-block model: both blocks have attn2 (0-12), block 1 is the last; `paper` converts both attn2 and
# the joint attention of the last block (5/24 of 2 blocks, at least 1).
TOY_KINDS = {
    "softmax": {"attn2 block: joint softmax, attn2 softmax": 1, "last block: joint softmax, attn2 softmax": 1},
    "paper": {"attn2 block: joint softmax, attn2 T5": 1, "last block: joint T5, attn2 T5": 1},
    "all-hybrid": {"attn2 block: joint hybrid, attn2 T5": 1, "last block: joint hybrid, attn2 T5": 1},
    "all-hybrid-na": {"attn2 block: joint hybrid, attn2 T5": 1, "last block: joint hybrid, attn2 T5": 1},
}


@pytest.mark.comfyui  # imports the tree under test: runs on the floor tree too
def test_whole_and_composed_step_at_toy_size(tmp_path):
    tree = comfy_env.require_tree()
    out = _run(
        "benchmarks.bench_comfy_step",
        "--blocks", "2", "--sizes", "64", "--compose", "64", "--warmup", "1", "--reps", "2", "--block-reps", "2",
        "--specs", "paper", "all-hybrid", "all-hybrid-na", "--compiled", "all-hybrid", f"--comfyui={tree}",
        f"--results-dir={tmp_path}", "--suffix", "_toy",
    ).stdout  # fmt: skip
    assert "FAIL" not in out and "composed / measured" in out
    result = json.loads((tmp_path / "comfy_step_whole_cpu_toy.json").read_text())
    assert result["meta"]["model_calls_per_step"] == [[2]], "cond and uncond must run as one model call of batch 2"
    rows = {(row["path"], row["step"]): row for row in result["rows"]}
    # the compiled path, its attention untimed, against the eager softmax step: measured whole, and composed
    # from its blocks compiled alone (one of each kind, the ones timed) beside an eager rest
    for step in ("measured", "composed"):
        compiled = rows.pop(("all-hybrid+compile", step))
        assert compiled["status"] == "ok" and compiled["compiled"] and compiled["attention_share"] is None
        assert compiled["modules"] == 4 and compiled["windows"] == [0]
        # its median is over the rounds that compiled no graph: the warm-up step compiled the only shape
        assert compiled["round_graphs"] == [0, 0]
        if step == "measured":
            assert compiled["round_calls"] == [[2], [2]]
        assert compiled["speedup_vs_softmax"] == pytest.approx(
            rows[("softmax", step)]["median_ms"] / compiled["median_ms"]
        )
    assert compiled["compiled_blocks"] == sorted(block["timed_block"] for block in compiled["blocks"])
    assert {block["kind"]: block["count"] for block in compiled["blocks"]} == TOY_KINDS["all-hybrid"]
    assert all(block["attention_ms"] is None for block in compiled["blocks"]) and compiled["attention_ms"] is None
    assert compiled["composed_vs_measured"] > 0
    assert set(rows) == {(path, step) for path in TOY_KINDS for step in ("measured", "composed")}
    for (path, step), row in rows.items():
        assert row["status"] == "ok", row
        assert not row["compiled"]
        base = rows[("softmax", step)]["median_ms"]
        assert row["speedup_vs_softmax"] == pytest.approx(base / row["median_ms"])
        assert 0 < row["attention_share"] < 1 and row["peak_mib"] > 0
        # the `-na` path's file carries the 5x5 neighbourhood blend into every T5 module the step ran
        assert row["windows"] == ([] if path == "softmax" else [5] if path.endswith("-na") else [0])
        if step == "measured":
            # one model call, two joint and two attn2 modules: four attention calls per step
            assert row["attention_calls"] == 4
            assert row["round_graphs"] == [0, 0] and row["round_calls"] == [[2], [2]]
            continue
        blocks = row["blocks"]
        assert {block["kind"]: block["count"] for block in blocks} == TOY_KINDS[path]
        added = row["rest_ms"] + sum(block["count"] * block["median_ms"] for block in blocks)
        assert row["median_ms"] == pytest.approx(added)
        attention = row["rest_attention_ms"] + sum(block["count"] * block["attention_ms"] for block in blocks)
        assert row["attention_ms"] == pytest.approx(attention)
        assert row["composed_vs_measured"] == pytest.approx(row["median_ms"] / rows[(path, "measured")]["median_ms"])
        # 2 rounds x 2 timed runs of each kind of block in each model call: a kind's time in a round's step
        # is the sum over the step's model calls of the median of the call's runs; each round is composed
        # from its own rest and blocks, against the whole step of the same round
        calls = len(result["meta"]["model_calls_per_step"][0])
        for block in blocks:
            runs = block["runs_ms"]
            assert len(runs) == 2 * calls * 2
            for r in range(2):
                in_step = sum(statistics.median(runs[i : i + 2]) for i in range(2 * calls * r, 2 * calls * (r + 1), 2))
                assert block["per_step_ms"][r] == pytest.approx(in_step)
        for r, (composed, ratio) in enumerate(zip(row["round_ms"], row["composed_vs_measured_rounds"], strict=True)):
            own = sum(block["count"] * block["per_step_ms"][r] for block in blocks)
            assert composed == pytest.approx(row["rest_times_ms"][r] + own)
            assert ratio == pytest.approx(composed / rows[(path, "measured")]["times_ms"][r])

    report = _run("benchmarks.report", f"--results-dir={tmp_path}").stdout
    assert "## SD3.5 Medium, one ComfyUI sampling step, whole model (`comfy_step_whole_cpu_toy.json`)" in report
    assert "only the first 2 of SD3.5 Medium's 24 joint blocks" in report
    assert "| 64x64 | `all-hybrid` | 4 | composed |" in report
    assert "| 64x64 | `all-hybrid+compile` | 4 | measured |" in report
    assert "| 64x64 | `all-hybrid+compile` | 4 | composed |" in report
    assert "* composed / measured at 64x64: " in report

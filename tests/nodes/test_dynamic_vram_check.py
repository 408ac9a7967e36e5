"""The GPU session's ComfyUI check (`python -m tools.comfy_dynamic_vram`) runs end to end on CPU,
in a real ComfyUI server, so the first GPU run finds it working: every check that applies on CPU
passes (Dynamic VRAM itself needs CUDA and is recorded as not applying).

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing import comfy_env

pytestmark = pytest.mark.comfyui  # a real server of the tree under test: runs on the floor tree too

ROOT = Path(__file__).resolve().parents[2]


def test_the_dynamic_vram_check_passes_on_cpu(tmp_path):
    tree = comfy_env.require_tree()
    command = [sys.executable, "-m", "tools.comfy_dynamic_vram", "--comfyui", str(tree), "--results-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "comfy_dynamic_vram_cpu.json").read_text())
    results = {row["check"]: (row["ok"], row["applies"]) for row in report["rows"]}
    assert results.pop("dynamic_vram") == (False, False)
    assert all(ok and applies for ok, applies in results.values()), results
    assert set(report["meta"]["prompt_seconds"]) == {"softmax", "t5", "t5_again", "t5_lora_after", "softmax_after"}

"""`benchmarks.timing.environment` records the CPU allocator settings a run had, since page faults on
freshly mapped memory change CPU times. Run as subprocesses: tests do not import `benchmarks/`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [({}, "allocator: default)"), ({"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_TOP_PAD_": "65536"},
      "allocator: THP_MEM_ALLOC_ENABLE=1 MALLOC_TOP_PAD_=65536)")],
)  # fmt: skip
def test_cpu_device_line_names_the_allocator_settings(settings, expected):
    env = {name: value for name, value in os.environ.items() if not name.startswith(("MALLOC_", "THP_", "LD_PRE"))}
    env.update(settings, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    code = "from benchmarks.timing import environment; print(environment()['device'])"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("cpu (") and result.stdout.strip().endswith(expected)

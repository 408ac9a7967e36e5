"""`benchmarks/report.py` refuses a result file without an importable owner, and
`benchmarks.timing.publish` refuses to record a `__main__` owner the report could not import.

Run as subprocesses: tests do not import `benchmarks/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*command: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", [None, "benchmarks.no_such_script"])
def test_report_refuses_a_result_without_an_importable_owner(tmp_path, script):
    meta = {"device": "cpu"} if script is None else {"device": "cpu", "script": script}
    (tmp_path / "orphan.json").write_text(json.dumps({"meta": meta, "rows": []}))
    result = _run("-m", "benchmarks.report", f"--results-dir={tmp_path}")
    assert result.returncode != 0
    assert f"ValueError: orphan.json: meta['script'] is {script!r}, which is not an importable module" in result.stderr


def test_publish_refuses_an_owner_outside_the_repository(tmp_path):
    script = tmp_path / "outside.py"
    script.write_text(
        "from benchmarks.timing import publish\n\n"
        "TITLE = 'outside'\n\n"
        "def table(result):\n    return []\n\n"
        "publish('outside', [], {}, table=table, write=False)\n"
    )
    result = _run(str(script))
    assert result.returncode != 0 and "run it as python -m benchmarks.NAME" in result.stderr

"""The kernels compile for Hopper (sm_90) with the settings the launch plan uses and fit its
shared memory per block. The interpreter shows neither, so this compiles ahead of time (no GPU
needed; Triton's bundled ptxas) in a subprocess where `t5kernels` is not interpreted."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# sm_90 allows 227 KB of shared memory per block (opt-in maximum)
HOPPER_SHARED_BYTES = 227 * 1024
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, int]:
    triton_compiler = pytest.importorskip("triton.compiler")
    if "constexprs" not in inspect.signature(triton_compiler.ASTSource).parameters:
        pytest.skip("this Triton's ahead-of-time compile API (ASTSource) predates the one used here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "tests.t5kernels.compile_sm90"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("Triton's ptxas is unavailable here")
    assert result.returncode == 0, result.stderr[-4000:]
    return {row["id"]: row["shared"] for row in map(json.loads, result.stdout.splitlines())}


@pytest.mark.parametrize(
    "case_id",
    [
        "inner_step_fwd-bfloat16",
        "inner_apply_fwd-bfloat16",
        "inner_apply_bwd-bfloat16",
        "inner_step_bwd-bfloat16",
        "inner_step_fwd-float32",
        "inner_apply_bwd-float32",
        "inner_step_bwd-float32",
    ],
)
def test_kernel_compiles_for_sm90_within_shared_memory(compiled, case_id):
    assert case_id in compiled
    assert compiled[case_id] <= HOPPER_SHARED_BYTES, f"{case_id} needs {compiled[case_id]} bytes of shared memory"

"""The kernels compile for Ampere / Ada (sm_80) and Hopper (sm_90) with the settings the launch plan
uses, and `t5kernels.support.SHARED_KIB_NEEDED`, which decides on which GPUs they run, is a tight
bound of the shared memory they need. The interpreter shows neither, so `python -m tools.compile_cuda`
compiles ahead of time (no GPU needed; Triton's bundled ptxas) in a subprocess where `t5kernels` is
not interpreted."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from t5kernels.support import SHARED_KIB_NEEDED

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, int]:
    triton_compiler = pytest.importorskip("triton.compiler")
    if "constexprs" not in inspect.signature(triton_compiler.ASTSource).parameters:
        pytest.skip("this Triton's ahead-of-time compile API (ASTSource) predates the one used here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "tools.compile_cuda", f"--jobs={min(4, os.cpu_count() or 1)}"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("Triton's ptxas is unavailable here")
    assert result.returncode == 0, result.stderr[-4000:]
    return {row["id"]: row["shared"] for row in map(json.loads, result.stdout.splitlines())}


# fp32 at head dim 128 is refused on every GPU; `python -m tools.compile_cuda --all`
# measures it (448 KiB on sm_80, 464 KiB on sm_90) in minutes of ptxas, too slow for a test
@pytest.mark.parametrize("fp32, head_dim", [(False, 64), (True, 64), (False, 128)])
def test_shared_memory_table_is_the_largest_kernel(compiled, fp32, head_dim):
    dtype = "float32" if fp32 else "bfloat16"
    needs = {case: kib for case, kib in compiled.items() if case.endswith(f"-{dtype}-D{head_dim}")}
    assert len(needs) == (16 if head_dim == 64 else 8), needs  # 4 (+ 4 light at 64) kernels x 2 architectures
    largest_kib = max(needs.values()) / 1024
    # a bound (a GPU the table admits never fails at launch), and a tight one (none is refused for
    # nothing); Triton versions differ by a few KiB (fp32 at 64: 129 with 3.4, 136 with 3.8)
    assert largest_kib <= SHARED_KIB_NEEDED[(fp32, head_dim)] <= largest_kib + 8, needs


@pytest.mark.parametrize("arch", [80, 90])
def test_sd35_shapes_fit_every_gpu_of_the_architecture(compiled, arch):
    """bf16 / fp16 at head dim 64 (SD3 / SD3.5) fit every Ampere, Ada and Hopper GPU (99 KiB per
    block on sm_86 / sm_89, the least of them)."""
    cases = {case: shared for case, shared in compiled.items() if case.endswith(f"-sm{arch}-bfloat16-D64")}
    assert len(cases) == 8 and all(shared <= 99 * 1024 for shared in cases.values()), cases


def test_every_kernel_compiles_with_every_flag_flipped(compiled):
    """mlp, no locality, no key norm, text first: the branches the SD3.5 cases do not take."""
    names = {case.split("-")[0] for case in compiled}
    flipped = {case.split("-")[0] for case in compiled if case.endswith("-flipped")}
    assert len(names) == 8 and flipped == names

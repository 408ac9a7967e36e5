"""Compile the kernels that hold D x D tiles ahead of time, without a GPU (Triton's bundled ptxas),
for Ampere / Ada (sm_80; sm_86 and sm_89 get the same code) and Hopper (sm_90), with the launch
settings `t5kernels.launch.cuda_settings` gives them, and print one JSON line per kernel with the
shared memory per block it needs. Run in a process where `t5kernels` is compiled, not interpreted:

    python -m tests.t5kernels.compile_cuda              # what the tests check
    python -m tests.t5kernels.compile_cuda --jobs 2     # in two processes
    python -m tests.t5kernels.compile_cuda --all        # also fp32 at head dim 128 (minutes of ptxas)
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from t5kernels import bwd, fwd
from t5kernels.launch import cuda_settings

ARCHS = (80, 90)
DTYPES = (torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128)
KERNELS = {
    "inner_step_fwd": (fwd.inner_step_fwd_kernel, "fwd", dict(HAS_NORM=True)),
    "inner_apply_fwd": (fwd.inner_apply_fwd_kernel, "fwd", {}),
    "inner_apply_bwd": (bwd.inner_apply_bwd_kernel, "bwd", {}),
    "inner_step_bwd": (bwd.inner_step_bwd_kernel, "bwd", dict(HAS_NORM=True)),
}
_MAP_KERNELS = {"inner_apply_fwd"}
_FLOAT_ARGS = {"eps", "coef", "dk_scale", "dv_scale"}
_TL = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
# activations in the case dtype; fast weights and buffers fp32
_ACTIVATIONS = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dv_ptr", "out_ptr")


def case_id(kernel: str, arch: int, dtype: torch.dtype, head_dim: int) -> str:
    return f"{kernel}-sm{arch}-{str(dtype).removeprefix('torch.')}-D{head_dim}"


def compile_case(kernel_name: str, arch: int, dtype: torch.dtype, head_dim: int) -> dict:
    """Compile one kernel (SD3.5-style 24 heads, swiglu, locality, key norm, text last)."""
    kernel, phase, flags = KERNELS[kernel_name]
    settings = cuda_settings(dtype, phase)
    is_map = kernel_name in _MAP_KERNELS
    constexprs = dict(
        flags, H=24, D=head_dim, NW=3, SWIGLU=True, HAS_CONV=True, TEXT_FIRST=False, DT=_TL[dtype],
        BLOCK_N=settings.map_block_n if is_map else settings.block_n,
    )  # fmt: skip
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER[dtype] if name in _ACTIVATIONS else "*fp32"
        else:
            signature[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    options = {"num_warps": settings.num_warps, "num_stages": 1 if is_map else settings.num_stages}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {"id": case_id(kernel_name, arch, dtype, head_dim), "shared": compiled.metadata.shared}


def cases(*, everything: bool = False) -> list[tuple[str, int, torch.dtype, int]]:
    """(kernel, arch, dtype, head dim) to compile. fp32 at head dim 128 takes ptxas minutes and
    needs more shared memory than any GPU has (464 KiB), so it is left out unless `everything`."""
    combos = [(t, d) for t in DTYPES for d in HEAD_DIMS if everything or (t, d) != (torch.float32, 128)]
    return [(k, a, t, d) for a in ARCHS for t, d in combos for k in KERNELS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--all", action="store_true", help="also fp32 at head dim 128")
    args = parser.parse_args()
    with ProcessPoolExecutor(args.jobs) as pool:
        for row in pool.map(compile_case, *zip(*cases(everything=args.all), strict=True)):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

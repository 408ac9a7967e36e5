"""Compile the kernels ahead of time, without a GPU (Triton's bundled ptxas),
for Ampere / Ada (sm_80; sm_86 and sm_89 get the same code) and Hopper (sm_90), with the launch
settings `t5kernels.launch.cuda_settings` gives them, and print one JSON line per kernel with the
shared memory per block it needs. Run in a process where `t5kernels` is compiled, not interpreted:

    python -m tools.compile_cuda             # what the tests check
    python -m tools.compile_cuda --jobs 2    # in two processes
    python -m tools.compile_cuda --all       # also fp32 at head dim 128 (minutes of ptxas)
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

from t5kernels import bwd, fwd, locality_bwd, reduce
from t5kernels.launch import cuda_settings

ARCHS = (80, 90)
DTYPES = (torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 128)
# name: (kernel, launch phase, its flags, the pointers in the activations' dtype; others are fp32)
HEAVY_KERNELS = {
    "inner_step_fwd": (fwd.inner_step_fwd_kernel, "fwd", dict(HAS_NORM=True), {"k_ptr", "v_ptr"}),
    "inner_apply_fwd": (fwd.inner_apply_fwd_kernel, "fwd", {}, {"q_ptr", "out_ptr"}),
    "inner_apply_bwd": (bwd.inner_apply_bwd_kernel, "bwd", {}, {"q_ptr", "do_ptr"}),
    "inner_step_bwd": (bwd.inner_step_bwd_kernel, "bwd", dict(HAS_NORM=True), {"k_ptr", "v_ptr", "dv_ptr"}),
}
# the rest, without D x D tiles: compiled at head dim 64 only, to show they compile at all
LIGHT_KERNELS = {
    "key_stats_fwd": (reduce.key_stats_fwd_kernel, "fwd", {}, {"k_ptr"}),
    "combine": (reduce.combine_kernel, "fwd", dict(HAS_BASE=True, BLOCK=1024), set()),
    "locality_bwd": (locality_bwd.locality_bwd_kernel, "bwd", dict(HAS_NORM=True), {"x_ptr", "dx_ptr"}),
    "key_norm_bwd": (locality_bwd.key_norm_bwd_kernel, "bwd", {}, {"k_ptr", "dk_ptr"}),
}
KERNELS = {**HEAVY_KERNELS, **LIGHT_KERNELS}
# per-token map kernels take the map tile
_MAP_KERNELS = {"inner_apply_fwd", "key_norm_bwd"}
_FLOAT_ARGS = {"eps", "coef", "dk_scale", "dv_scale"}
_TL = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def case_id(kernel: str, arch: int, dtype: torch.dtype, head_dim: int, flipped: bool = False) -> str:
    return f"{kernel}-sm{arch}-{str(dtype).removeprefix('torch.')}-D{head_dim}" + ("-flipped" if flipped else "")


def compile_case(kernel_name: str, arch: int, dtype: torch.dtype, head_dim: int, flipped: bool = False) -> dict:
    """Compile one kernel: SD3.5-style 24 heads, swiglu, locality, key norm, text last; `flipped`
    takes the other branch of every flag (mlp, no locality, no key norm, text first)."""
    kernel, phase, flags, activations = KERNELS[kernel_name]
    settings = cuda_settings(dtype, phase)
    is_map = kernel_name in _MAP_KERNELS
    shape = dict(
        H=24, D=head_dim, NW=3, SWIGLU=True, HAS_CONV=True, TEXT_FIRST=False, DT=_TL[dtype],
        BLOCK_N=settings.map_block_n if is_map else settings.block_n,
    )  # fmt: skip
    if flipped:
        shape.update(NW=2, SWIGLU=False, HAS_CONV=False, TEXT_FIRST=True)
        flags = {name: False if isinstance(value, bool) else value for name, value in flags.items()}
    constexprs = {name: value for name, value in {**shape, **flags}.items() if name in kernel.arg_names}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER[dtype] if name in activations else "*fp32"
        else:
            signature[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    options = {"num_warps": settings.num_warps, "num_stages": 1 if is_map else settings.num_stages}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {"id": case_id(kernel_name, arch, dtype, head_dim, flipped), "shared": compiled.metadata.shared}


def cases(*, everything: bool = False) -> list[tuple[str, int, torch.dtype, int, bool]]:
    """(kernel, arch, dtype, head dim, flipped) to compile. fp32 at head dim 128 takes ptxas minutes
    and needs more shared memory than any GPU has (464 KiB), so it is left out unless `everything`."""
    combos = [(t, d) for t in DTYPES for d in HEAD_DIMS if everything or (t, d) != (torch.float32, 128)]
    heavy = [(k, a, t, d, False) for a in ARCHS for t, d in combos for k in HEAVY_KERNELS]
    light = [(k, a, t, 64, False) for a in ARCHS for t in DTYPES for k in LIGHT_KERNELS]
    return heavy + light + [(k, 90, torch.bfloat16, 64, True) for k in KERNELS]


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

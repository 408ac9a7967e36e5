"""Compile the heavy kernels for Hopper (sm_90) ahead of time, without a GPU, with the launch
settings `t5kernels.launch.cuda_settings` gives them, and print one JSON line per kernel with its
shared memory. Run in a process where `t5kernels` is compiled, not interpreted:

    python -m tests.t5kernels.compile_sm90
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from t5kernels import bwd, fwd
from t5kernels.launch import cuda_settings

_FLOAT_ARGS = {"eps", "coef", "dk_scale", "dv_scale"}
_TL = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# SD3.5 Medium: 24 heads x 64; activations in the case dtype, fast weights and buffers fp32
_SHAPE = {"H": 24, "D": 64, "TEXT_FIRST": False}
_ACTIVATIONS = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dv_ptr", "out_ptr")


def _compile(kernel, constexprs: dict, dtype: torch.dtype, *, num_warps: int, num_stages: int):
    pointer = "*bf16" if dtype == torch.bfloat16 else "*fp32"
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer if name in _ACTIVATIONS else "*fp32"
        else:
            signature[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    source = ASTSource(kernel, signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cases() -> list[tuple[str, object, dict, torch.dtype, str]]:
    """(id, kernel, constexprs, dtype, phase) of the kernels that hold D x D tiles."""
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        flags = dict(_SHAPE, NW=3, SWIGLU=True, HAS_CONV=True, DT=_TL[dtype])
        name = str(dtype).removeprefix("torch.")
        out += [
            (f"inner_step_fwd-{name}", fwd.inner_step_fwd_kernel, dict(flags, HAS_NORM=True), dtype, "fwd"),
            (f"inner_apply_bwd-{name}", bwd.inner_apply_bwd_kernel, flags, dtype, "bwd"),
            (f"inner_step_bwd-{name}", bwd.inner_step_bwd_kernel, dict(flags, HAS_NORM=True), dtype, "bwd"),
        ]
    flags = dict(_SHAPE, NW=3, SWIGLU=True, HAS_CONV=True, DT=tl.bfloat16)
    out.append(("inner_apply_fwd-bfloat16", fwd.inner_apply_fwd_kernel, flags, torch.bfloat16, "fwd"))
    return out


def main() -> None:
    for case_id, kernel, constexprs, dtype, phase in cases():
        settings = cuda_settings(dtype, phase)
        is_map = kernel is fwd.inner_apply_fwd_kernel
        constexprs = dict(constexprs, BLOCK_N=settings.map_block_n if is_map else settings.block_n)
        stages = 1 if is_map else settings.num_stages
        compiled = _compile(kernel, constexprs, dtype, num_warps=settings.num_warps, num_stages=stages)
        print(json.dumps({"id": case_id, "shared": compiled.metadata.shared}), flush=True)


if __name__ == "__main__":
    main()

"""Developer tools, each run from the repository root as a module; the tests call them, never copy them.

    python -m tools.docs_check              # every name the docs give exists in the code
    python -m tools.compile_cuda            # ptxas compile of every kernel for sm_80 / sm_90, no GPU needed
    python -m tools.comfy_dynamic_vram      # T5 Linearize in a real ComfyUI server (Dynamic VRAM on CUDA)

They are not installed with the package: like `testing/` and `benchmarks/`, they work on a checkout.
"""

"""Hosts that put T5 attention into a model: `diffusers` (SD3Transformer2DModel) and `comfy`
(ComfyUI's MMDiT ModelPatcher). Import the one you need; neither is imported here.

Both offer the same names for the same jobs: `linearize(model, ...)` (arguments keyword-only after
the model, and after the weights for ComfyUI), `arch_of(model)` and `converted_layers(model)`. Both
read and check weights files through `t5core.convert.prepare`; the parts that run inside the model
on each call are in `diffusers_runtime` and `comfy_runtime`."""

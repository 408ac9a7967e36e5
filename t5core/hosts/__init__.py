"""Hosts that put T5 attention into a model: `diffusers` (SD3Transformer2DModel) and `comfy`
(ComfyUI's MMDiT ModelPatcher). Import the one you need; neither is imported here."""

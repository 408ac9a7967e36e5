"""ComfyUI entry point of the T5 Linearize node pack: ComfyUI loads this folder from `custom_nodes/`."""

from .nodes import comfy_entrypoint

__all__ = ["comfy_entrypoint"]

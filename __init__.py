"""ComfyUI entry point of the T5 Linearize node pack: ComfyUI loads this folder from `custom_nodes/`.

ComfyUI imports this file as a package. A tool that imports it as a lone module, as pytest does when
the checkout's folder name is not a Python identifier (`comfyui-t5-linearize`), has no package to
import from, and gets nothing.
"""

if __package__:
    from .nodes import comfy_entrypoint

    __all__ = ["comfy_entrypoint"]

"""The ComfyUI patcher of the T5 modules, and the per-device clones MultiGPU CFG Split makes.

ComfyUI 0.33's MultiGPU CFG Split runs a clone of the model on each extra GPU
(`ModelPatcher.deepclone_multigpu`): a freshly loaded model from the loader's factory
(`cached_patcher_init`), the converted model's weight patches, wrappers and object patches, and each
additional model deep-cloned the same way. For the T5 modules that factory builds them again from the
weights file (`t5_patcher`). The object patches come over as they are, so `PerDeviceClone`, registered
for the clone callbacks, gives the clone block patches that run its own T5 modules and replacement
modules (the q/k RMSNorm scales) of its own, never the first GPU's.

ComfyUI is imported inside the functions that need it, so importing this module works without it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

from t5core.hosts.comfy_runtime import KEY, JointForward, T5Modules
from t5core.weights import build_modules, load

__all__ = ["PerDeviceClone", "fresh_copy", "t5_modules", "t5_patcher"]


def fresh_copy(module: nn.Module) -> nn.Module:
    """A copy of a model module to install in its place. ComfyUI marks the modules whose weights it
    patched for the clone it loaded (`comfy_patched_weights`) and skips marked modules when it loads the
    next one; a copy that inherited the mark would never get a LoRA's patch of its weights."""
    replacement = copy.deepcopy(module)
    vars(replacement).pop("comfy_patched_weights", None)
    return replacement


def t5_modules(model_patcher: Any) -> T5Modules | None:
    """The T5 modules a converted ModelPatcher carries (its additional model), None for another model."""
    additional = getattr(model_patcher, "additional_models", {}).get(KEY, [])
    return additional[0].model if additional else None


def _new_patcher(modules: T5Modules, load_device: Any, offload_device: Any, dynamic: bool) -> Any:
    import comfy.model_patcher

    kind = comfy.model_patcher.ModelPatcherDynamic if dynamic else comfy.model_patcher.ModelPatcher
    return kind(modules, load_device=load_device, offload_device=offload_device)


def _reload(
    path: str,
    layers: tuple[str, ...],
    backend: str,
    summary: str,
    load_device: Any,
    offload_device: Any,
    dynamic: bool,
    disable_dynamic: bool = False,
) -> Any:
    """`cached_patcher_init` factory: a patcher of T5 modules built again from the weights file at `path`."""
    modules = T5Modules(build_modules(load(path), layers, backend=backend), summary)
    modules.requires_grad_(False)
    return _new_patcher(modules, load_device, offload_device, dynamic and not disable_dynamic)


def t5_patcher(model_patcher: Any, modules: T5Modules, *, path: str, backend: str) -> Any:
    """A patcher for the T5 modules of the same kind as the model's, whose factory builds them again
    from the weights file at `path` (for ComfyUI's per-device and non-dynamic clones). With Dynamic
    VRAM (ComfyUI 0.33 on NVIDIA) a plain `ModelPatcher` among the models to load makes ComfyUI fall
    back to estimate-based freeing, which unloads the dynamic diffusion model too."""
    dynamic = getattr(model_patcher, "is_dynamic", lambda: False)()
    patcher = _new_patcher(modules, model_patcher.load_device, model_patcher.offload_device, dynamic)
    settings = (modules.layers(), backend, modules.summary, model_patcher.load_device, model_patcher.offload_device)
    patcher.cached_patcher_init = (_reload, (path, *settings, dynamic))
    return patcher


@dataclass(frozen=True)
class PerDeviceClone:
    """Callback for ComfyUI's `ON_DEEPCLONE_MULTIGPU` and `ON_MATCH_MULTIGPU_CLONES`: on a per-device clone
    of a converted model, point each block patch at the clone's own T5 modules and copy each replacement
    module.

    Args:
        replaced: the object patch names of the replacement modules
            (`diffusion_model.joint_blocks.1.x_block.attn.ln_q`).
    """

    replaced: tuple[str, ...]

    def __call__(self, source: Any, clone: Any) -> None:
        modules = t5_modules(clone)
        if modules is None:
            raise RuntimeError(
                "T5 Linearize: ComfyUI made a per-device clone of the model without its T5 modules. Report "
                "this with your ComfyUI version; set max_gpus to 1 on MultiGPU CFG Split meanwhile."
            )
        for name, patch in list(clone.object_patches.items()):
            if isinstance(patch, JointForward):
                clone.object_patches[name] = JointForward.of(modules, patch.index)
            elif name in self.replaced:
                clone.object_patches[name] = fresh_copy(patch)

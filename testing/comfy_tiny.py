"""A tiny SD3.5-Medium-like model in ComfyUI for the ComfyUI tests and checks: checkpoint and T5
weights file writers, seeded deltas for such a file, seeded inputs and one model evaluation the way
samplers make it (the session fixtures built from them are in `testing.fixtures`).

ComfyUI's MMDiT fixes head_dim = 64 and heads = depth, so the model is the `comfy_sd35_medium_like`
preset of `testing.models` (2 blocks, 2 heads x 64, MMDiT-X `attn2` on block 0).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from t5core import T5Attention, T5Config
from t5core.config import BaseArch
from t5core.deltas import Delta
from t5core.weights import save as save_t5_weights

PRESET = "comfy_sd35_medium_like"


def write_checkpoint(path: Path, transformer: torch.nn.Module, *, prefix: str = "model.diffusion_model.") -> Path:
    """Save a diffusers SD3 transformer as an SD3-format checkpoint (SD3 key names, `prefix`)."""
    from t5core.hosts.diffusers import arch_of
    from t5core.sd3_keys import diffusers_to_sd3

    state = diffusers_to_sd3(transformer.state_dict(), arch_of(transformer))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + key: tensor.contiguous() for key, tensor in state.items()}, str(path))
    return path


def write_t5_weights(
    path: Path,
    arch: BaseArch,
    layers: tuple[str, ...],
    *,
    seed: int = 0,
    fast_weight_std: float | None = 0.3,
    base: dict[str, torch.Tensor] | None = None,
    deltas: dict[str, Delta] | None = None,
    fingerprint: str | None = None,
    made_by: str = "tests",
    joint_mode: str = "ttt",
    merge: str = "cumulant",
    neighborhood: int = 0,
) -> Path:
    """A T5 weights file with seeded random swiglu modules for `layers`.

    Args:
        path (`Path`):
            The file to write.
        arch (`BaseArch`):
            The base model the file is for.
        layers (`tuple[str, ...]`):
            The resolved layer names (`blocks.{i}.attn`, `blocks.{i}.attn2`).
        seed (`int`):
            Seed of the modules. Default: `0`.
        fast_weight_std (`float`, *optional*):
            Redraw the fast weights with this std, raised from the init so T5 visibly matters; `None`
            keeps `T5Attention`'s own init. Default: `0.3`.
        base (`dict[str, Tensor]`, *optional*):
            `base.*` tensors (fine-tuned inherited weights, SD3 key names). Default: none.
        deltas (`dict[str, Delta]`, *optional*):
            Deltas to inherited weights (SD3 key names; `seeded_deltas`). Default: none.
        fingerprint (`str`, *optional*):
            The base's fingerprint (`t5core.deltas.fingerprint`). Default: none.
        made_by (`str`):
            The file's provenance. Default: `"tests"`.
        joint_mode, merge (`str`), neighborhood (`int`):
            `T5Config` settings; a learned merge bias is drawn from N(0, 1) so that it matters.
            Default: `"ttt"`, `"cumulant"`, `0`.

    Returns:
        `path`.
    """
    torch.manual_seed(seed)
    config = T5Config("swiglu", 1.0, True, layers, joint_mode=joint_mode, merge=merge, neighborhood=neighborhood)
    modules = {name: T5Attention.from_config(config, arch.heads, arch.head_dim, layer=name) for name in layers}
    with torch.no_grad():
        for module in modules.values():
            if fast_weight_std is not None:
                for weight in module.fast_weights():
                    weight.normal_(0.0, fast_weight_std)
            if module.merge_bias is not None:
                module.merge_bias.normal_(0.0, 1.0)
    return save_t5_weights(
        path,
        modules,
        arch=arch,
        config=config,
        base=base,
        deltas=deltas,
        fingerprint=fingerprint,
        provenance={"made_by": made_by},
    )


def seeded_deltas(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    low_rank: Collection[str] = (),
    seed: int = 0,
    rank: int = 4,
    std: float = 0.3,
) -> tuple[dict[str, Delta], dict[str, torch.Tensor]]:
    """Seeded deltas for SD3-named tensors, and the dense value of each, computed here part by part
    (the expectation of a test, independent of `Delta.full`).

    Args:
        shapes (`Mapping[str, tuple[int, ...]]`):
            The shape of every tensor to change, by SD3 name.
        low_rank (`Collection[str]`):
            The names whose delta is low rank: 3 parts on a fused qkv (`*.qkv.weight`), else 1. The
            others get a full diff. Default: none.
        seed (`int`):
            Seed of the values. Default: `0`.
        rank (`int`):
            Rank of the low-rank deltas. Default: `4`.
        std (`float`):
            Std of each factor; a full diff gets `std` squared times `rank` ** 0.5, the scale of the
            low-rank products. Default: `0.3`.

    Returns:
        SD3 name -> `Delta`, and SD3 name -> dense float32 delta.
    """
    generator = torch.Generator().manual_seed(seed)
    deltas, dense = {}, {}
    for key, shape in shapes.items():
        if key not in low_rank:
            diff = std * std * rank**0.5 * torch.randn(shape, generator=generator)
            deltas[key], dense[key] = Delta(diff=diff), diff
            continue
        parts = 3 if key.endswith(".qkv.weight") else 1
        rows, cols = shape[0] // parts, shape[1]
        up = std * torch.randn(parts, rows, rank, generator=generator)
        down = std * torch.randn(parts, rank, cols, generator=generator)
        deltas[key] = Delta(up=up, down=down)
        dense[key] = torch.cat([up[part] @ down[part] for part in range(parts)])
    return deltas, dense


def predict(patcher, x: torch.Tensor, sigma: float, context: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """One model evaluation as ComfyUI's samplers make it: load and patch the model and its
    additional models, merge the patcher's wrappers into `transformer_options`, `apply_model`.

    Returns:
        The model's velocity prediction `(x - denoised) / sigma`, fp32 on CPU.
    """
    import comfy.model_management

    comfy.model_management.load_models_gpu([patcher, *patcher.get_nested_additional_models()])
    return apply_loaded(patcher, x, sigma, context, pooled)


def apply_loaded(patcher, x: torch.Tensor, sigma: float, context: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """`predict` on a patcher already loaded (by `predict` or `load_partially`): merge its wrappers
    into `transformer_options`, `apply_model`, return the velocity prediction, fp32 on CPU."""
    import comfy.model_management
    import comfy.patcher_extension

    options = comfy.patcher_extension.copy_nested_dicts(patcher.model_options["transformer_options"])
    comfy.patcher_extension.merge_nested_dicts(options.setdefault("wrappers", {}), patcher.wrappers, copy_dict1=False)
    device = comfy.model_management.get_torch_device()
    sigmas = torch.full((x.shape[0],), sigma, device=device)
    with torch.no_grad():
        denoised = patcher.model.apply_model(
            x.to(device), sigmas, c_crossattn=context.to(device), y=pooled.to(device), transformer_options=options
        )
    return ((x.to(device) - denoised.float()) / sigma).cpu()


def load_partially(patcher, budget: int) -> list:
    """Load `patcher` and its additional models as ComfyUI's low-VRAM mode does, each with at most
    `budget` bytes of weights on the device: `ModelPatcher.patch_model(device, lowvram_model_memory=budget)`,
    ComfyUI's module-by-module load (layers that do not fit stay on the offload device and are cast
    per call). `load_models_gpu` takes this path on a GPU short of memory and never on the CPU, so the
    tests call it directly. Every model ComfyUI had loaded is unloaded first.

    Returns:
        The patchers loaded; give them to `unload` when done.
    """
    import comfy.model_management

    comfy.model_management.unload_all_models()
    device = comfy.model_management.get_torch_device()
    patchers = [patcher, *patcher.get_nested_additional_models()]
    for each in patchers:
        each.patch_model(device, lowvram_model_memory=budget)
    return patchers


def unload(patchers: list) -> None:
    """Undo `load_partially`: restore each patcher's model (weights, object patches, low-VRAM casts)."""
    for each in patchers:
        each.detach()


def inputs(batch: int = 2, latent_hw: tuple[int, int] = (12, 20), text: int = 7, seed: int = 3) -> dict:
    """Seeded latents `x`, text features `context` and pooled vectors for the tiny model."""
    generator = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, 16, *latent_hw, generator=generator),
        context=torch.randn(batch, text, 32, generator=generator),
        pooled=torch.randn(batch, 64, generator=generator),
    )


def run(patcher, batch: dict, sigma: float = 0.6) -> torch.Tensor:
    """`predict` on a batch made by `inputs`."""
    return predict(patcher, batch["x"], sigma, batch["context"], batch["pooled"])


def run_loaded(patcher, batch: dict, sigma: float = 0.6) -> torch.Tensor:
    """`apply_loaded` on a batch made by `inputs`."""
    return apply_loaded(patcher, batch["x"], sigma, batch["context"], batch["pooled"])


def snapshot(patcher) -> dict:
    """What a node could change on a ModelPatcher; values compare by identity (tensors, callables)."""
    return {
        "object_patches": dict(patcher.object_patches),
        "patches": {key: list(value) for key, value in patcher.patches.items()},
        "wrappers": {
            kind: {key: list(fns) for key, fns in by_key.items()} for kind, by_key in patcher.wrappers.items()
        },
        "additional_models": dict(patcher.additional_models),
        "transformer_options": copy.deepcopy(patcher.model_options["transformer_options"]),
    }


def checkpoint_state(checkpoint) -> dict[str, torch.Tensor]:
    """The unpatched weights, in ComfyUI's `diffusion_model.*` naming (the live modules may hold
    another clone's patched weights until ComfyUI loads a different clone)."""
    return {
        f"diffusion_model.{key.removeprefix('model.diffusion_model.')}": t
        for key, t in load_file(str(checkpoint)).items()
    }

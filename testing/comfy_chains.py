"""Pieces for the chains tests (tests/nodes/test_chains.py) that `testing.comfy_prompts` does not
build: the cache and MultiGPU model nodes, a tiny SD3 ControlNet file and a tiny TAESD3 (the VAE an
SD3 ControlNet encodes its image with), the ControlNet nodes spliced into a `sampling_prompt`, and a
fake second device for MultiGPU CFG Split on a machine with one.

ComfyUI is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from testing.comfy_prompts import ModelNode
from testing.models import tiny_transformer

CONTROLNET_APPLY_NODE = "23"
"""The id of the ControlNet apply node `with_controlnet` adds (the KSampler's conditioning comes from it)."""


def cache_node(
    kind: Literal["EasyCache", "LazyCache"], *, reuse_threshold: float, start_percent: float = 0.0
) -> ModelNode:
    """ComfyUI's `EasyCache` or `LazyCache` node, active until the end of sampling (end_percent 1)."""
    inputs = {"reuse_threshold": reuse_threshold, "start_percent": start_percent, "end_percent": 1.0}
    return kind, {**inputs, "verbose": False}


def multigpu_node(max_gpus: int = 2) -> ModelNode:
    """ComfyUI 0.33's "MultiGPU CFG Split" node (`MultiGPU_WorkUnits`)."""
    return "MultiGPU_WorkUnits", {"max_gpus": max_gpus}


def skipped_steps(messages: list[str], kind: str) -> list[tuple[int, int]]:
    """(skipped, total) from each summary line an EasyCache / LazyCache run logged
    ("LazyCache - skipped 2/6 steps (1.50x speedup).")."""
    pattern = re.compile(rf"^{kind} - skipped (\d+)/(\d+) steps")
    return [(int(m[1]), int(m[2])) for m in map(pattern.match, messages) if m]


def write_sd3_controlnet(path: Path, *, preset: str, seed: int = 0, std: float = 0.05) -> Path:
    """A one-block ControlNet in the diffusers SD3 layout, with seeded random weights.

    ComfyUI's `load_controlnet_state_dict` takes a file with `controlnet_blocks.0.weight` and
    `pos_embed_input.proj.weight` but no `transformer_blocks.0.adaLN_modulation.1.bias` for an SD3
    diffusers ControlNet (`load_controlnet_mmdit`) and reads its size from the transformer keys. Those
    come from block 0 of a tiny transformer of `preset` (a full block: the last one of an SD3
    transformer has no text output, which every ControlNet block needs); the final layer is dropped,
    and each ControlNet block projection and the hint's patch embedding are drawn with `std`.

    Args:
        path (`Path`):
            The file to write.
        preset (`str`):
            A `testing.models` preset, the same as the model's so the sizes match.
        seed (`int`):
            Seed of every weight. Default: `0`.
        std (`float`):
            Std of the ControlNet's own projections. Default: `0.05`.

    Returns:
        `path`.
    """
    transformer = tiny_transformer(preset, seed=seed, all_random=True)
    state = {
        key: tensor
        for key, tensor in transformer.state_dict().items()
        if not key.startswith(("norm_out.", "proj_out.")) and not re.match(r"transformer_blocks\.[1-9]", key)
    }
    hidden, channels, patch, _ = state["pos_embed.proj.weight"].shape
    generator = torch.Generator().manual_seed(seed + 1)
    state["controlnet_blocks.0.weight"] = std * torch.randn(hidden, hidden, generator=generator)
    state["controlnet_blocks.0.bias"] = std * torch.randn(hidden, generator=generator)
    state["pos_embed_input.proj.weight"] = std * torch.randn(hidden, channels, patch, patch, generator=generator)
    state["pos_embed_input.proj.bias"] = torch.zeros(hidden)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({key: tensor.contiguous() for key, tensor in state.items()}, str(path))
    return path


def write_taesd3(folder: Path, *, seed: int = 0) -> None:
    """`taesd3_encoder.safetensors` and `taesd3_decoder.safetensors` with seeded random weights, so
    `VAELoader` offers "taesd3" (ComfyUI's tiny SD3 autoencoder, 16 latent channels, 8x downscale).

    ComfyUI builds TAESD without initialising its weights, so every weight is drawn here: N(0, 1 /
    fan_in) for convolutions, zero biases, which keeps the encoded latents finite and of order one.

    Args:
        folder (`Path`):
            ComfyUI's `models/vae_approx/`.
        seed (`int`):
            Seed of the weights. Default: `0`.
    """
    from comfy.taesd.taesd import TAESD

    autoencoder = TAESD(latent_channels=16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in autoencoder.parameters():
            if parameter.dim() > 1:
                fan_in = parameter[0].numel()
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in**0.5)
            else:
                parameter.zero_()
    folder.mkdir(parents=True, exist_ok=True)
    for part, module in (("encoder", autoencoder.taesd_encoder), ("decoder", autoencoder.taesd_decoder)):
        state = {key: tensor.contiguous() for key, tensor in module.state_dict().items()}
        save_file(state, str(folder / f"taesd3_{part}.safetensors"))


def with_controlnet(
    prompt: dict,
    *,
    controlnet: str,
    vae: str = "taesd3",
    strength: float = 1.0,
    apply_node: Literal["ControlNetApplyAdvanced", "ControlNetApplySD3"] = "ControlNetApplyAdvanced",
) -> dict:
    """A `sampling_prompt` with a ControlNet on both conditionings: ControlNetLoader, VAELoader and an
    `EmptyImage` of the latent's size in pixels (a solid colour) into `apply_node`, whose outputs feed
    the KSampler. `prompt` is left unchanged.

    Args:
        prompt (`dict`):
            A prompt from `testing.comfy_prompts.sampling_prompt`.
        controlnet (`str`):
            A file in `models/controlnet/`.
        vae (`str`):
            A `VAELoader` choice. Default: `"taesd3"` (`write_taesd3`).
        strength (`float`):
            The ControlNet's strength. Default: `1.0`.
        apply_node (`str`):
            `ControlNetApplyAdvanced` ("Apply ControlNet") or the SD3 node (deprecated in 0.33).
            Default: `"ControlNetApplyAdvanced"`.

    Returns:
        The new prompt (ids "20" to "23" added).
    """
    out = {node_id: {**node, "inputs": dict(node["inputs"])} for node_id, node in prompt.items()}
    sampler, latent = out["7"]["inputs"], out["6"]["inputs"]
    out["20"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": controlnet}}
    out["21"] = {"class_type": "VAELoader", "inputs": {"vae_name": vae}}
    out["22"] = {
        "class_type": "EmptyImage",
        "inputs": {"width": latent["width"], "height": latent["height"], "batch_size": 1, "color": 0x3080C0},
    }
    out[CONTROLNET_APPLY_NODE] = {
        "class_type": apply_node,
        "inputs": {
            "positive": sampler["positive"],
            "negative": sampler["negative"],
            "control_net": ["20", 0],
            "vae": ["21", 0],
            "image": ["22", 0],
            "strength": strength,
            "start_percent": 0.0,
            "end_percent": 1.0,
        },
    }
    sampler["positive"], sampler["negative"] = [CONTROLNET_APPLY_NODE, 0], [CONTROLNET_APPLY_NODE, 1]
    return out


@contextlib.contextmanager
def second_device() -> Iterator[torch.device]:
    """ComfyUI sees two devices, the one it runs on and a second CPU (`cpu:1`, whose tensors live in
    the same memory), so MultiGPU CFG Split clones the model for it and the sampler sends it half the
    conds, on a worker thread, as on a machine with two GPUs. Only on the CPU; on exit ComfyUI unloads
    every model (the `cpu:1` clones included) and sees one device again.

    Yields:
        The second device.
    """
    import comfy.model_management

    main = comfy.model_management.get_torch_device()
    if main.type != "cpu":
        raise RuntimeError(f"second_device fakes a second CPU; ComfyUI runs on {main}")
    extra = torch.device("cpu", 1)
    original = comfy.model_management.get_all_torch_devices

    def both(exclude_current: bool = False) -> list[torch.device]:
        return [extra] if exclude_current else [main, extra]

    comfy.model_management.get_all_torch_devices = both
    try:
        yield extra
    finally:
        comfy.model_management.unload_all_models()
        comfy.model_management.get_all_torch_devices = original

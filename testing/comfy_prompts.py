"""API-format ComfyUI prompts that sample the tiny model, shared by the node tests and the Dynamic VRAM
check: CheckpointLoaderSimple -> ModelSamplingSD3 -> [model nodes before] -> T5 Linearize -> [model
nodes after] -> KSampler (CFG, text of two lengths, a non-square batch-2 latent) -> SaveLatent (node
"8", whose file `saved_latents` reads)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ModelNode = tuple[str, dict]
"""A node that takes a MODEL (input `model`) and returns one (output 0): its class type and its other inputs."""

SAVE_NODE = "8"


def lora_node(name: str, strength: float = 1.0) -> ModelNode:
    """`LoraLoaderModelOnly` for `models/loras/{name}`."""
    return "LoraLoaderModelOnly", {"lora_name": name, "strength_model": strength}


def sampling_prompt(
    *,
    checkpoint: str,
    weights: str,
    prefix: str,
    layers: str = "",
    enabled: bool = True,
    schedule: tuple[float, float] | None = None,
    lora: str | None = None,
    before: Sequence[ModelNode] = (),
    after: Sequence[ModelNode] = (),
    steps: int = 2,
) -> dict:
    """The prompt.

    Args:
        checkpoint, weights: file names in `models/checkpoints/` and `models/t5_linearize/`.
        prefix: SaveLatent's file name prefix.
        layers, enabled: the T5 Linearize inputs.
        schedule: its (start_percent, end_percent); None leaves them out (every step, as in a prompt
            saved before the node had them).
        lora: a file in `models/loras/` loaded after T5 Linearize (strength 1), after `after`.
        before, after: model nodes chained, in order, between ModelSamplingSD3 and T5 Linearize and
            between T5 Linearize and the KSampler (ids "10", "11", ...).
        steps: KSampler steps.
    """
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": checkpoint}},
        "2": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 3.0}},
        "3": {
            "class_type": "T5Linearize",
            "inputs": {
                "weights": weights,
                "layers": layers,
                "enabled": enabled,
                **(dict(zip(("start_percent", "end_percent"), schedule, strict=True)) if schedule else {}),
            },
        },
        "4": {
            "class_type": "T5TestConditioning",
            "inputs": {"seed": 1, "tokens": 154, "context_dim": 32, "pooled_dim": 64},
        },
        "5": {
            "class_type": "T5TestConditioning",
            "inputs": {"seed": 2, "tokens": 77, "context_dim": 32, "pooled_dim": 64},
        },
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 160, "height": 96, "batch_size": 2}},
        "7": {
            "class_type": "KSampler",
            "inputs": {
                "seed": 42,
                "steps": steps,
                "cfg": 4.5,
                "sampler_name": "euler",
                "scheduler": "sgm_uniform",
                "positive": ["4", 0],
                "negative": ["5", 0],
                "latent_image": ["6", 0],
                "denoise": 1.0,
            },
        },
        SAVE_NODE: {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": prefix}},
    }
    extra = [*after, *([lora_node(lora)] if lora is not None else [])]
    source = "2"
    # None stands for T5 Linearize ("3") in the chain of model nodes
    for number, node in enumerate([*before, None, *extra], start=10):
        node_id = "3" if node is None else str(number)
        if node is not None:
            prompt[node_id] = {"class_type": node[0], "inputs": dict(node[1])}
        prompt[node_id]["inputs"]["model"] = [source, 0]
        source = node_id
    prompt["7"]["inputs"]["model"] = [source, 0]
    return prompt


def saved_latents(output_dir: Path, outputs: dict) -> torch.Tensor:
    """The latents SaveLatent wrote for a finished prompt (`outputs`: its history or executor outputs)."""
    from safetensors.torch import load_file

    saved = outputs[SAVE_NODE]["latents"][0]
    return load_file(str(output_dir / saved["subfolder"] / saved["filename"]))["latent_tensor"]

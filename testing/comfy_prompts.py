"""API-format ComfyUI prompts that sample the tiny model, shared by the node tests and the Dynamic VRAM
check: CheckpointLoaderSimple -> ModelSamplingSD3 -> T5 Linearize -> [LoraLoaderModelOnly] ->
KSampler (CFG, text of two lengths, a non-square batch-2 latent) -> SaveLatent."""

from __future__ import annotations


def sampling_prompt(
    *,
    checkpoint: str,
    weights: str,
    prefix: str,
    layers: str = "",
    enabled: bool = True,
    lora: str | None = None,
    steps: int = 2,
) -> dict:
    """The prompt; `lora` names a file in `models/loras/` loaded after T5 Linearize (strength 1)."""
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": checkpoint}},
        "2": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 3.0}},
        "3": {
            "class_type": "T5Linearize",
            "inputs": {"model": ["2", 0], "weights": weights, "layers": layers, "enabled": enabled},
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
                "model": ["3", 0],
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
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": prefix}},
    }
    if lora is not None:
        prompt["9"] = {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {"model": ["3", 0], "lora_name": lora, "strength_model": 1.0},
        }
        prompt["7"]["inputs"]["model"] = ["9", 0]
    return prompt

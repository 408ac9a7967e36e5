"""Tiny SD3-family diffusers transformers with seeded random weights, and SD3.5 Medium's real config.

`sd35_medium_like` has patch 2, 16 latent channels, q/k RMSNorm, image-only `attn2` on the first
blocks and a last `context_pre_only` block without `attn2`, like SD3.5 Medium. `sd35_large_like`
drops `attn2`; `sd3_like` also drops the q/k norm. `trainer_sd35_medium_like` is the trainer tests'
2-block cut. The `comfy` presets use head_dim 64 with heads = depth, which ComfyUI's model detection
requires. `shipped_config` / `sd35_medium_config` read the full-size configs the trainer ships, so
nothing restates them (and, like this module's import, need no diffusers).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from t5core.config import BaseArch
from t5core.hosts.diffusers import arch_of
from trainer.model import CONFIGS_DIR

if TYPE_CHECKING:
    from diffusers import SD3Transformer2DModel

PRESETS: dict[str, dict] = {
    "sd35_medium_like": dict(
        num_layers=3, attention_head_dim=16, num_attention_heads=2, dual_attention_layers=(0, 1), qk_norm="rms_norm"
    ),
    "sd35_large_like": dict(
        num_layers=3, attention_head_dim=16, num_attention_heads=3, dual_attention_layers=(), qk_norm="rms_norm"
    ),
    "sd3_like": dict(
        num_layers=2, attention_head_dim=16, num_attention_heads=2, dual_attention_layers=(), qk_norm=None
    ),
    "trainer_sd35_medium_like": dict(
        num_layers=2, attention_head_dim=16, num_attention_heads=2, dual_attention_layers=(0,), qk_norm="rms_norm"
    ),
    "comfy_sd35_medium_like": dict(
        num_layers=2, attention_head_dim=64, num_attention_heads=2, dual_attention_layers=(0,), qk_norm="rms_norm"
    ),
}


def shipped_config(name: str) -> dict:
    """The `SD3Transformer2DModel` config of a base model whose config `trainer/` ships.

    Args:
        name (`str`):
            A folder of `trainer/configs/models/`: `"sd3.5_medium"`, `"sd3.5_large"` or `"sd3_medium"`.

    Returns:
        The constructor arguments from the folder's `config.json`, without its `_`-prefixed bookkeeping
        keys; `dual_attention_layers` as a tuple.
    """
    config = json.loads((CONFIGS_DIR / name / "config.json").read_text(encoding="utf-8"))
    config = {key: value for key, value in config.items() if not key.startswith("_")}
    return {**config, "dual_attention_layers": tuple(config["dual_attention_layers"])}


def sd35_medium_config() -> dict:
    """SD3.5 Medium's config (24 blocks, 24 heads x 64, `attn2` on blocks 0-12): `shipped_config("sd3.5_medium")`."""
    return shipped_config("sd3.5_medium")


def shipped_arch(name: str) -> BaseArch:
    """The `BaseArch` of a shipped config (`shipped_config`), read by the diffusers host from a model
    built on the meta device (no memory, no weights)."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        return arch_of(SD3Transformer2DModel(**shipped_config(name)))


def tiny_config(preset: str = "sd35_medium_like") -> dict:
    """The full `SD3Transformer2DModel` config of a preset."""
    spec = PRESETS[preset]
    hidden = spec["attention_head_dim"] * spec["num_attention_heads"]
    return dict(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        joint_attention_dim=32,
        caption_projection_dim=hidden,
        pooled_projection_dim=64,
        pos_embed_max_size=32,
        **spec,
    )


def tiny_transformer(
    preset: str = "sd35_medium_like", seed: int = 0, *, all_random: bool = False
) -> SD3Transformer2DModel:
    """A tiny transformer with seeded random weights, in eval mode, fp32 on CPU.

    Args:
        preset (`str`):
            A key of `PRESETS`. Default: `"sd35_medium_like"`.
        seed (`int`):
            Seed of the weights. Default: `0`.
        all_random (`bool`):
            Also draw (std 0.02) the weights diffusers initialises to zero, so every weight matters.
            Default: `False`.
    """
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**tiny_config(preset))
    if all_random:
        with torch.no_grad():
            for param in model.parameters():
                if param.abs().sum() == 0:
                    param.normal_(0, 0.02)
    return model.eval()


def tiny_inputs(batch: int = 2, latent_hw: tuple[int, int] = (12, 20), text_tokens: int = 7, seed: int = 1) -> dict:
    """Seeded transformer inputs: a non-square latent by default (a 6 x 10 token grid)."""
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, 16, *latent_hw, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, 32, generator=generator),
        pooled_projections=torch.randn(batch, 64, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )

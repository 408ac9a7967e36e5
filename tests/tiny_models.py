"""Tiny SD3-family diffusers transformers with seeded random weights, shared by the tests.

`sd35_medium_like` has patch 2, 16 latent channels, q/k RMSNorm, image-only `attn2` on the first
blocks and a last `context_pre_only` block without `attn2`, like SD3.5 Medium. `sd35_large_like`
drops `attn2`; `sd3_like` also drops the q/k norm. The `comfy` presets use head_dim 64 with
heads = depth, which ComfyUI's model detection requires.
"""

from __future__ import annotations

import torch
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
    "comfy_sd35_medium_like": dict(
        num_layers=2, attention_head_dim=64, num_attention_heads=2, dual_attention_layers=(0,), qk_norm="rms_norm"
    ),
}


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


def tiny_transformer(preset: str = "sd35_medium_like", seed: int = 0) -> SD3Transformer2DModel:
    """A tiny transformer with seeded random weights, in eval mode, fp32 on CPU."""
    torch.manual_seed(seed)
    return SD3Transformer2DModel(**tiny_config(preset)).eval()


def tiny_inputs(batch: int = 2, latent_hw: tuple[int, int] = (12, 20), text_tokens: int = 7, seed: int = 1) -> dict:
    """Seeded transformer inputs: a non-square latent by default (a 6 x 10 token grid)."""
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, 16, *latent_hw, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, 32, generator=generator),
        pooled_projections=torch.randn(batch, 64, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )

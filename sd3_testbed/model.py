"""The toy base model: a miniature SD3.5-Medium MMDiT, its shipped weights, and its captions' conditioning.

The architecture keeps everything the conversion depends on in SD3.5 Medium (q/k RMSNorm, image-only
`attn2` in the first half of the blocks, patch 2, 16 latent channels, a `context_pre_only` last
block) and keeps ComfyUI's constraint head_dim = 64, heads = depth: 4 blocks of 4 heads x 64
(hidden 256), attn2 on blocks 0-1, so 6 attention modules of which `paper` converts 3 (SD3.5
Medium: 18 of 37). At the default 48 px the image has 144 tokens; the positional table reaches
96 px (576 tokens). The shipped file uses the original SD3 checkpoint naming (`joint_blocks.*`,
`x_embedder`, `context_embedder`, ...), so ComfyUI detects it as an SD3 diffusion model; diffusers
loads it with `from_single_file` and the local `weights/config.json`, or through
`t5core.sd3_keys`, which `load_toy_base` uses.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sd3_testbed.data import IMAGE_SIZE, JOINT_ATTENTION_DIM, LATENT_CHANNELS, POOLED_DIM, embed_captions
from t5core.config import BaseArch
from t5core.sd3_keys import sd3_to_diffusers
from trainer.sampling import Conditioning

if TYPE_CHECKING:
    from diffusers import SD3Transformer2DModel

logger = logging.getLogger(__name__)

__all__ = [
    "TOY_CONFIG",
    "TOY_SHIFT",
    "WEIGHTS_DIR",
    "WEIGHTS_FILE",
    "ToyCond",
    "build_toy_model",
    "load_toy_base",
    "load_toy_record",
    "toy_arch",
]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
WEIGHTS_FILE = WEIGHTS_DIR / "toy_sd35.safetensors"
"""The shipped softmax teacher, SD3 checkpoint naming, written by `sd3_testbed/pretrain.py`."""
RECORD_FILE = WEIGHTS_DIR / "toy_sd35.json"
"""How the shipped teacher was made and its measured ToyEval."""

TOY_DEPTH = 4
TOY_CONFIG: dict[str, object] = {
    "sample_size": IMAGE_SIZE // 2,
    "patch_size": 2,
    "in_channels": LATENT_CHANNELS,
    "out_channels": LATENT_CHANNELS,
    "num_layers": TOY_DEPTH,
    "attention_head_dim": 64,
    "num_attention_heads": TOY_DEPTH,
    "joint_attention_dim": JOINT_ATTENTION_DIM,
    "caption_projection_dim": 64 * TOY_DEPTH,
    "pooled_projection_dim": POOLED_DIM,
    "pos_embed_max_size": 24,
    "dual_attention_layers": tuple(range((TOY_DEPTH + 1) // 2)),
    "qk_norm": "rms_norm",
}
"""diffusers `SD3Transformer2DModel` config of the toy (written as `weights/config.json`)."""

TOY_SHIFT = 1.0
"""Sampling shift of the toy (SD3 uses 3.0 at 1024 px; a 48 px toy needs none). In ComfyUI put
ModelSamplingSD3(shift=1.0) after the loader."""


def toy_arch() -> BaseArch:
    """The toy's `t5core.config.BaseArch` (4 blocks, 4 heads x 64, attn2 on 0-1, qk norm)."""
    return BaseArch(
        depth=TOY_DEPTH,
        heads=TOY_DEPTH,
        head_dim=64,
        dual_attention_layers=TOY_CONFIG["dual_attention_layers"],
        qk_norm=True,
    )


def build_toy_model(*, seed: int = 0) -> SD3Transformer2DModel:
    """A freshly initialised toy `SD3Transformer2DModel` (what pretraining starts from)."""
    from diffusers import SD3Transformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SD3Transformer2DModel(**TOY_CONFIG)


def load_toy_base(*, path: Path | str = WEIGHTS_FILE) -> SD3Transformer2DModel:
    """Load the shipped softmax teacher into a diffusers `SD3Transformer2DModel` (eval mode).

    Args:
        path (`Path | str`, *optional*): an SD3-named toy checkpoint; defaults to the shipped one.

    Raises:
        FileNotFoundError: the weights file is missing (run `python -m sd3_testbed.pretrain`).
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"toy weights {path} not found; make them with `python -m sd3_testbed.pretrain`.")
    state = sd3_to_diffusers(load_file(str(path)), toy_arch())
    model = build_toy_model()
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False)


def load_toy_record(path: Path | str = RECORD_FILE) -> dict:
    """The JSON record written beside the shipped weights: recipe, timings and the teacher's ToyEval."""
    return json.loads(Path(path).read_text())


@dataclass(frozen=True, slots=True)
class ToyCond(Conditioning):
    """`Conditioning` of toy captions, embedded by the toy's fixed caption embedding.

    Shapes: `context`, `context_uncond` (B, T, JOINT_ATTENTION_DIM); `pooled`, `pooled_uncond`
    (B, POOLED_DIM).
    """

    @classmethod
    def from_captions(cls, texts: list[str] | tuple[str, ...]) -> ToyCond:
        context, pooled = embed_captions([str(t) for t in texts])
        context_uncond, pooled_uncond = embed_captions([""] * len(texts))
        return cls(context, pooled, context_uncond, pooled_uncond)

"""An SD3 pipeline from ComfyUI's single files: the checkpoint's VAE, and CLIP-L / CLIP-G / T5-XXL encoders
bundled in it or in their own files, built with diffusers and transformers classes from local configs.

Text encoder files use transformers' key names (`text_model.*`, `encoder.*`, `shared.weight`); bundled
ones carry the `text_encoders.<name>.transformer.` prefix. fp8 files (`t5xxl_fp8_e4m3fn`) are upcast, scaled-fp8
ones (`t5xxl_fp8_e4m3fn_scaled`, or bundled in `sd3.5_large_fp8_scaled`) dequantized with their scales.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer.config import TEXT_ENCODERS
from trainer.inputs.fp8 import read_weights
from trainer.inputs.sources import PipelineFiles, bundled_prefix

__all__ = ["load_single_file_pipeline", "load_text_encoder", "load_vae"]

_SUBFOLDERS = {"clip_l": "text_encoder", "clip_g": "text_encoder_2", "t5xxl": "text_encoder_3"}
# Buffers and extras some exporters save that the transformers models do not hold as weights.
_IGNORED = ("text_model.embeddings.position_ids", "logit_scale")


def load_text_encoder(path: Path, role: str, *, configs: Path, dtype: torch.dtype) -> nn.Module:
    """One SD3 text encoder from a single file, with transformers' model class.

    CLIP-L's pooled output is not projected in SD3 (the reference and ComfyUI skip its projection), so its
    projection is the identity, as diffusers' single-file loader sets it.

    Args:
        path (`Path`):
            A ComfyUI text encoder file, or a checkpoint with the encoder bundled.
        role (`str`):
            `clip_l`, `clip_g` or `t5xxl`.
        configs (`Path`):
            Folder with `text_encoder/`, `text_encoder_2/` and `text_encoder_3/` transformers configs.
        dtype (`torch.dtype`):
            Weight dtype.

    Returns:
        `CLIPTextModelWithProjection` or `T5EncoderModel`, in eval mode.

    Raises:
        ValueError: the file lacks weights the model needs (names a few), or is scaled fp8 with an fp8 weight
            that lacks its scale.
    """
    from transformers import AutoConfig, CLIPTextModelWithProjection, T5EncoderModel

    config = AutoConfig.from_pretrained(configs / _SUBFOLDERS[role], local_files_only=True)
    state = read_weights(path, dtype, prefix=bundled_prefix(role), ignore=_IGNORED, what=role)
    if role == "clip_l":
        state["text_projection.weight"] = torch.eye(config.projection_dim, config.hidden_size, dtype=dtype)
    cls = T5EncoderModel if role == "t5xxl" else CLIPTextModelWithProjection
    model, info = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype, output_loading_info=True)
    missing = sorted(info["missing_keys"])
    if missing:
        raise ValueError(
            f"{path.name}: the {role} text encoder lacks {len(missing)} weights ({', '.join(missing[:3])}, ...) of "
            f"the model in {configs / _SUBFOLDERS[role]}. Give a {role} file in transformers' key layout (as "
            "ComfyUI's text_encoders files are), or the matching --model.config."
        )
    return model.eval()


def _tokenizers(files: PipelineFiles):
    from transformers import CLIPTokenizer, T5TokenizerFast

    clip_l, clip_g, t5 = files.tokenizers
    # SD3 reads 77 CLIP tokens (ComfyUI's tokenizer config says 8192); CLIP-G pads with "!" as in SD3.
    return (
        CLIPTokenizer.from_pretrained(clip_l, model_max_length=77, local_files_only=True),
        CLIPTokenizer.from_pretrained(clip_g, model_max_length=77, pad_token="!", local_files_only=True),
        T5TokenizerFast.from_pretrained(t5, local_files_only=True),
    )


def load_vae(files: PipelineFiles, *, dtype: torch.dtype) -> nn.Module:
    """The base's VAE in `dtype`, on the host, in eval mode: a pipeline folder's `vae/`, or a single-file
    checkpoint's (under `first_stage_model.*`, with the shipped config)."""
    from diffusers import AutoencoderKL

    if files.folder is not None:
        vae = AutoencoderKL.from_pretrained(
            str(files.folder), subfolder="vae", local_files_only=True, torch_dtype=dtype
        )
    else:
        vae = AutoencoderKL.from_single_file(
            str(files.checkpoint), config=str(files.configs), subfolder="vae", local_files_only=True, torch_dtype=dtype
        )
    return vae.eval()


def load_single_file_pipeline(files: PipelineFiles, transformer: nn.Module | None, *, dtype: torch.dtype):
    """A `StableDiffusion3Pipeline` around `transformer` from a single-file checkpoint and its text encoders.

    Args:
        files (`PipelineFiles`):
            The checkpoint (its VAE under `first_stage_model.*`), text encoder files, configs and tokenizers.
        transformer (`nn.Module`, *optional*):
            The SD3 transformer, already loaded; None for a pipeline that only encodes.
        dtype (`torch.dtype`):
            Dtype of the VAE and the text encoders.

    Returns:
        The pipeline, on CPU.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    vae = load_vae(files, dtype=dtype)
    encoders = [
        load_text_encoder(files.encoders[role], role, configs=files.configs, dtype=dtype) for role in TEXT_ENCODERS
    ]
    tokenizers = _tokenizers(files)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(files.configs, subfolder="scheduler"),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tokenizers[0],
        text_encoder_2=encoders[1],
        tokenizer_2=tokenizers[1],
        text_encoder_3=encoders[2],
        tokenizer_3=tokenizers[2],
    )

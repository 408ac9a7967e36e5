"""Where the base model's files come from: a local path, a ComfyUI install or a Hugging Face Hub repo.

`local_base` turns `--model.base` into a local diffusers folder or single-file checkpoint (a Hub repo id
is downloaded with `huggingface_hub`, fetching only the files the run needs). `find_text_parts` finds
what encodes captions and prompts: a diffusers pipeline folder, or for a single-file checkpoint the
CLIP-L / CLIP-G / T5-XXL weights (bundled in the checkpoint or in separate files), the configs to build
them and the tokenizers. The models themselves load in `trainer.inputs.single_file` with diffusers and
transformers classes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.config import COMFYUI_CHECKPOINTS, COMFYUI_TEXT_ENCODERS, TEXT_ENCODERS, ModelConfig

__all__ = [
    "COMFY_ENCODER_NAMES",
    "COMFY_TOKENIZERS",
    "PARTS_CONFIG_DIR",
    "PipelineFiles",
    "bundled_prefix",
    "find_text_parts",
    "local_base",
]

logger = logging.getLogger(__name__)

COMFY_ENCODER_NAMES: dict[str, tuple[str, ...]] = {
    "clip_l": ("clip_l.safetensors",),
    "clip_g": ("clip_g.safetensors",),
    "t5xxl": ("t5xxl_fp16.safetensors", "t5xxl_fp8_e4m3fn.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors"),
}
"""The file names ComfyUI's SD3 workflows load from `models/text_encoders/` (and the scaled-fp8 T5 other
workflows load), in order of preference."""
PARTS_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "sd3_parts"
"""Shipped diffusers / transformers configs of SD3's VAE, text encoders and scheduler (shared by SD3 Medium,
SD3.5 Medium and SD3.5 Large)."""
COMFY_TOKENIZERS = ("comfy/sd1_tokenizer", "comfy/sd1_tokenizer", "comfy/text_encoders/t5_tokenizer")
"""Where a ComfyUI install keeps the CLIP-L, CLIP-G (the same vocabulary) and T5 tokenizers."""
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRANSFORMER_FILES = ("model_index.json", "transformer/*.json", "transformer/*.safetensors")
_PIPELINE_FILES = (
    "model_index.json",
    "scheduler/*.json",
    "vae/*.json",
    "vae/*.safetensors",
    "text_encoder*/*.json",
    "text_encoder*/*.safetensors",
    "tokenizer*/*",
)


def bundled_prefix(role: str) -> str:
    """Key prefix of a text encoder bundled in an SD3 single-file checkpoint."""
    return f"text_encoders.{role}.transformer."


@dataclass(frozen=True, slots=True)
class PipelineFiles:
    """What encodes captions and prompts: a diffusers pipeline folder, or the parts of a single-file base.

    Parameters:
        folder (`Path`, *optional*): a diffusers pipeline folder (then nothing else is set).
        checkpoint (`Path`, *optional*): the single-file checkpoint holding the VAE.
        encoders (`dict[str, Path]`): text encoder (`clip_l`, `clip_g`, `t5xxl`) -> the file holding it
            (the checkpoint itself when bundled).
        configs (`Path`, *optional*): folder with `vae/`, `text_encoder*/` and `scheduler/` configs.
        tokenizers (`tuple[Path, Path, Path]`, *optional*): the CLIP-L, CLIP-G and T5 tokenizer folders.
    """

    folder: Path | None = None
    checkpoint: Path | None = None
    encoders: dict[str, Path] | None = None
    configs: Path | None = None
    tokenizers: tuple[Path, Path, Path] | None = None


def _download(repo_id: str, revision: str, patterns: tuple[str, ...]) -> Path:
    """A Hub repo's files matching `patterns`, from the local cache or downloaded into it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision or 'main'}"
    try:
        folder = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(patterns)))
    except GatedRepoError as error:
        raise PermissionError(
            f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id}, then set HF_TOKEN "
            f"(or run `hf auth login`) and run again ({type(error).__name__})."
        ) from error
    except RevisionNotFoundError as error:
        raise FileNotFoundError(f"{at}: no such revision; check --model.revision.") from error
    except RepositoryNotFoundError as error:
        raise FileNotFoundError(
            f"{repo_id}: no such Hub repo or folder (or it is private and HF_TOKEN is not set). Check --model.base."
        ) from error
    except LocalEntryNotFoundError as error:
        raise FileNotFoundError(
            f"{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub cannot be reached "
            "(offline mode or no network). Run once online (unset HF_HUB_OFFLINE) to download it, or point HF_HOME "
            "at a cache that holds it."
        ) from error
    logger.info("Model: %s from the Hugging Face cache at %s", at, folder)
    return folder


def local_base(config: ModelConfig, *, pipeline: bool = False) -> Path:
    """The local diffusers folder or single-file checkpoint that `--model.base` names.

    Args:
        config (`ModelConfig`):
            The model section; `base` is a path, or a Hub repo id (`owner/name`) that is not a local path.
        pipeline (`bool`):
            For a Hub repo, also fetch the VAE, text encoders, tokenizers and scheduler. Default: `False`.

    Returns:
        The existing local path.

    Raises:
        FileNotFoundError: no such path, Hub repo or revision, or a Hub repo absent from the offline cache.
        PermissionError: a gated Hub repo without a token that may read it.
    """
    path = Path(config.base).expanduser()
    if path.exists():
        return path
    if config.comfyui and path.parent == Path(config.comfyui).expanduser() / COMFYUI_CHECKPOINTS:
        found = sorted(p.name for p in path.parent.glob("*.safetensors")) if path.parent.is_dir() else []
        raise FileNotFoundError(
            f"no checkpoint {path.name} in {path.parent} (it holds: {', '.join(found) or 'nothing'}). Put the SD3 / "
            "SD3.5 checkpoint there, or name one with --model.base."
        )
    if _REPO_ID.match(config.base):
        patterns = _TRANSFORMER_FILES + (_PIPELINE_FILES if pipeline else ())
        return _download(config.base, config.revision, patterns)
    raise FileNotFoundError(
        f"base model {path} does not exist. Give --model.base a diffusers folder, a single-file SD3 / SD3.5 "
        ".safetensors checkpoint, a Hub repo id (owner/name) or `toy`."
    )


def _has_bundled(checkpoint: Path, role: str) -> bool:
    from safetensors import safe_open

    with safe_open(str(checkpoint), framework="pt") as handle:
        return any(key.startswith(bundled_prefix(role)) for key in handle.keys())


def _encoder_file(config: ModelConfig, checkpoint: Path, role: str) -> Path:
    """The file holding one text encoder: its flag, else the checkpoint when bundled, else ComfyUI's file."""
    given = getattr(config, role)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--model.{role}: {path} does not exist; give the {role} .safetensors file.")
        return path
    if _has_bundled(checkpoint, role):
        return checkpoint
    names = COMFY_ENCODER_NAMES[role]
    if config.comfyui:
        folder = Path(config.comfyui).expanduser() / COMFYUI_TEXT_ENCODERS
        for name in names:
            if (folder / name).is_file():
                return folder / name
        raise FileNotFoundError(
            f"{checkpoint.name} has no bundled {role} and {folder} has none of {', '.join(names)}. Put the file "
            f"there, or give it with --model.{role}."
        )
    raise FileNotFoundError(
        f"{checkpoint.name} has no bundled {role} text encoder. Give its file with --model.{role}, or your "
        f"ComfyUI folder with --model.comfyui (it looks for {' / '.join(names)} in {COMFYUI_TEXT_ENCODERS})."
    )


def _tokenizers(config: ModelConfig, configs: Path) -> tuple[Path, Path, Path]:
    """The tokenizer folders: the config folder's `tokenizer*/` when it has them, else ComfyUI's."""
    own = tuple(configs / name for name in ("tokenizer", "tokenizer_2", "tokenizer_3"))
    if all(folder.is_dir() for folder in own):
        return own
    if not config.comfyui:
        raise FileNotFoundError(
            "encoding captions for a single-file checkpoint needs the CLIP and T5 tokenizers: give your ComfyUI "
            "folder with --model.comfyui (it ships them in comfy/sd1_tokenizer and comfy/text_encoders/t5_tokenizer)."
        )
    root = Path(config.comfyui).expanduser()
    comfy = tuple(root / name for name in COMFY_TOKENIZERS)
    missing = [str(folder) for folder in comfy if not folder.is_dir()]
    if missing:
        raise FileNotFoundError(
            f"--model.comfyui {root}: no tokenizer folder {', '.join(missing)}. Give the ComfyUI folder that holds "
            "`comfy/` (the one with main.py)."
        )
    return comfy


def find_text_parts(config: ModelConfig, pipeline: str = "") -> PipelineFiles:
    """The files that encode captions and prompts for `--data.source images | prompts`.

    Args:
        config (`ModelConfig`):
            The model section.
        pipeline (`str`):
            `--data.pipeline`: a diffusers pipeline folder to use instead of the base's parts. Default: `""`.

    Returns:
        A pipeline folder, or for a single-file base its checkpoint, text encoder files, configs and tokenizers.

    Raises:
        FileNotFoundError: a folder without `model_index.json`, or a missing text encoder or tokenizer
            (the message names what was looked for, and where).
    """
    base = Path(pipeline).expanduser() if pipeline else local_base(config, pipeline=True)
    if base.is_file() and not pipeline:
        configs = Path(config.config).expanduser() if config.config else PARTS_CONFIG_DIR
        if not (configs / "vae" / "config.json").is_file():
            configs = PARTS_CONFIG_DIR
        encoders = {role: _encoder_file(config, base, role) for role in TEXT_ENCODERS}
        files = PipelineFiles(
            checkpoint=base, encoders=encoders, configs=configs, tokenizers=_tokenizers(config, configs)
        )
        logger.info(
            "Model: text encoders %s; VAE from %s",
            ", ".join(f"{role} from {path.name}" for role, path in encoders.items()),
            base.name,
        )
        return files
    if (base / "model_index.json").is_file():
        return PipelineFiles(folder=base)
    raise FileNotFoundError(
        f"{base} is not a diffusers pipeline folder (no model_index.json); encoding images or prompts needs the "
        "model's VAE and text encoders. Pass --data.pipeline with an SD3 pipeline folder, or use a single-file "
        "checkpoint with --model.comfyui."
    )

"""Data preparation, done once and cached: image folders and prompt files become cache shards.

`prepare_data` encodes `--data.source images`, a folder of images with `.txt` captions, through the
base pipeline's own VAE and text encoders, or has the frozen softmax model generate the latents of
each prompt of `--data.source prompts` (a prompts file or the shipped default set; no images needed).
Both run one driver and differ only in how they list their inputs and encode a shard (`_Inputs`):
sort the inputs into aspect-ratio buckets (`trainer.data.bucket_sizes`), cut each bucket into shards
of `--data.shard_size`, and have rank r encode shards r, r + N, ...; rank 0 shows a progress bar with
an ETA. A shard already on disk is kept, so an interrupted preparation resumes where it stopped;
`plan.json` records what the shards hold, and a cache folder planned for other inputs or settings is
refused rather than mixed. Unreadable images and missing captions are skipped and counted, never a
crash mid-run; an empty input is an error. The cache's files and format are `trainer.cache`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from trainer.cache import MANIFEST, check_finished, check_plan, finish_cache, shard_name, write_shard
from trainer.config import DataConfig
from trainer.data import Batch, bucket_sizes, nearest_bucket
from trainer.distributed import World
from trainer.prompt_set import default_prompts
from trainer.seeds import derived_seed
from trainer.sources import PipelineFiles

__all__ = ["DEFAULT_RESOLUTION", "IMAGE_SUFFIXES", "prepare_data"]

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_RESOLUTION = 1024
"""The square bucket's pixel side when `--data.resolution` is 0 (SD3.5's native size)."""
_SHOWN_SKIPS = 5


@dataclass(frozen=True, slots=True)
class _Item:
    key: str
    caption: str
    size: tuple[int, int]


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What one kind of input brings to the preparation driver.

    Attributes:
        kind: `images` or `prompts` (the manifest's kind, the progress bar's unit).
        items: the bucket sizes -> the inputs sorted into them, and those skipped (`{key: why}`).
        encode: `(pipeline, shard, size)` -> the shard's samples, and its inputs that failed (`{key: why}`).
    """

    kind: str
    items: Callable[[list[tuple[int, int]]], tuple[list[_Item], dict[str, str]]]
    encode: Callable[[Any, list[_Item], tuple[int, int]], tuple[Batch, dict[str, str]]]


def _pipeline_dtype(world: World) -> torch.dtype:
    """The pipeline's weights: bf16 on a GPU, fp32 on CPU."""
    return torch.bfloat16 if world.device.type == "cuda" else torch.float32


def _load_pipeline(files: Path | PipelineFiles, transformer: nn.Module, world: World):
    """The SD3 pipeline around our transformer: a diffusers folder (components it leaves out stay None) or
    the parts of a single-file checkpoint."""
    from diffusers import StableDiffusion3Pipeline

    from trainer.single_file import load_single_file_pipeline

    files = files if isinstance(files, PipelineFiles) else PipelineFiles(folder=files)
    dtype = _pipeline_dtype(world)
    if files.folder is None:
        pipe = load_single_file_pipeline(files, transformer, dtype=dtype)
    else:
        index = json.loads((files.folder / "model_index.json").read_text(encoding="utf-8"))
        absent = {name: None for name, value in index.items() if isinstance(value, list) and value[0] is None}
        pipe = StableDiffusion3Pipeline.from_pretrained(
            str(files.folder), transformer=transformer, local_files_only=True, dtype=dtype, **absent
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(world.device)


def _encode_text(pipe, captions: list[str], data: DataConfig, *, guidance: bool = False) -> tuple[Tensor, ...]:
    """`(context, negative context, pooled, negative pooled)` of `captions`; the negatives (the empty
    caption's) are None without `guidance`."""
    return pipe.encode_prompt(
        prompt=captions,
        prompt_2=None,
        prompt_3=None,
        do_classifier_free_guidance=guidance,
        max_sequence_length=data.max_sequence_length,
    )


def _on_cpu(latents: Tensor, context: Tensor, pooled: Tensor) -> Batch:
    return Batch(latents.float().cpu(), context.float().cpu(), pooled.float().cpu())


def _shards(items: list[_Item], shard_size: int) -> list[tuple[tuple[int, int], list[_Item]]]:
    """Items grouped by bucket (in bucket order), cut into shards."""
    by_bucket: dict[tuple[int, int], list[_Item]] = {}
    for item in items:
        by_bucket.setdefault(item.size, []).append(item)
    return [
        (size, group[i : i + shard_size])
        for size, group in sorted(by_bucket.items())
        for i in range(0, len(group), shard_size)
    ]


def _settings(data: DataConfig) -> dict[str, object]:
    """The settings a cache is made with (recorded in `plan.json`, checked before a finished cache is used)."""
    settings: dict[str, object] = {
        "kind": data.source,
        "path": str(Path(data.path).expanduser().resolve()) if data.path else "",
        "resolution": data.resolution or DEFAULT_RESOLUTION,
        "buckets": data.buckets,
        "shard_size": data.shard_size,
        "max_sequence_length": data.max_sequence_length,
    }
    if data.source == "prompts":
        settings.update(
            prompt_limit=data.prompt_limit, generate_steps=data.generate_steps, guidance_scale=data.guidance_scale
        )
    return settings


def _plan(items: list[_Item], data: DataConfig) -> dict[str, object]:
    """What the shards will hold: the settings, and a digest of the inputs in shard order."""
    listing = json.dumps([[item.key, item.caption, list(item.size)] for item in items])
    return {**_settings(data), "items": len(items), "sha256": hashlib.sha256(listing.encode()).hexdigest()}


def _pending(
    cache_dir: Path, shards: list[tuple[tuple[int, int], list[_Item]]], world: World, *, unit: str, progress: bool
) -> Iterator[tuple[int, tuple[int, int], list[_Item]]]:
    """This rank's shards not yet on disk, as `(index, size, items)`, behind a rank-0 progress bar with an ETA."""
    mine = [
        (index, size, shard) for index, (size, shard) in enumerate(shards) if index % world.world_size == world.rank
    ]
    total = sum(len(shard) for *_, shard in mine)
    done = sum(len(shard) for index, _, shard in mine if (cache_dir / shard_name(index)).is_file())
    if done and world.is_main:
        logger.info("Data: resuming; %d of this rank's %d %s are cached", done, total, unit)
    shown = progress and world.is_main
    with tqdm(total=total, initial=done, unit=unit[:-1], desc="Data", disable=not shown, dynamic_ncols=True) as bar:
        for index, size, shard in mine:
            if not (cache_dir / shard_name(index)).is_file():
                yield index, size, shard
                bar.update(len(shard))


def _finish(
    cache_dir: Path, pipe, data: DataConfig, world: World, *, kind: str, planned: int, skipped: dict[str, str]
) -> None:
    """After every rank wrote its shards: rank 0 closes the cache (`trainer.cache.finish_cache`; collective).

    Raises:
        ValueError: on every rank, when no input could be used.
    """
    world.barrier()
    kept, shown = 0, ""
    if world.is_main:
        context, _, pooled, _ = _encode_text(pipe, [""], data)
        uncond = _on_cpu(torch.zeros(1, 1), context, pooled)
        kept, shards, all_skipped = finish_cache(cache_dir, kind=kind, uncond=uncond, skipped=skipped)
        shown = "; ".join(f"{key}: {why}" for key, why in list(all_skipped.items())[:_SHOWN_SKIPS])
        if kept:
            logger.info("Data: cached %d of %d %s in %d shards at %s", kept, planned, kind, shards, cache_dir)
        if all_skipped:
            more = ", ..." if len(all_skipped) > _SHOWN_SKIPS else ""
            logger.warning("Data: skipped %d of %d %s (%s%s)", len(all_skipped), planned, kind, shown, more)
    flag = torch.tensor([kept], device=world.device)
    torch.distributed.broadcast(flag, src=0)
    if not flag.item():
        raise ValueError(
            f"none of the {planned} {kind} could be used ({shown or 'see rank 0'}). Fix the inputs and run again."
        )


def _read_image(path: Path, size: tuple[int, int]) -> Tensor:
    """RGB pixels in [-1, 1], `(3, height, width)`: resized to cover the bucket, then centre-cropped."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        width, height = size
        scale = max(width / image.width, height / image.height)
        resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))))
        left, top = (resized.width - width) // 2, (resized.height - height) // 2
        pixels = torch.frombuffer(
            bytearray(resized.crop((left, top, left + width, top + height)).tobytes()), dtype=torch.uint8
        )
    return pixels.view(height, width, 3).permute(2, 0, 1).float() / 127.5 - 1


def _list_images(folder: Path) -> list[Path]:
    """The image files under `folder`, sorted.

    Raises:
        FileNotFoundError: no such folder. ValueError: no image files in it.
    """
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist; check --data.path.")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(
            f"image folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}); add images with .txt captions "
            "beside them, or use --data.source prompts."
        )
    return files


def _scan_images(folder: Path, files: list[Path], sizes: list[tuple[int, int]]) -> tuple[list[_Item], dict[str, str]]:
    """Caption and bucket of each image; images without a caption or a readable header are skipped."""
    from PIL import Image, UnidentifiedImageError

    items, skipped = [], {}
    for path in files:
        key = str(path.relative_to(folder))
        caption_file = path.with_suffix(".txt")
        try:
            caption = caption_file.read_text(encoding="utf-8").strip() if caption_file.is_file() else ""
        except (OSError, UnicodeDecodeError) as error:
            skipped[key] = f"unreadable caption {caption_file.name} ({error})"
            continue
        if not caption:
            skipped[key] = f"no caption ({caption_file.name} missing or empty)"
            continue
        try:
            with Image.open(path) as image:
                width, height = image.size
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
            skipped[key] = f"unreadable image ({error})"
            continue
        items.append(_Item(key, caption, nearest_bucket(width, height, sizes)))
    return items, skipped


def _encode_images(
    pipe, folder: Path, shard: list[_Item], size: tuple[int, int], *, data: DataConfig, world: World
) -> tuple[Batch, dict[str, str]]:
    """VAE latents and text conditioning of a shard of images; an image unreadable now is left out."""
    vae = pipe.vae
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    pixels, captions, failed = [], [], {}
    for item in shard:
        try:
            pixels.append(_read_image(folder / item.key, size))
            captions.append(item.caption)
        except (OSError, SyntaxError, ValueError) as error:
            failed[item.key] = f"unreadable image ({error})"
    latents = torch.zeros(
        0, vae.config.latent_channels, size[1] // pipe.vae_scale_factor, size[0] // pipe.vae_scale_factor
    )
    context = pooled = torch.zeros(0)
    if pixels:
        encoded = vae.encode(torch.stack(pixels).to(world.device, vae.dtype)).latent_dist.mean
        latents = (encoded - shift) * scale
        context, _, pooled, _ = _encode_text(pipe, captions, data)
    return _on_cpu(latents, context, pooled), failed


def _image_inputs(data: DataConfig, world: World) -> _Inputs:
    folder = Path(data.path)
    files = _list_images(folder)
    return _Inputs(
        kind="images",
        items=lambda sizes: _scan_images(folder, files, sizes),
        encode=lambda pipe, shard, size: _encode_images(pipe, folder, shard, size, data=data, world=world),
    )


def _read_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist; check --data.path.")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in prompts if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts; write one prompt a line (# starts a comment).")
    return prompts


def _generate(
    pipe, shard: list[_Item], size: tuple[int, int], *, data: DataConfig, world: World
) -> tuple[Batch, dict[str, str]]:
    """Latents the softmax model generates for a shard of prompts, each from noise seeded by its index."""
    embeds = _encode_text(pipe, [item.caption for item in shard], data, guidance=data.guidance_scale > 1)
    generators = [torch.Generator(world.device).manual_seed(derived_seed(0, "prompt", item.key)) for item in shard]
    # The transformer is the fp32 base the run trains; autocast runs it in the bf16 pipeline's dtype.
    dtype = _pipeline_dtype(world)
    with torch.autocast(world.device.type, dtype=dtype, enabled=dtype != torch.float32):
        latents = pipe(
            prompt_embeds=embeds[0],
            negative_prompt_embeds=embeds[1],
            pooled_prompt_embeds=embeds[2],
            negative_pooled_prompt_embeds=embeds[3],
            width=size[0],
            height=size[1],
            num_inference_steps=data.generate_steps,
            guidance_scale=data.guidance_scale,
            generator=generators,
            output_type="latent",
        ).images
    logger.debug("Data: generated %d prompts at %dx%d", len(shard), *size)
    return _on_cpu(latents, embeds[0], embeds[2]), {}


def _prompt_inputs(data: DataConfig, world: World) -> _Inputs:
    """Prompt i goes to bucket i mod (number of buckets) and starts from noise seeded by its index, so
    the cache does not depend on the world size or on interruptions."""
    prompts = _read_prompts(Path(data.path)) if data.path else default_prompts()
    prompts = prompts[: data.prompt_limit or None]
    return _Inputs(
        kind="prompts",
        items=lambda sizes: ([_Item(str(i), prompt, sizes[i % len(sizes)]) for i, prompt in enumerate(prompts)], {}),
        encode=lambda pipe, shard, size: _generate(pipe, shard, size, data=data, world=world),
    )


_INPUTS = {"images": _image_inputs, "prompts": _prompt_inputs}


@torch.no_grad()
def prepare_data(
    data: DataConfig,
    cache_dir: Path,
    *,
    pipeline: Path | PipelineFiles,
    transformer: nn.Module,
    world: World,
    progress: bool = True,
) -> Path:
    """Encode `--data.source images` or `prompts` into a cache at `cache_dir` (collective); a finished
    cache there made with the same settings is used as it is.

    `images`: the image folder `data.path` (captions in `name.txt` beside `name.png`). `prompts`: the
    frozen softmax model generates latents for each prompt of the file `data.path`, or of the shipped
    default set (`trainer.prompt_set`) when it is empty; `data.prompt_limit` keeps the first prompts.

    Args:
        data (`DataConfig`): the data section; `resolution` 0 means `DEFAULT_RESOLUTION`.
        pipeline (`Path` or `PipelineFiles`): what encodes the data (`trainer.sources.find_text_parts`).
        transformer (`nn.Module`): the base transformer the pipeline runs (`prompts` samples with it).
        progress (`bool`): show rank 0's progress bar. Default: `True`.

    Returns:
        `cache_dir`.

    Raises:
        FileNotFoundError: no such folder or file. ValueError: no inputs, none usable, or a cache folder
            planned for other inputs or settings (a finished one: other settings).
    """
    if (cache_dir / MANIFEST).is_file():
        check_finished(cache_dir, _settings(data))
        logger.info("Data: using the finished cache %s", cache_dir)
        return cache_dir
    inputs = _INPUTS[data.source](data, world)
    pipe = _load_pipeline(pipeline, transformer, world)
    multiple = pipe.vae_scale_factor * pipe.transformer.config.patch_size
    sizes = bucket_sizes(data.buckets, data.resolution or DEFAULT_RESOLUTION, multiple)
    items, skipped = inputs.items(sizes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    check_plan(cache_dir, _plan(items, data), world)
    shards = _shards(items, data.shard_size)
    for index, size, shard in _pending(cache_dir, shards, world, unit=inputs.kind, progress=progress):
        batch, failed = inputs.encode(pipe, shard, size)
        write_shard(cache_dir, index, batch, pixel_wh=size, skipped=failed)
    _finish(cache_dir, pipe, data, world, kind=inputs.kind, planned=len(items) + len(skipped), skipped=skipped)
    return cache_dir

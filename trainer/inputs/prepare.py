"""Data preparation, done once and cached: image folders and prompt files become cache shards.

`prepare_data` encodes `--data.source images`, a folder of images with `.txt` captions, through the
base pipeline's own VAE and text encoders, or has the frozen softmax model generate the latents of
each prompt of `--data.source prompts` (a prompts file or the shipped default set; no images needed).
Both run one driver and differ only in how they list their inputs and write their shards (`_Inputs`):
sort the inputs into aspect-ratio buckets (`trainer.data.bucket_sizes`), cut each bucket into shards
of `--data.shard_size`, and have rank r encode shards r, r + N, ...; rank 0 shows a progress bar with
an ETA. Each phase holds only what it needs on the device: images use the text encoders and the VAE
(in micro-batches of `vae_batch` images, sized by the run's memory plan); prompts are first embedded by
the text encoders, which then leave, and a frozen copy of the transformer in the pipeline's dtype
generates (the base the run trains stays on the host, in fp32, untouched). A shard already on disk is
kept, so an interrupted preparation resumes where it stopped; `plan.json` records what the shards hold,
and a cache folder planned for other inputs or settings is refused rather than mixed. Unreadable images
and missing captions are skipped and counted, never a crash mid-run; an empty input is an error. The
cache's files and format are `trainer.inputs.cache`'s.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from t5core.atomic import write_atomic
from trainer.config import DataConfig, TrainConfig
from trainer.data import Batch, bucket_sizes, nearest_bucket
from trainer.distributed import World
from trainer.inputs.cache import MANIFEST, check_finished, check_plan, finish_cache, shard_name, write_shard
from trainer.inputs.prompt_set import default_prompts
from trainer.inputs.sources import PipelineFiles
from trainer.seeds import derived_seed

__all__ = [
    "DEFAULT_RESOLUTION",
    "EMBEDDINGS_DIR",
    "IMAGE_SUFFIXES",
    "cache_dir_of",
    "check_inputs",
    "frozen_copy",
    "needs_preparation",
    "encode_text",
    "load_encoding_pipeline",
    "prepare_data",
    "read_prompts",
    "release_device_memory",
]

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


_Pending = tuple[int, tuple[int, int], list[_Item]]
"""A shard this rank still has to write: `(index, bucket size, items)`."""


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What one kind of input brings to the preparation driver.

    Attributes:
        kind: `images` or `prompts` (the manifest's kind, the progress bar's unit).
        items: the bucket sizes -> the inputs sorted into them, and those skipped (`{key: why}`).
        write: `(pipe, pending, cache_dir, uncond, bar)` -> writes every pending shard and advances the progress
            bar; `pipe` holds the text encoders and the VAE on the device, `uncond` the empty caption's features.
    """

    kind: str
    items: Callable[[list[tuple[int, int]]], tuple[list[_Item], dict[str, str]]]
    write: Callable[[Any, list[_Pending], Path, Batch, tqdm], None]


def _pipeline_dtype(world: World) -> torch.dtype:
    """The pipeline's weights: bf16 on a GPU, fp32 on CPU."""
    return torch.bfloat16 if world.device.type == "cuda" else torch.float32


def load_encoding_pipeline(files: Path | PipelineFiles, transformer: nn.Module, world: World):
    """The SD3 pipeline for encoding: its text encoders and VAE on the device in the pipeline's dtype, and the
    base `transformer` left on the host, where only its config is read (generation brings its own copy): a
    diffusers folder (components it leaves out stay None) or the parts of a single-file checkpoint."""
    from diffusers import StableDiffusion3Pipeline

    from trainer.inputs.single_file import load_single_file_pipeline

    files = files if isinstance(files, PipelineFiles) else PipelineFiles(folder=files)
    dtype = _pipeline_dtype(world)
    if files.folder is None:
        pipe = load_single_file_pipeline(files, None, dtype=dtype)
    else:
        index = json.loads((files.folder / "model_index.json").read_text(encoding="utf-8"))
        absent = {name: None for name, value in index.items() if isinstance(value, list) and value[0] is None}
        pipe = StableDiffusion3Pipeline.from_pretrained(
            str(files.folder), local_files_only=True, dtype=dtype, **{**absent, "transformer": None}
        )
    pipe.set_progress_bar_config(disable=True)
    pipe.to(world.device)
    pipe.transformer = transformer
    return pipe


def frozen_copy(model: nn.Module, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of a diffusers model for inference: built empty, then given each tensor cast to `dtype` on
    `device` one at a time, so neither a second full-precision copy nor autocast's cached casts exist.
    `model` stays where and as it is."""
    with torch.device("meta"):
        copy = type(model).from_config(model.config)
    sources = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, target in [*copy.named_parameters(), *copy.named_buffers()]:
        owner_name, _, leaf = name.rpartition(".")
        owner = copy.get_submodule(owner_name)
        value = sources[name].detach().to(device, dtype if target.is_floating_point() else None)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[leaf] = value
    return copy.eval()


def release_device_memory(world: World) -> None:
    """Return what freed modules held on the GPU to the driver (a no-op on CPU)."""
    gc.collect()
    if world.device.type == "cuda":
        torch.cuda.empty_cache()


def encode_text(pipe, captions: list[str], data: DataConfig) -> tuple[Tensor, Tensor]:
    """`(context, pooled)` of `captions`, computed on the text encoders' device."""
    context, _, pooled, _ = pipe.encode_prompt(
        prompt=captions,
        prompt_2=None,
        prompt_3=None,
        device=pipe.text_encoder.device,
        do_classifier_free_guidance=False,
        max_sequence_length=data.max_sequence_length,
    )
    return context, pooled


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


def _pending(cache_dir: Path, shards: list[tuple[tuple[int, int], list[_Item]]], world: World) -> list[_Pending]:
    """This rank's shards (rank r writes shards r, r + N, ...) not yet on disk."""
    return [
        (index, size, shard)
        for index, (size, shard) in enumerate(shards)
        if index % world.world_size == world.rank and not (cache_dir / shard_name(index)).is_file()
    ]


def _progress(
    shards: list[tuple[tuple[int, int], list[_Item]]], pending: list[_Pending], world: World, *, unit: str, shown: bool
) -> tqdm:
    """Rank 0's progress bar over this rank's inputs, with an ETA; it starts at those already cached."""
    total = sum(len(shard) for index, (_, shard) in enumerate(shards) if index % world.world_size == world.rank)
    done = total - sum(len(shard) for *_, shard in pending)
    if done and world.is_main:
        logger.info("Data: resuming; %d of this rank's %d %s are cached", done, total, unit)
    return tqdm(total=total, initial=done, unit=unit[:-1], desc="Data", disable=not shown, dynamic_ncols=True)


def _uncond(pipe, data: DataConfig) -> Batch:
    """The empty caption's features: the cache's unconditional input and the generation's negative."""
    context, pooled = encode_text(pipe, [""], data)
    return _on_cpu(torch.zeros(1, 1), context, pooled)


def _finish(cache_dir: Path, uncond: Batch, world: World, *, kind: str, planned: int, skipped: dict[str, str]) -> None:
    """After every rank wrote its shards: rank 0 closes the cache (`trainer.inputs.cache.finish_cache`; collective).

    Raises:
        ValueError: on every rank, when no input could be used.
    """
    world.barrier()
    kept, shown = 0, ""
    if world.is_main:
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
    pipe, folder: Path, shard: list[_Item], size: tuple[int, int], *, data: DataConfig, world: World, vae_batch: int
) -> tuple[Batch, dict[str, str]]:
    """VAE latents (`vae_batch` images per VAE call, 0 = the whole shard) and text conditioning of a shard of
    images; an image unreadable now is left out."""
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
        chunks = torch.stack(pixels).split(vae_batch or len(pixels))
        encoded = torch.cat([vae.encode(chunk.to(world.device, vae.dtype)).latent_dist.mean for chunk in chunks])
        latents = (encoded - shift) * scale
        context, pooled = encode_text(pipe, captions, data)
    return _on_cpu(latents, context, pooled), failed


def _image_inputs(data: DataConfig, world: World, vae_batch: int) -> _Inputs:
    folder = Path(data.path)
    files = _list_images(folder)

    def write(pipe, pending: list[_Pending], cache_dir: Path, uncond: Batch, bar: tqdm) -> None:
        for index, size, shard in pending:
            batch, failed = _encode_images(pipe, folder, shard, size, data=data, world=world, vae_batch=vae_batch)
            write_shard(cache_dir, index, batch, pixel_wh=size, skipped=failed)
            bar.update(len(shard))

    return _Inputs(kind="images", items=lambda sizes: _scan_images(folder, files, sizes), write=write)


def read_prompts(path: Path, *, flag: str = "--data.path") -> list[str]:
    """The prompts of a text file, one a line (blank lines and lines starting with # are skipped).

    Raises:
        FileNotFoundError: no such file. ValueError: no prompts in it (both name `flag`, the setting that gave it).
    """
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist; check {flag}.")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in prompts if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"prompts file {path} ({flag}) has no prompts; write one prompt a line (# starts a comment).")
    return prompts


_ENCODING_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")
"""The pipeline's modules that leave the device before prompt generation."""
EMBEDDINGS_DIR = "prompt-embeddings"
"""Under a prompts cache being made: each pending shard's prompt features, written by the text phase and
removed once the generation phase has written the shard."""


def _embed_prompts(pipe, pending: list[_Pending], cache_dir: Path, data: DataConfig) -> None:
    """The text phase: each pending shard's prompt features, written under `EMBEDDINGS_DIR` so the encoders can
    leave the device before the transformer comes (a file already there is kept)."""
    folder = cache_dir / EMBEDDINGS_DIR
    folder.mkdir(exist_ok=True)
    for index, _, shard in pending:
        if not (folder / shard_name(index)).is_file():
            context, pooled = encode_text(pipe, [item.caption for item in shard], data)
            features = {"context": context.contiguous(), "pooled": pooled.contiguous()}
            write_atomic(folder / shard_name(index), lambda temp, features=features: save_file(features, temp))


def _generate(
    pipe, index: int, shard: list[_Item], size: tuple[int, int], *, uncond: Batch, cache_dir: Path, data: DataConfig
) -> Batch:
    """Latents the frozen softmax model generates for a shard of prompts from the text phase's features (the
    empty caption's `uncond` as the negative), each from noise seeded by its index."""
    device, dtype = pipe.transformer.device, pipe.transformer.dtype
    features = load_file(str(cache_dir / EMBEDDINGS_DIR / shard_name(index)), device=str(device))
    context, pooled = features["context"].to(dtype), features["pooled"].to(dtype)
    guidance = data.guidance_scale > 1
    negative = [
        part.to(device, dtype).expand_as(like) for part, like in ((uncond.context, context), (uncond.pooled, pooled))
    ]
    generators = [torch.Generator(device).manual_seed(derived_seed(0, "prompt", item.key)) for item in shard]
    latents = pipe(
        prompt_embeds=context,
        negative_prompt_embeds=negative[0] if guidance else None,
        pooled_prompt_embeds=pooled,
        negative_pooled_prompt_embeds=negative[1] if guidance else None,
        width=size[0],
        height=size[1],
        num_inference_steps=data.generate_steps,
        guidance_scale=data.guidance_scale,
        generator=generators,
        output_type="latent",
    ).images
    logger.debug("Data: generated %d prompts at %dx%d", len(shard), *size)
    return _on_cpu(latents, context, pooled)


def _prompt_inputs(data: DataConfig, world: World, transformer: nn.Module) -> _Inputs:
    """Prompt i goes to bucket i mod (number of buckets) and starts from noise seeded by its index, so
    the cache does not depend on the world size or on interruptions. Two phases: the text encoders embed
    every pending prompt, leave the device, and then a frozen copy of the transformer in the pipeline's
    dtype generates."""
    prompts = read_prompts(Path(data.path)) if data.path else default_prompts()
    prompts = prompts[: data.prompt_limit or None]

    def write(pipe, pending: list[_Pending], cache_dir: Path, uncond: Batch, bar: tqdm) -> None:
        _embed_prompts(pipe, pending, cache_dir, data)
        for name in _ENCODING_PARTS:
            setattr(pipe, name, None)
        release_device_memory(world)
        pipe.transformer = frozen_copy(transformer, device=world.device, dtype=_pipeline_dtype(world))
        for index, size, shard in pending:
            batch = _generate(pipe, index, shard, size, uncond=uncond, cache_dir=cache_dir, data=data)
            write_shard(cache_dir, index, batch, pixel_wh=size, skipped={})
            (cache_dir / EMBEDDINGS_DIR / shard_name(index)).unlink()
            bar.update(len(shard))
        pipe.transformer = None

    return _Inputs(
        kind="prompts",
        items=lambda sizes: ([_Item(str(i), prompt, sizes[i % len(sizes)]) for i, prompt in enumerate(prompts)], {}),
        write=write,
    )


def cache_dir_of(config: TrainConfig) -> Path:
    """Where a run prepares its data cache: `--data.cache_dir`, else `data-cache` in the output folder."""
    return Path(config.data.cache_dir or Path(config.output.dir).expanduser() / "data-cache")


def needs_preparation(config: TrainConfig) -> bool:
    """Whether the run will prepare data: an image or prompt source whose cache is not finished."""
    return config.data.source != "cache" and not (cache_dir_of(config) / MANIFEST).is_file()


def check_inputs(data: DataConfig) -> None:
    """Check what `prepare_data` would read first, without reading it all: the image folder holds images, the
    prompts file has prompts.

    Raises:
        FileNotFoundError: no such folder or file. ValueError: no images or prompts in it.
    """
    if data.source == "images":
        _list_images(Path(data.path))
    elif data.path:
        read_prompts(Path(data.path))


@torch.no_grad()
def prepare_data(
    data: DataConfig,
    cache_dir: Path,
    *,
    pipeline: Path | PipelineFiles,
    transformer: nn.Module,
    world: World,
    progress: bool = True,
    vae_batch: int = 0,
) -> Path:
    """Encode `--data.source images` or `prompts` into a cache at `cache_dir` (collective); a finished
    cache there made with the same settings is used as it is.

    `images`: the image folder `data.path` (captions in `name.txt` beside `name.png`). `prompts`: the
    frozen softmax model generates latents for each prompt of the file `data.path`, or of the shipped
    default set (`trainer.inputs.prompt_set`) when it is empty; `data.prompt_limit` keeps the first prompts.

    Args:
        data (`DataConfig`): the data section; `resolution` 0 means `DEFAULT_RESOLUTION`.
        pipeline (`Path` or `PipelineFiles`): what encodes the data (`trainer.inputs.sources.find_text_parts`).
        transformer (`nn.Module`): the base transformer: its patch size sets the bucket sizes, and `prompts`
            samples with a frozen copy of it in the pipeline's dtype (the base itself stays on the host).
        progress (`bool`): show rank 0's progress bar. Default: `True`.
        vae_batch (`int`): images per VAE call (the memory plan sizes it); 0 = a whole shard at once.

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
    if data.source == "images":
        inputs = _image_inputs(data, world, vae_batch)
    else:
        inputs = _prompt_inputs(data, world, transformer)
    pipe = load_encoding_pipeline(pipeline, transformer, world)
    multiple = pipe.vae_scale_factor * transformer.config.patch_size
    sizes = bucket_sizes(data.buckets, data.resolution or DEFAULT_RESOLUTION, multiple)
    items, skipped = inputs.items(sizes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    check_plan(cache_dir, _plan(items, data), world)
    shards = _shards(items, data.shard_size)
    pending = _pending(cache_dir, shards, world)
    uncond = _uncond(pipe, data)
    with _progress(shards, pending, world, unit=inputs.kind, shown=progress and world.is_main) as bar:
        inputs.write(pipe, pending, cache_dir, uncond, bar)
    del pipe
    release_device_memory(world)
    _finish(cache_dir, uncond, world, kind=inputs.kind, planned=len(items) + len(skipped), skipped=skipped)
    if world.is_main and (cache_dir / EMBEDDINGS_DIR).is_dir():
        (cache_dir / EMBEDDINGS_DIR).rmdir()
    return cache_dir

"""Data preparation, done once and cached: image folders and prompt files become cache shards.

`prepare_images` encodes a folder of images with `.txt` captions through the base pipeline's own VAE
and text encoders; `prepare_prompts` lets the frozen softmax model generate the latents of each
prompt (a prompts file or the shipped default set; no images needed). Both sort inputs into
aspect-ratio buckets, cut each bucket into shards of `--data.shard_size`, and have rank r encode shards
r, r + N, ...; rank 0 shows a progress bar with an ETA. A shard already on disk is kept, so an
interrupted preparation resumes where it stopped; `plan.json` records what the shards hold, and a
cache folder planned for other inputs or settings is refused rather than mixed. Unreadable images and
missing captions are skipped and counted, never a crash mid-run; an empty input is an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from t5core.atomic import write_text_atomic
from trainer.cache import MANIFEST, UNCOND, shard_name, write_manifest, write_tensors
from trainer.config import DataConfig
from trainer.data import Batch
from trainer.distributed import World
from trainer.prompt_set import default_prompts
from trainer.seeds import derived_seed
from trainer.sources import PipelineFiles

__all__ = ["IMAGE_SUFFIXES", "bucket_sizes", "nearest_bucket", "prepare_images", "prepare_prompts"]

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
PLAN = "plan.json"
_SHOWN_SKIPS = 5


def bucket_sizes(spec: str, resolution: int, multiple: int) -> list[tuple[int, int]]:
    """Pixel `(width, height)` of each `w:h` bucket: about `resolution**2` pixels, sides a multiple of `multiple`.

    Raises:
        ValueError: a malformed bucket (names it and the expected form).
    """
    sizes = []
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        w_text, sep, h_text = item.partition(":")
        try:
            ratio = float(w_text) / float(h_text)
        except ValueError:
            ratio = 0.0
        if not sep or not ratio > 0:
            raise ValueError(f"--data.buckets: {item!r} is not a ratio like 4:3.")
        width = max(multiple, round(resolution * math.sqrt(ratio) / multiple) * multiple)
        height = max(multiple, round(resolution / math.sqrt(ratio) / multiple) * multiple)
        if (width, height) not in sizes:
            sizes.append((width, height))
    if not sizes:
        raise ValueError("--data.buckets is empty; give ratios like 1:1,4:3,3:4.")
    return sizes


def nearest_bucket(width: int, height: int, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to `width / height` (in log space)."""
    aspect = math.log(width / height)
    return min(sizes, key=lambda size: abs(math.log(size[0] / size[1]) - aspect))


@dataclass(frozen=True, slots=True)
class _Item:
    key: str
    caption: str
    size: tuple[int, int]


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


def _pixel_multiple(pipe) -> int:
    return pipe.vae_scale_factor * pipe.transformer.config.patch_size


def _encode_text(pipe, captions: list[str], data: DataConfig) -> tuple[Tensor, Tensor]:
    context, _, pooled, _ = pipe.encode_prompt(
        prompt=captions,
        prompt_2=None,
        prompt_3=None,
        do_classifier_free_guidance=False,
        max_sequence_length=data.max_sequence_length,
    )
    return context.float().cpu(), pooled.float().cpu()


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


def _check_plan(cache_dir: Path, items: list[_Item], settings: dict[str, object], world: World) -> None:
    """Record what the shards of `cache_dir` hold (rank 0, first run) and refuse a folder planned otherwise.

    Raises:
        ValueError: on every rank, when the folder's shards were planned for other inputs or settings.
    """
    listing = json.dumps([[item.key, item.caption, list(item.size)] for item in items])
    plan = {**settings, "items": len(items), "sha256": hashlib.sha256(listing.encode()).hexdigest()}
    path = cache_dir / PLAN
    if world.is_main and not path.is_file():
        write_text_atomic(path, json.dumps(plan, indent=1))
    world.barrier()
    saved = json.loads(path.read_text(encoding="utf-8"))
    if saved != plan:
        differ = ", ".join(
            f"{key} {saved.get(key)!r} -> {value!r}" for key, value in plan.items() if saved.get(key) != value
        )
        raise ValueError(
            f"{cache_dir} holds an unfinished cache of other inputs or settings ({differ}); rerun with those, or "
            "delete the folder or choose another --data.cache_dir to start over."
        )


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
    enabled = progress and world.is_main
    bar = tqdm(total=total, initial=done, unit=unit[:-1], desc="Data", disable=not enabled, dynamic_ncols=True)
    with bar:
        for index, size, shard in mine:
            if not (cache_dir / shard_name(index)).is_file():
                yield index, size, shard
                bar.update(len(shard))


def _finish(
    cache_dir: Path, pipe, data: DataConfig, world: World, *, kind: str, planned: int, skipped: dict[str, str]
) -> None:
    """After every rank wrote its shards: rank 0 writes the uncond file and the manifest (collective).

    Raises:
        ValueError: on every rank, when no input could be used.
    """
    from safetensors import safe_open

    world.barrier()
    kept, shown = 0, ""
    if world.is_main:
        write_tensors(cache_dir / UNCOND, Batch(torch.zeros(1, 1), *_encode_text(pipe, [""], data)))
        shards, all_skipped = [], dict(skipped)
        for path in sorted(cache_dir.glob("shard-*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata()
            all_skipped.update(json.loads(meta["skipped"]))
            shards.append({"file": path.name, "latent_hw": json.loads(meta["latent_hw"]), "count": int(meta["count"])})
        kept = sum(shard["count"] for shard in shards)
        shown = "; ".join(f"{key}: {why}" for key, why in list(all_skipped.items())[:_SHOWN_SKIPS])
        if kept:
            write_manifest(cache_dir, {"kind": kind, "shards": shards, "skipped": all_skipped})
            logger.info("Data: cached %d of %d %s in %d shards at %s", kept, planned, kind, len(shards), cache_dir)
        if all_skipped:
            more = ", ..." if len(all_skipped) > _SHOWN_SKIPS else ""
            logger.warning("Data: skipped %d of %d %s (%s%s)", len(all_skipped), planned, kind, shown, more)
    flag = torch.tensor([kept], device=world.device)
    torch.distributed.broadcast(flag, src=0)
    if not flag.item():
        raise ValueError(
            f"none of the {planned} {kind} could be used ({shown or 'see rank 0'}). Fix the inputs and run again."
        )


def _write_shard(cache_dir: Path, index: int, batch: Batch, size: tuple[int, int], skipped: dict[str, str]) -> None:
    metadata = {
        "latent_hw": json.dumps(list(batch.latents.shape[-2:])),
        "pixel_wh": json.dumps(list(size)),
        "count": str(len(batch)),
        "skipped": json.dumps(skipped),
    }
    write_tensors(cache_dir / shard_name(index), batch, metadata=metadata)


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
        caption = caption_file.read_text(encoding="utf-8").strip() if caption_file.is_file() else ""
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


@torch.no_grad()
def prepare_images(
    folder: Path,
    cache_dir: Path,
    *,
    pipeline: Path | PipelineFiles,
    transformer: nn.Module,
    data: DataConfig,
    resolution: int,
    world: World,
    progress: bool = True,
) -> Path:
    """Encode an image folder (captions in `name.txt` beside `name.png`) into a cache (collective).

    Args:
        progress (`bool`): show rank 0's progress bar. Default: `True`.

    Raises:
        FileNotFoundError: no such folder. ValueError: no images, or none usable.
    """
    if (cache_dir / MANIFEST).is_file():
        logger.info("Data: using the finished cache %s", cache_dir)
        return cache_dir
    files = _list_images(folder)
    pipe = _load_pipeline(pipeline, transformer, world)
    sizes = bucket_sizes(data.buckets, resolution, _pixel_multiple(pipe))
    items, skipped = _scan_images(folder, files, sizes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    settings = {"kind": "images", "shard_size": data.shard_size, "max_sequence_length": data.max_sequence_length}
    _check_plan(cache_dir, items, settings, world)
    vae = pipe.vae
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    shards = _shards(items, data.shard_size)
    for index, size, shard in _pending(cache_dir, shards, world, unit="images", progress=progress):
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
            latents = ((encoded - shift) * scale).float().cpu()
            context, pooled = _encode_text(pipe, captions, data)
        _write_shard(cache_dir, index, Batch(latents, context, pooled), size, failed)
    _finish(cache_dir, pipe, data, world, kind="images", planned=len(items) + len(skipped), skipped=skipped)
    return cache_dir


def _read_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist; check --data.path.")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in prompts if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts; write one prompt a line (# starts a comment).")
    return prompts


@torch.no_grad()
def prepare_prompts(
    prompts_file: Path | None,
    cache_dir: Path,
    *,
    pipeline: Path | PipelineFiles,
    transformer: nn.Module,
    data: DataConfig,
    resolution: int,
    world: World,
    progress: bool = True,
) -> Path:
    """Generate latents for each prompt with the frozen softmax model into a cache (collective).

    Prompt i goes to bucket i mod (number of buckets) and starts from noise seeded by its index, so
    the cache does not depend on the world size or on interruptions.

    Args:
        prompts_file (`Path`, *optional*): the prompts, one a line; None takes the shipped default set
            (`trainer.prompt_set`). `data.prompt_limit` keeps the first prompts.
        progress (`bool`): show rank 0's progress bar. Default: `True`.

    Raises:
        FileNotFoundError: no such file. ValueError: no prompts, or a cache folder planned otherwise.
    """
    if (cache_dir / MANIFEST).is_file():
        logger.info("Data: using the finished cache %s", cache_dir)
        return cache_dir
    prompts = _read_prompts(prompts_file) if prompts_file is not None else default_prompts()
    prompts = prompts[: data.prompt_limit or None]
    pipe = _load_pipeline(pipeline, transformer, world)
    sizes = bucket_sizes(data.buckets, resolution, _pixel_multiple(pipe))
    items = [_Item(str(i), prompt, sizes[i % len(sizes)]) for i, prompt in enumerate(prompts)]
    cache_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "kind": "prompts",
        "shard_size": data.shard_size,
        "max_sequence_length": data.max_sequence_length,
        "generate_steps": data.generate_steps,
        "guidance_scale": data.guidance_scale,
    }
    _check_plan(cache_dir, items, settings, world)
    shards = _shards(items, data.shard_size)
    for index, size, shard in _pending(cache_dir, shards, world, unit="prompts", progress=progress):
        captions = [item.caption for item in shard]
        embeds = pipe.encode_prompt(
            prompt=captions,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=data.guidance_scale > 1,
            max_sequence_length=data.max_sequence_length,
        )
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
        batch = Batch(latents.float().cpu(), embeds[0].float().cpu(), embeds[2].float().cpu())
        _write_shard(cache_dir, index, batch, size, {})
        logger.debug("Data: generated shard %d (%d prompts at %dx%d)", index, len(shard), *size)
    _finish(cache_dir, pipe, data, world, kind="prompts", planned=len(items), skipped={})
    return cache_dir

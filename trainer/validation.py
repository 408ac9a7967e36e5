"""Validation of an SD3-family run: sample grids to look at and a held-out flow-matching loss.

`build_validator` runs before training. It keeps `--validation.holdout` cached samples out of training
(`holdout_indices`; `trainer.data.BatchPlan` is given them as `exclude`) and encodes the sample prompts once
with the base's text encoders into `<output.dir>/validation/prompts.safetensors`, which a resumed run reuses
while the prompts and text encoders match (a digest in its metadata); the encoders leave memory right after.

The loop calls the validator at step 0 of a fresh start, every `--validation.every` steps and at the last step
(`trainer.loop.TrainParts.validate`). Each call samples every prompt with T5 from fixed noise (flow-matching
Euler, `trainer.sampling.sample`, at the base scheduler's shift, in the run's precision) and measures the
flow-matching loss on the held-out samples with fixed noise and timesteps, so `val/loss` compares across
steps. At step 0 it does both with the softmax teacher too (`T5Handle.softmax`, while the inherited weights
are still the base's): `val/teacher_loss`, and the teacher's latents, kept in `teacher.safetensors` for the
grids of a resumed run. A run that starts from a file (`--model.start_from`) has no teacher: its inherited
weights start with the file's deltas, so its grids show T5 only and its step-0 `val/loss` is the file as it
is on this base. Every rank samples and measures alike (under FSDP2 each forward needs all ranks);
rank 0 decodes with the VAE (fp32, on the host between validations, on the device while it decodes) and
writes `step_NNNNNN.png` and `latest.png`: one row per prompt, the teacher's column, then T5's at the step.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from t5core.atomic import write_atomic, write_bytes_atomic
from t5core.hosts.diffusers import T5Handle
from trainer.config import DataConfig, LossConfig, TrainConfig
from trainer.data import Batch, Source
from trainer.distributed import World
from trainer.inputs.prepare import encode_text, load_encoding_pipeline, read_prompts, release_device_memory
from trainer.inputs.prompt_set import default_prompts
from trainer.inputs.single_file import load_vae
from trainer.inputs.sources import PipelineFiles, find_text_parts
from trainer.losses import shift_sigmas, step_losses
from trainer.metrics import read_metrics
from trainer.sampling import Conditioning, sample
from trainer.seeds import derived_seed

__all__ = [
    "DECODE_BATCH",
    "DEFAULT_PROMPTS",
    "FOLDER",
    "GRID_HEADER",
    "GRID_LABEL_WIDTH",
    "GRID_PAD",
    "PROMPTS_FILE",
    "REPORT_KEY",
    "SAMPLE_BATCH",
    "PromptSet",
    "Validator",
    "build_validator",
    "card_section",
    "grid_name",
    "holdout_batches",
    "holdout_indices",
    "write_grid",
]

logger = logging.getLogger(__name__)

FOLDER = "validation"
"""The validation files' folder in `<output.dir>`."""
REPORT_KEY = "validation"
"""The run report's key for the validation entry (`Validator.report`, `card_section`)."""
PROMPTS_FILE = "prompts.safetensors"
TEACHER_FILE = "teacher.safetensors"
LATEST = "latest.png"
DEFAULT_PROMPTS = 4
"""Sample prompts without `--validation.prompts`: the first of the shipped default set (they vary in every part)."""
GRID_PAD = 4
"""Pixels after each tile of a grid, right and below."""
GRID_LABEL_WIDTH = 200
"""Pixels of a grid's left column, which holds each row's prompt."""
GRID_HEADER = 16
"""Pixels of a grid's top row, which holds each column's title."""
SAMPLE_BATCH = 4
"""Prompts per sampling call (twice as many rows with guidance)."""
DECODE_BATCH = 1
"""Latents per VAE call: one 1024 px image decoded in fp32 holds about 3 GiB of activations."""
_FLOW = LossConfig()
"""The held-out loss: flow matching alone, unweighted."""


def grid_name(step: int) -> str:
    """The grid of the validation at `step`: `step_000250.png`."""
    return f"step_{step:06d}.png"


def holdout_indices(
    buckets: Mapping[tuple[int, int], Sequence[int]], *, count: int, seed: int, batch_size: int
) -> list[int]:
    """The `count` samples kept out of training, drawn by `seed` from all buckets alike, in index order.

    Raises:
        ValueError: holding them out leaves no bucket a full global batch of `batch_size` (names
            `--validation.holdout`).
    """
    if count == 0:
        return []
    everything = [index for _, indices in sorted(buckets.items()) for index in indices]
    generator = torch.Generator().manual_seed(derived_seed(seed, "holdout"))
    held = sorted(everything[i] for i in torch.randperm(len(everything), generator=generator)[:count].tolist())
    taken = set(held)
    left = {key: sum(index not in taken for index in indices) for key, indices in sorted(buckets.items())}
    if max(left.values(), default=0) < batch_size:
        sizes = ", ".join(f"{h}x{w}: {number}" for (h, w), number in left.items())
        raise ValueError(
            f"--validation.holdout {count}: the data has {len(everything)} samples, and holding {count} out leaves "
            f"no latent bucket a full global batch of {batch_size} (left per bucket: {sizes}). Lower "
            "--validation.holdout (0 = no held-out loss), add data or lower --training.batch_size."
        )
    return held


def holdout_batches(
    source: Source, held: Sequence[int], *, seed: int, shift: float, batch_size: int
) -> list[tuple[Batch, Tensor, Tensor]]:
    """The held-out samples with their fixed noise and sigmas, by bucket, in batches of at most `batch_size`.

    Sample i's noise is seeded by `(seed, i)`. The N samples' sigmas are the midpoints of N equal steps of the
    schedule, through the shift, dealt to the samples in an order drawn by `seed`.

    Returns:
        `(batch, noise (B, C, h, w), sigmas (B,))` per batch, on the host.
    """
    generator = torch.Generator().manual_seed(derived_seed(seed, "holdout-sigmas"))
    midpoints = (torch.randperm(len(held), generator=generator).double() + 0.5) / max(len(held), 1)
    sigmas = dict(zip(held, shift_sigmas(midpoints, shift).float(), strict=True))
    taken = set(held)
    batches = []
    for _, indices in sorted(source.buckets().items()):
        mine = [index for index in indices if index in taken]
        for start in range(0, len(mine), batch_size):
            part = mine[start : start + batch_size]
            batch = source.load(part)
            noise = torch.stack([_seeded_noise(batch.latents.shape[1:], seed, "holdout-noise", i) for i in part])
            batches.append((batch, noise, torch.stack([sigmas[i] for i in part])))
    return batches


def _seeded_noise(shape: Sequence[int], seed: int, *stream: int | str) -> Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(derived_seed(seed, *stream)))


def _sample_size(buckets: Mapping[tuple[int, int], Sequence[int]]) -> tuple[int, int]:
    """The samples' latent `(h, w)`: the data's square bucket, else its smallest."""
    squares = sorted(size for size in buckets if size[0] == size[1])
    return squares[0] if squares else min(sorted(buckets), key=lambda size: size[0] * size[1])


@dataclass(frozen=True)
class PromptSet:
    """The sample prompts, encoded once.

    Attributes:
        prompts: the texts. context, pooled: their `(P, T, J)` and `(P, D)` conditioning.
        empty_context, empty_pooled: the empty caption's `(1, T, J)` and `(1, D)`, the unguided branch.
        shift: the base scheduler's sampling shift. digest: what they were encoded from (prompts, text length,
            text encoder files).
    """

    prompts: tuple[str, ...]
    context: Tensor
    pooled: Tensor
    empty_context: Tensor
    empty_pooled: Tensor
    shift: float
    digest: str

    def save(self, path: Path) -> None:
        tensors = {name: getattr(self, name).contiguous() for name in _PROMPT_TENSORS}
        metadata = {"digest": self.digest, "prompts": json.dumps(self.prompts), "shift": repr(self.shift)}
        write_atomic(path, lambda temp: save_file(tensors, temp, metadata=metadata))

    @classmethod
    def load(cls, path: Path) -> PromptSet:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in _PROMPT_TENSORS}
        prompts = tuple(json.loads(meta["prompts"]))
        return cls(prompts, **tensors, shift=float(meta["shift"]), digest=meta["digest"])


_PROMPT_TENSORS = ("context", "pooled", "empty_context", "empty_pooled")


@torch.no_grad()
def _encode(
    prompts: tuple[str, ...], data: DataConfig, world: World, *, files: PipelineFiles, transformer: nn.Module
) -> tuple[Tensor, Tensor, float]:
    """`(context, pooled)` of the prompts and then of the empty caption, and the scheduler's shift; the text
    encoders are freed before returning."""
    pipe = load_encoding_pipeline(files, transformer, world)
    context, pooled = encode_text(pipe, [*prompts, ""], data)
    shift = float(pipe.scheduler.config.get("shift", 1.0))
    del pipe
    release_device_memory(world)
    return context.float().cpu(), pooled.float().cpu(), shift


def _prompt_set(
    config: TrainConfig, world: World, *, files: PipelineFiles, transformer: nn.Module, path: Path
) -> PromptSet:
    """The encoded sample prompts: `path` when it holds these prompts encoded by these text encoders, else
    encoded now (on every rank, as preparation does) and written there by rank 0."""
    settings = config.validation
    prompts = tuple(
        read_prompts(Path(settings.prompts), flag="--validation.prompts")
        if settings.prompts
        else default_prompts()[:DEFAULT_PROMPTS]
    )
    listing = {"prompts": prompts, "max_sequence_length": config.data.max_sequence_length, "text_parts": str(files)}
    digest = hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()
    if path.is_file():
        saved = PromptSet.load(path)
        if saved.digest == digest:
            logger.info("Validation: reusing the %d encoded prompts in %s", len(prompts), path)
            return saved
    # Loading may draw from the global generators; the T5 parameters built next must start as without validation.
    with torch.random.fork_rng(devices=[world.device] if world.device.type == "cuda" else []):
        context, pooled, shift = _encode(prompts, config.data, world, files=files, transformer=transformer)
    encoded = PromptSet(prompts, context[:-1], pooled[:-1], context[-1:], pooled[-1:], shift, digest)
    if world.is_main:
        encoded.save(path)
        logger.info("Validation: encoded %d prompts into %s", len(prompts), path)
    return encoded


def write_grid(path: Path, prompts: Sequence[str], columns: Sequence[tuple[str, Tensor]]) -> Path:
    """Write a labelled PNG, atomically: one row per prompt (its text on the left), one column per
    `(title, images (P, 3, H, W) in [0, 1])`, titled on top; tiles at their own size, `GRID_PAD` apart."""
    from PIL import Image, ImageDraw, ImageFont

    height, width = columns[0][1].shape[-2:]
    size = (GRID_LABEL_WIDTH + len(columns) * (width + GRID_PAD), GRID_HEADER + len(prompts) * (height + GRID_PAD))
    image = Image.new("RGB", size, (24, 24, 24))
    draw, font = ImageDraw.Draw(image), ImageFont.load_default()
    line = sum(font.getmetrics())
    chars = max(1, int((GRID_LABEL_WIDTH - 2 * GRID_PAD) / draw.textlength("x", font=font)))
    for number, (title, images) in enumerate(columns):
        left = GRID_LABEL_WIDTH + number * (width + GRID_PAD)
        draw.text((left, 2), title, fill=(255, 255, 255), font=font)
        for row in range(len(prompts)):
            pixels = (images[row].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            image.paste(Image.fromarray(pixels), (left, GRID_HEADER + row * (height + GRID_PAD)))
    for row, prompt in enumerate(prompts):
        top = GRID_HEADER + row * (height + GRID_PAD)
        for number, text in enumerate(textwrap.wrap(prompt, chars)[: max(1, height // line)]):
            draw.text((GRID_PAD, top + number * line), text, fill=(220, 220, 220), font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return write_bytes_atomic(path, buffer.getvalue())


class Validator:
    """Samples and the held-out loss of one run, at the steps the loop calls it (`bind`).

    Args:
        config: the run's config. world: this process's place in the run.
        source: the training data. held_out: its samples kept out of training (`holdout_indices`).
        prompts: the encoded sample prompts. files: where the VAE comes from. folder: `<output.dir>/validation`.
    """

    def __init__(
        self,
        config: TrainConfig,
        world: World,
        *,
        source: Source,
        held_out: list[int],
        prompts: PromptSet,
        files: PipelineFiles,
        folder: Path,
    ) -> None:
        settings = config.validation
        self.config, self.world, self.held_out = config, world, held_out
        self.prompts, self.files, self.folder = prompts, files, folder
        per_rank = max(1, config.training.batch_size // world.world_size)
        self._holdout = holdout_batches(
            source, held_out, seed=settings.seed, shift=config.loss.shift, batch_size=per_rank
        )
        latent_hw = _sample_size(source.buckets())
        channels = source.load([source.buckets()[latent_hw][0]]).latents.shape[1]
        self._noise = torch.stack(
            [_seeded_noise((channels, *latent_hw), settings.seed, "sample", i) for i in range(len(prompts.prompts))]
        )
        listing = [prompts.digest, settings.samples_steps, settings.guidance_scale, settings.seed, list(latent_hw)]
        self._teacher_digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        # a run from a file has the file's deltas in its inherited weights from the start: no softmax teacher
        self._with_teacher = not config.model.start_from
        self._teacher_latents = self._saved_teacher() if world.is_main and self._with_teacher else None
        self._teacher_images: Tensor | None = None
        self._vae: nn.Module | None = None

    def bind(self, handle: T5Handle) -> Callable[[int], dict[str, float]]:
        """The loop's hook (`TrainParts.validate`) for the converted model of `handle`: step -> metrics."""
        return lambda step: self.validate(handle, step)

    @torch.no_grad()
    def validate(self, handle: T5Handle, step: int) -> dict[str, float]:
        """Sample and measure T5 (and at step 0 the softmax teacher, unless the run starts from a file) on every
        rank; rank 0 writes the grid.

        Returns:
            `val/loss` (and at step 0 `val/teacher_loss`) when samples are held out; else nothing.
        """
        model = handle.model
        training = model.training
        model.eval()
        metrics, teacher = {}, None
        try:
            with self.world.autocast(self.config.training.autocast_dtype):
                if step == 0 and self._with_teacher:
                    with handle.softmax():
                        teacher = self._sample(model)
                        metrics.update(self._loss(model, "val/teacher_loss"))
                latents = self._sample(model)
                metrics.update(self._loss(model, "val/loss"))
        finally:
            model.train(training)
        if self.world.is_main:
            self._write(step, latents, teacher)
        return metrics

    def report(self, metrics_file: Path, *, step: int) -> dict[str, Any]:
        """The run report's `{REPORT_KEY: entry}`, read from the run's files on rank 0 ({} elsewhere): the number
        of held-out samples and prompts, the teacher's held-out loss, T5's at the first and last validation up to
        `step` (from `metrics_file`), and the grids written up to `step`."""
        if not self.world.is_main:
            return {}
        lines = read_metrics(metrics_file) if metrics_file.is_file() else []
        lines = [line for line in lines if "stage" not in line and line["step"] <= step]
        losses = {line["step"]: line["val/loss"] for line in lines if "val/loss" in line}
        teacher = [line["val/teacher_loss"] for line in lines if "val/teacher_loss" in line]
        grids = [path for path in sorted(self.folder.glob("step_*.png")) if _grid_step(path) <= step]
        summary: dict[str, Any] = {"held_out_samples": len(self.held_out), "prompts": len(self.prompts.prompts)}
        if teacher:
            summary["teacher_loss"] = teacher[-1]
        if losses:
            first, last = min(losses), max(losses)
            summary.update(start_step=first, start_loss=losses[first], end_step=last, end_loss=losses[last])
        summary["grids"] = [str(path) for path in grids]
        return {REPORT_KEY: summary}

    def _sample(self, model: nn.Module) -> Tensor:
        """Latents `(P, C, h, w)` of every prompt from its fixed noise, on the host."""
        settings, prompts, device = self.config.validation, self.prompts, self.world.device
        chunks = []
        for start in range(0, len(prompts.prompts), SAMPLE_BATCH):
            rows = slice(start, start + SAMPLE_BATCH)
            count = prompts.context[rows].shape[0]
            cond = Conditioning(
                prompts.context[rows].to(device),
                prompts.pooled[rows].to(device),
                prompts.empty_context.expand(count, -1, -1).to(device),
                prompts.empty_pooled.expand(count, -1).to(device),
            )
            noise = self._noise[rows].to(device)
            latents = sample(
                model, cond, noise, steps=settings.samples_steps, cfg=settings.guidance_scale, shift=prompts.shift
            )
            chunks.append(latents.float().cpu())
        return torch.cat(chunks)

    def _loss(self, model: nn.Module, name: str) -> dict[str, float]:
        """`{name: mean flow-matching loss over the held-out samples}`; empty without any."""
        if not self._holdout:
            return {}
        device, total = self.world.device, 0.0
        for batch, noise, sigmas in self._holdout:
            batch = batch.to(device)
            losses = step_losses(
                model,
                batch.latents,
                noise=noise.to(device),
                sigmas=sigmas.to(device),
                context=batch.context,
                pooled=batch.pooled,
                config=_FLOW,
            )
            total += losses.terms["flow"].item() * len(batch)
        return {name: total / len(self.held_out)}

    def _saved_teacher(self) -> Tensor | None:
        """The teacher's latents of an earlier start of this run, when made with these settings."""
        path = self.folder / TEACHER_FILE
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as handle:
            if handle.metadata().get("digest") != self._teacher_digest:
                return None
            return handle.get_tensor("latents")

    def _write(self, step: int, latents: Tensor, teacher: Tensor | None) -> None:
        """Rank 0: at step 0 (a fresh start) clear earlier grids and keep the teacher's samples, decode and write
        the grid of `step` and `latest.png`."""
        if step == 0:
            for old in self.folder.glob("step_*.png"):
                old.unlink()
        if teacher is not None:
            latents_file = {"latents": teacher.contiguous()}
            metadata = {"digest": self._teacher_digest}
            write_atomic(self.folder / TEACHER_FILE, lambda temp: save_file(latents_file, temp, metadata=metadata))
            self._teacher_latents, self._teacher_images = teacher, None
        columns = []
        if self._teacher_latents is not None:
            if self._teacher_images is None:
                self._teacher_images = self._decode(self._teacher_latents)
            columns.append(("teacher (softmax)", self._teacher_images))
        elif step and self._with_teacher:
            logger.warning(
                "Validation: no teacher samples of this run's start with these settings in %s; the grid of step %d "
                "shows T5 only",
                self.folder,
                step,
            )
        columns.append((f"T5, step {step}", self._decode(latents)))
        grid = write_grid(self.folder / grid_name(step), self.prompts.prompts, columns)
        write_bytes_atomic(self.folder / LATEST, grid.read_bytes())
        logger.info("Validation: step %d grid %s", step, grid)

    def _decode(self, latents: Tensor) -> Tensor:
        """Images `(P, 3, H, W)` in [0, 1] of latents, decoded on the device in batches of `DECODE_BATCH`."""
        if self._vae is None:
            self._vae = load_vae(self.files, dtype=torch.float32)
        vae = self._vae.to(self.world.device)
        shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
        images = []
        for part in latents.split(DECODE_BATCH):
            pixels = vae.decode(part.to(self.world.device) / scale + shift).sample
            images.append((pixels.float().cpu() / 2 + 0.5).clamp(0, 1))
        vae.to("cpu")
        release_device_memory(self.world)
        return torch.cat(images)


def _grid_step(path: Path) -> int:
    return int(path.stem.removeprefix("step_"))


def build_validator(
    config: TrainConfig, world: World, *, base: nn.Module, source: Source, output: Path
) -> Validator | None:
    """The run's validator, None unless `--validation.enabled`: the held-out samples chosen and the sample
    prompts encoded (or reused); the text encoders are gone when it returns.

    Args:
        base: the base transformer (the pipeline reads its config when it has no T5 text encoder).
        source: the training data. output: `<output.dir>`.

    Raises:
        ValueError: `--validation.holdout` leaves no full global batch to train on, or an empty prompts file.
        FileNotFoundError: no text encoders and VAE for the base (names `--data.pipeline`), or no prompts file.
    """
    settings = config.validation
    if not settings.enabled:
        return None
    buckets = source.buckets()
    held = holdout_indices(buckets, count=settings.holdout, seed=settings.seed, batch_size=config.training.batch_size)
    try:
        files = find_text_parts(config.model, config.data.pipeline)
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"--validation.enabled: the samples need the base's text encoders and VAE; {error}"
        ) from error
    folder = output / FOLDER
    prompts = _prompt_set(config, world, files=files, transformer=base, path=folder / PROMPTS_FILE)
    if held:
        logger.info("Validation: %d of %d samples held out of training", len(held), sum(map(len, buckets.values())))
    return Validator(config, world, source=source, held_out=held, prompts=prompts, files=files, folder=folder)


def card_section(summary: Mapping[str, Any]) -> list[str]:
    """The model card's validation text (markdown lines) for a run report's `validation` entry."""
    lines: list[str] = []
    if "end_loss" in summary:
        lines += [
            f"Flow-matching loss on {summary['held_out_samples']} samples of the training data held out of training "
            "(fixed noise and timesteps; lower is closer to the data):",
            "",
            "| model | held-out loss |",
            "|---|---|",
        ]
        if "teacher_loss" in summary:
            lines.append(f"| softmax teacher (the base) | {summary['teacher_loss']:.4f} |")
        if summary["start_step"] != summary["end_step"]:
            lines.append(f"| T5 at step {summary['start_step']} | {summary['start_loss']:.4f} |")
        lines += [f"| T5 at step {summary['end_step']} | {summary['end_loss']:.4f} |", ""]
    if summary.get("grids"):
        lines.append(
            f"Samples of the last validation: `{FOLDER}/{Path(summary['grids'][-1]).name}` in the run folder (one row "
            "per prompt; columns: the softmax teacher, then T5 at that step, from the same noise)."
        )
    return lines or ["Validation ran, but wrote no loss and no samples."]

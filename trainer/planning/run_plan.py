"""The whole run's memory plan, made from the configs before any weight loads, and checked first.

A run passes through phases, each with its own peak of memory per GPU:

* loading: the student reaches the device with its frozen weights already cast (DDP under bf16) or sharded
  (FSDP2), and the frozen teacher in the compute dtype;
* data preparation, for `--data.source images` or `prompts` without a finished cache: for images the text
  encoders and the VAE, which encodes `vae_batch` images a call (the largest count that fits); for prompts
  the text encoders embed every prompt and leave, then a frozen copy of the transformer in the pipeline's
  dtype generates a shard (with guidance, twice its prompts a call);
* the attention transfer, where `--transfer.steps` asks for it: the student's weights, one block's softmax
  forward and one module's T5 activations;
* the training steps (`trainer.planning.memory.plan_memory`).

`plan_whole_run` reads the base's transformer config (a folder's config.json, or the shipped config a
single file matches), builds the converted model on the meta device to count its parameters, and reads the
text encoders' and the VAE's configs; `RunPlan.check` refuses a run with a phase over the budget, naming
the flags that would fit. The activation constants are fitted to peaks measured at SD3.5 Medium's scale by
`benchmarks/bench_memory_plan.py` (its table is in benchmarks/README.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.planning.memory import (
    BLOCK_ACTIVATION_WIDTHS,
    GIB,
    RUNTIME_MARGIN_GIB,
    TRAINED_BYTES,
    MemoryPlan,
    PlanDoesNotFit,
    PlanSettings,
    count_parameters,
    device_budget,
    plan_training,
    run_shape,
    training_fixes,
)
from trainer.planning.time_estimate import ParamCounts, RunShape

if TYPE_CHECKING:
    from t5core.hosts.diffusers import T5Handle
    from trainer.config import TrainConfig
    from trainer.distributed import World
    from trainer.inputs.sources import PipelineFiles

__all__ = [
    "EncoderCounts",
    "VAE_DECODE_LIVE_WIDTHS",
    "VAE_LIVE_WIDTHS",
    "RunPlan",
    "encoder_counts",
    "generation_gib",
    "largest_vae_batch",
    "plan_whole_run",
    "text_activations_gib",
    "vae_activations_gib",
]

logger = logging.getLogger(__name__)

VAE_LIVE_WIDTHS = 6
"""Tensors of the VAE encoder's first width (128 channels for SD3's) per pixel alive at its peak: a resnet's
input, its normalised, activated and convolved branches and the residual sum at full resolution."""
VAE_DECODE_LIVE_WIDTHS = 9
"""The same for the VAE decoder on one image (its larger stages run at full resolution)."""
TEXT_LIVE_WIDTHS = 4
"""Per token, tensors of a text encoder's feed-forward width alive at its peak (T5's gated GELU keeps both input
projections, their product and the output)."""
GENERATION_LIVE_WIDTHS = 20
"""Per token, tensors of the transformer's width alive in a no-grad forward: the block's input, the adaLN-
modulated streams, q, k, v, the MLP's 4x hidden and its GELU's temporaries."""
CLIP_TOKENS = 77
"""SD3's CLIP context, before the T5 tokens (`--data.max_sequence_length`)."""
GPU_PIPELINE_BYTES, CPU_PIPELINE_BYTES = 2, 4
"""Bytes per weight and activation of the preparation pipeline: bf16 on a GPU (a run planned against a GPU
budget), fp32 on CPU."""


@dataclass(frozen=True, slots=True)
class EncoderCounts:
    """What preparation's memory depends on beside the transformer: the text encoders and the VAE.

    Attributes:
        text_params: parameters of the text encoders together (all three sit on the device at once).
        text_tokens: tokens per caption of each encoder. text_widths: each encoder's feed-forward width.
        text_heads: each encoder's attention heads.
        text_kept: values per token each encoder keeps for the pipeline (CLIP's hidden states of every layer, which
            SD3 reads its penultimate one from; none for T5).
        vae_params: parameters of the VAE (encoder and decoder load together).
        vae_width: channels of the VAE encoder's first (full-resolution) stage.
        vae_factor: pixels per latent along each side.
    """

    text_params: int
    text_tokens: tuple[int, ...]
    text_widths: tuple[int, ...]
    text_heads: tuple[int, ...]
    text_kept: tuple[int, ...]
    vae_params: int
    vae_width: int
    vae_factor: int


def text_activations_gib(counts: EncoderCounts, captions: int, *, dtype_bytes: int) -> float:
    """The activations of `captions` captions in one call of the text encoder with the largest ones (the
    encoders run one after another)."""
    per_caption = max(
        tokens * (TEXT_LIVE_WIDTHS * width + kept) + heads * tokens**2  # T5's position bias: one score per head
        for tokens, width, heads, kept in zip(
            counts.text_tokens, counts.text_widths, counts.text_heads, counts.text_kept, strict=True
        )
    )
    return captions * per_caption * dtype_bytes / GIB


def vae_activations_gib(
    counts: EncoderCounts, images: int, pixels: int, *, dtype_bytes: int, widths: int = VAE_LIVE_WIDTHS
) -> float:
    """The VAE's activations while it encodes (or, with `widths=VAE_DECODE_LIVE_WIDTHS`, decodes) `images` images
    of `pixels` pixels in one call."""
    return images * pixels * counts.vae_width * widths * dtype_bytes / GIB


def generation_gib(counts: ParamCounts, shape: RunShape, *, dtype_bytes: int) -> float:
    """A frozen copy of the base transformer (weights and buffers in the pipeline's dtype) sampling a batch of
    `shape.batch_per_rank` (the prompts, doubled under guidance) without gradients."""
    weights = counts.trained + counts.frozen + counts.buffers
    tokens = shape.batch_per_rank * (shape.image_tokens + shape.text_tokens)
    return (weights + tokens * shape.hidden * GENERATION_LIVE_WIDTHS) * dtype_bytes / GIB


def largest_vae_batch(counts: EncoderCounts, *, room_gib: float, pixels: int, most: int, dtype_bytes: int) -> int:
    """The most images (at most `most`) the VAE can encode in one call within `room_gib`; 0 when not even one fits."""
    one = vae_activations_gib(counts, 1, pixels, dtype_bytes=dtype_bytes)
    return max(min(most, int(room_gib // one)), 0) if one > 0 else most


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The estimated peak GiB per GPU of each phase of a run, in the order they run.

    Attributes:
        phases: phase name -> GiB. notes: phase name -> how it was sized (shown beside it).
        budget_gib: memory per GPU (None: a CPU run, nothing to check). training: the training phase's plan.
        vae_batch: images per VAE call during preparation (0: a whole shard).
        hints: phase name -> what would make it fit, for phases over the budget.
    """

    phases: dict[str, float]
    budget_gib: float | None
    training: MemoryPlan
    vae_batch: int = 0
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    hints: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return max(self.phases.values())

    def over_budget(self) -> list[str]:
        """The phases that exceed the budget."""
        if self.budget_gib is None:
            return []
        return [name for name, gib in self.phases.items() if gib > self.budget_gib]

    def summary(self) -> str:
        budget = "no GPU budget to check" if self.budget_gib is None else f"budget {self.budget_gib:.1f} GiB"
        rows = [f"Memory plan per GPU for the whole run ({budget}):"]
        for name, gib in self.phases.items():
            note = f" ({self.notes[name]})" if name in self.notes else ""
            rows.append(f"  {name:34} {gib:6.2f} GiB{note}")
        if self.training.time is not None:
            rows.append(f"  {self.training.time.summary()}")
        return "\n".join(rows)

    def check(self) -> None:
        """Refuse a run with a phase over the budget, before anything heavy loads.

        Raises:
            PlanDoesNotFit: names each phase over the budget, its estimate and the flags that would fit.
        """
        over = self.over_budget()
        if not over:
            return
        needs = {name: f"{name} needs about {self.phases[name]:.1f} GiB" for name in over}
        problems = " ".join(f"{needs[name]}. Try: {self.hints[name]}." for name in over)
        raise PlanDoesNotFit(
            f"the run needs about {self.peak_gib:.1f} GiB per GPU but has {self.budget_gib:.1f} GiB (planned before "
            f"loading anything; the plan of every phase is logged above). {problems}"
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _meta_counts(transformer: dict, config: TrainConfig) -> tuple[ParamCounts, T5Handle]:
    """The converted student's `ParamCounts` and its `T5Handle`, built on the meta device (no memory)."""
    from diffusers import SD3Transformer2DModel

    from trainer.model import build_model

    with torch.device("meta"):
        base = SD3Transformer2DModel.from_config(transformer)
    # a start file (`--model.start_from`) has the shapes of fresh modules and factors of its recipe, and a meta
    # model has no values to add its deltas to
    fresh = dataclasses.replace(config.model, start_from="")
    handle, split = build_model(base, dataclasses.replace(config, model=fresh))
    return count_parameters(handle, split), handle


def _parts_folder(files: PipelineFiles) -> Path:
    return files.folder if files.folder is not None else files.configs


def encoder_counts(files: PipelineFiles, *, max_sequence_length: int) -> EncoderCounts:
    """`EncoderCounts` of the text encoders and the VAE that `files` would load, built on the meta device."""
    from diffusers import AutoencoderKL
    from transformers import AutoConfig, CLIPTextModelWithProjection, T5EncoderModel

    folder = _parts_folder(files)
    params, tokens, widths, heads, kept = 0, [], [], [], []
    for sub in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if not (folder / sub / "config.json").is_file():
            continue
        part = AutoConfig.from_pretrained(folder / sub, local_files_only=True)
        is_t5 = part.model_type == "t5"
        with torch.device("meta"):
            model = T5EncoderModel(part) if is_t5 else CLIPTextModelWithProjection(part)
        params += sum(p.numel() for p in model.parameters())
        tokens.append(max_sequence_length if is_t5 else part.max_position_embeddings)
        widths.append(part.d_ff if is_t5 else part.intermediate_size)
        heads.append(part.num_heads if is_t5 else part.num_attention_heads)
        kept.append(0 if is_t5 else (part.num_hidden_layers + 1) * part.hidden_size)
    if not (folder / "vae" / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no vae/config.json: preparing data needs the pipeline's VAE. Give a full SD3 pipeline "
            "folder with --data.pipeline, or a prepared cache with --data.source cache."
        )
    vae_config = _read_json(folder / "vae" / "config.json")
    with torch.device("meta"):
        vae = AutoencoderKL.from_config(vae_config)
    return EncoderCounts(
        text_params=params,
        text_tokens=tuple(tokens),
        text_widths=tuple(widths),
        text_heads=tuple(heads),
        text_kept=tuple(kept),
        vae_params=sum(p.numel() for p in vae.parameters()),
        vae_width=vae_config["block_out_channels"][0],
        vae_factor=2 ** (len(vae_config["block_out_channels"]) - 1),
    )


def _largest_pixels(config: TrainConfig, multiple: int) -> tuple[int, int]:
    """The largest bucket's pixel size `(width, height)` at `--data.resolution`."""
    from trainer.data import bucket_sizes
    from trainer.inputs.prepare import DEFAULT_RESOLUTION

    sizes = bucket_sizes(config.data.buckets, config.data.resolution or DEFAULT_RESOLUTION, multiple)
    return max(sizes, key=lambda wh: wh[0] * wh[1])


def _cached_tokens(folder: Path, patch: int) -> tuple[int, int]:
    """`(image tokens, text tokens)` of a finished cache's largest bucket."""
    from trainer.inputs.cache import CacheSource

    source = CacheSource(folder)
    (height, width), indices = max(source.buckets().items(), key=lambda item: item[0][0] * item[0][1])
    return (height // patch) * (width // patch), source.load(indices[:1]).context.shape[1]


_ELSEWHERE = "or prepare the cache on a larger GPU and train from it with --data.source cache --data.path DIR"


@dataclass(frozen=True, slots=True)
class _Phases:
    """Some phases of a run: GiB, how each was sized, and what would make it fit."""

    gib: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    hints: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, name: str, gib: float, *, note: str = "", hint: str) -> None:
        self.gib[name], self.hints[name] = gib, hint
        if note:
            self.notes[name] = note


def _preparation(
    config: TrainConfig, world: World, phases: _Phases, *, budget: float | None, counts: ParamCounts, shape: RunShape,
    encoders: EncoderCounts, pixels: int,
) -> int:  # fmt: skip
    """Add the preparation phases to `phases`; returns the VAE's images a call (0: a whole shard, no budget)."""
    data = config.data
    size = GPU_PIPELINE_BYTES if budget is not None else CPU_PIPELINE_BYTES
    margin = RUNTIME_MARGIN_GIB if budget is not None else 0.0
    resident = (encoders.text_params + encoders.vae_params) * size / GIB + margin
    text = resident + text_activations_gib(encoders, data.shard_size, dtype_bytes=size)
    fewer = f"lower --data.shard_size ({data.shard_size}), {_ELSEWHERE}"
    if data.source == "prompts":
        phases.add("preparation: embedding prompts", text, note=f"{data.shard_size} prompts a call", hint=fewer)
        samples = (2 if data.guidance_scale > 1 else 1) * data.shard_size
        generating = dataclasses.replace(shape, batch_per_rank=samples)
        gib = generation_gib(counts, generating, dtype_bytes=size) + margin
        phases.add("preparation: generating latents", gib, note=f"{samples} samples a call", hint=fewer)
        return 0
    vae_batch = data.shard_size
    if budget is not None:
        room = budget - resident
        vae_batch = largest_vae_batch(encoders, room_gib=room, pixels=pixels, most=data.shard_size, dtype_bytes=size)
    vae = resident + vae_activations_gib(encoders, max(vae_batch, 1), pixels, dtype_bytes=size)
    hint = fewer if vae_batch else f"not one image fits beside the encoders: lower --data.resolution, {_ELSEWHERE}"
    note = f"{data.shard_size} captions, {max(vae_batch, 1)} images a VAE call"
    phases.add("preparation: encoding images", max(text, vae), note=note, hint=hint)
    return vae_batch if budget is not None else 0


_STEP_ONLY = ("activations", "AdamW step scratch beyond activations")
"""Training components the attention transfer does not have."""


def _steady_gib(plan: MemoryPlan) -> float:
    """What training holds on the device between steps: weights, optimizer state, buffers, teacher, margin."""
    return sum(gib for name, gib in plan.components.items() if name not in _STEP_ONLY)


def _transfer_gib(plan: MemoryPlan, shape: RunShape, settings: PlanSettings) -> float:
    """The attention transfer: the student's weights as training holds them, one block's no-grad softmax forward
    and one converted module's T5 activations (bounded by a training block's)."""
    low = 2 if settings.precision == "bf16" else 4
    tokens = shape.batch_per_rank * (shape.image_tokens + shape.text_tokens)
    return _steady_gib(plan) + (GENERATION_LIVE_WIDTHS + BLOCK_ACTIVATION_WIDTHS) * tokens * shape.hidden * low / GIB


def _validation(
    config: TrainConfig, phases: _Phases, *, plan: MemoryPlan, shape: RunShape, encoders: EncoderCounts,
    budget: float | None, pixels: int,
) -> None:  # fmt: skip
    """Add validation's phases (`--validation.enabled`): embedding its prompts before training, and sampling and
    decoding them while training's weights and optimizer state stay on the device."""
    from trainer.inputs.prepare import read_prompts
    from trainer.validation import DECODE_BATCH, DEFAULT_PROMPTS, SAMPLE_BATCH

    settings = config.validation
    prompts = len(read_prompts(Path(settings.prompts), flag="--validation.prompts")) if settings.prompts else None
    prompts = prompts or DEFAULT_PROMPTS
    size = GPU_PIPELINE_BYTES if budget is not None else CPU_PIPELINE_BYTES
    margin = RUNTIME_MARGIN_GIB if budget is not None else 0.0
    off = "turn validation off (--validation.enabled false)"
    resident = (encoders.text_params + encoders.vae_params) * size / GIB + margin
    embedding = resident + text_activations_gib(encoders, prompts + 1, dtype_bytes=size)
    phases.add("validation: embedding prompts", embedding, note=f"{prompts} prompts and the empty one", hint=off)
    low = 2 if config.training.precision == "bf16" else 4
    autocast_copies = plan.components["trained weights+grads+AdamW"] / TRAINED_BYTES * 2 if low == 2 else 0.0
    samples = (2 if settings.guidance_scale > 1 else 1) * min(SAMPLE_BATCH, prompts)
    sampling = dataclasses.replace(shape, batch_per_rank=samples)
    tokens = samples * (sampling.image_tokens + sampling.text_tokens)
    forward = tokens * shape.hidden * GENERATION_LIVE_WIDTHS * low / GIB + autocast_copies
    decode = encoders.vae_params * 4 / GIB + vae_activations_gib(
        encoders, DECODE_BATCH, pixels, dtype_bytes=4, widths=VAE_DECODE_LIVE_WIDTHS
    )
    note = f"{samples} samples a call, then the fp32 VAE decodes {DECODE_BATCH} a call, beside the training state"
    phases.add("validation: samples", _steady_gib(plan) + max(forward, decode), note=note, hint=off)


def plan_whole_run(config: TrainConfig, world: World) -> RunPlan | None:
    """The memory plan of every phase of the run `config` describes, from configs alone (None for a model preset,
    whose small model is planned once built).

    Raises:
        FileNotFoundError / ValueError: as `trainer.model.load_base`, for a base that is missing or not SD3, and
            as `trainer.inputs.prepare.prepare_data` for missing or empty data inputs.
    """
    from trainer.presets import get_preset

    if get_preset(config.model.base) is not None:
        return None
    from trainer.inputs.prepare import cache_dir_of, check_inputs, needs_preparation
    from trainer.inputs.sources import find_text_parts
    from trainer.model import base_files

    budget, device_name = device_budget(config.parallel, world)
    transformer = base_files(config.model).read_config()
    counts, handle = _meta_counts(transformer, config)
    patch, data, training = transformer["patch_size"], config.data, config.training
    preparing, encoders = needs_preparation(config), None
    if preparing or config.validation.enabled:
        files = find_text_parts(config.model, data.pipeline)
        if preparing:
            check_inputs(data)
        encoders = encoder_counts(files, max_sequence_length=data.max_sequence_length)
    if preparing:
        width, height = _largest_pixels(config, encoders.vae_factor * patch)
        image_tokens = (width // encoders.vae_factor // patch) * (height // encoders.vae_factor // patch)
        text_tokens = CLIP_TOKENS + data.max_sequence_length
    else:
        folder = Path(data.path) if data.source == "cache" else cache_dir_of(config)
        image_tokens, text_tokens = _cached_tokens(folder, patch)
    shape = run_shape(
        handle.arch,
        list(handle.modules),
        batch_per_rank=training.batch_size // (world.world_size * training.accumulate),
        accumulate=training.accumulate,
        image_tokens=image_tokens,
        text_tokens=text_tokens,
    )
    teacher = counts.trained + counts.frozen if config.loss.needs_teacher else 0
    plan, settings = plan_training(
        config, counts, shape, world_size=world.world_size, budget_gib=budget, device_name=device_name,
        teacher_params=teacher,
    )  # fmt: skip
    fixes = training_fixes(counts, shape, settings, budget_gib=budget) if budget is not None and not plan.fits else ""
    phases = _Phases()
    phases.add("loading", plan.load_gib, hint=fixes)
    vae_batch = 0
    pixels = image_tokens * patch**2 * (encoders.vae_factor**2 if encoders else 0)
    if preparing:
        vae_batch = _preparation(
            config, world, phases, budget=budget, counts=counts, shape=shape, encoders=encoders, pixels=pixels
        )
    if config.validation.enabled:
        _validation(config, phases, plan=plan, shape=shape, encoders=encoders, budget=budget, pixels=pixels)
    if config.transfer.steps:
        phases.add("attention transfer", _transfer_gib(plan, shape, settings), hint=fixes)
    if training.steps:
        note = ", ".join(f"{name} {gib:.2f}" for name, gib in plan.components.items() if gib > 0)
        phases.add("training", sum(plan.components.values()), note=note, hint=fixes)
    return RunPlan(phases.gib, budget, plan, vae_batch=vae_batch, notes=phases.notes, hints=phases.hints)

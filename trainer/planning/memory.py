"""Run planning: the estimated memory per GPU of a run, checked before training starts, and its time.

The memory estimate adds up, per rank: trained weights with their fp32 master copy, gradient and two
AdamW moments (16 bytes per parameter; divided by the world size under FSDP2), frozen weights (bf16
under bf16 precision with DDP, sharded fp32 under FSDP2), buffers, the optional frozen teacher, the
unsharded blocks FSDP2 holds while computing, activations or, when larger, the AdamW step's scratch,
and a fixed runtime margin. Loading is a second peak, below training's: frozen weights are cast before
they move (DDP) and FSDP2 moves one block at a time and shards it. The SD3.5 Medium figures were checked
against a measured CPU training step (benchmarks/bench_memory_plan.py). `plan_training` adds the run's
time estimate (`trainer.planning.time_estimate`, which also defines the `ParamCounts` and `RunShape` both
estimates read; `count_parameters` and `run_shape` make them); `check_plan` refuses a plan over the
budget, and `plan_run` is the trainer's step once the model is built. The phases before training
(loading, data preparation, the attention transfer) are planned together in `trainer.planning.run_plan`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from trainer.planning.time_estimate import GPUS, ParamCounts, RunShape, TimeEstimate, estimate_time, find_gpu

if TYPE_CHECKING:
    from torch import nn

    from t5core.config import BaseArch
    from t5core.hosts.diffusers import T5Handle
    from trainer.config import ParallelConfig, TrainConfig
    from trainer.data import BatchPlan, Source
    from trainer.distributed import World
    from trainer.model import ParamSplit

__all__ = [
    "MemoryPlan",
    "PlanDoesNotFit",
    "PlanSettings",
    "check_plan",
    "count_parameters",
    "device_budget",
    "plan_training",
    "training_fixes",
    "plan_memory",
    "plan_run",
    "run_shape",
    "suggest",
]

logger = logging.getLogger(__name__)

GIB = 1024**3


class PlanDoesNotFit(RuntimeError):
    """The run's memory plan exceeds the memory per GPU; the message names flag changes that would fit."""


TRAINED_BYTES = 16
"""fp32 weight + fp32 gradient + AdamW exp_avg + exp_avg_sq, 4 bytes each."""
BLOCK_ACTIVATION_WIDTHS = 24
"""Tensors of width `hidden` per token that one joint block keeps for backward: the two adaLN-
modulated inputs, q, k, v, attention output and its projection (7), the residual sums (2), the
image-only attn2 branch (5), the MLP input, its 4x hidden GELU pre- and post-activation (1 + 8) and
output (1). Rounded to 24; the T5 inner state (H x D x D per sample) is negligible beside it."""
ADAMW_SCRATCH_BYTES = 4
"""Per trained parameter: the temporary tensor list of the foreach AdamW step, beyond weights, gradients and
moments. It exists after backward, when the activations are gone, so the plan counts whichever of the two is
larger."""
FSDP_PREFETCH_BLOCKS = 2
"""FSDP2 holds the block being computed plus the next one being gathered."""
RUNTIME_MARGIN_GIB = 2.0
"""CUDA context, NCCL buffers and allocator fragmentation: a planning margin, not a measurement."""


def count_parameters(handle: T5Handle, split: ParamSplit) -> ParamCounts:
    """The `ParamCounts` of a converted model whose parameters `split_parameters` has assigned roles.

    Args:
        handle (`T5Handle`): the converted model (a real one, or one built on the meta device).
        split (`ParamSplit`): the parameter names by role.
    """
    params = dict(handle.model.named_parameters())
    return ParamCounts(
        trained=sum(params[n].numel() for n in split.new + split.inherited),
        frozen=sum(params[n].numel() for n in split.frozen),
        buffers=sum(b.numel() for b in handle.model.buffers()),
        largest_block=max(sum(p.numel() for p in block.parameters()) for block in handle.model.transformer_blocks),
    )


def run_shape(
    arch: BaseArch,
    converted: list[str],
    *,
    batch_per_rank: int,
    image_tokens: int,
    text_tokens: int,
    accumulate: int = 1,
) -> RunShape:
    """The `RunShape` of a converted model.

    Args:
        arch (`BaseArch`): the base model's shape.
        converted (`list[str]`): the converted modules, named as `T5Handle.modules` names them (`blocks.3.attn2`).
        batch_per_rank (`int`): samples per rank in one micro-batch. image_tokens, text_tokens (`int`): tokens per
            sample. accumulate (`int`, *optional*): micro-batches per optimizer step.
    """
    image_only = len(arch.dual_attention_layers)
    converted_image_only = sum(name.endswith(".attn2") for name in converted)
    return RunShape(
        batch_per_rank=batch_per_rank,
        image_tokens=image_tokens,
        text_tokens=text_tokens,
        hidden=arch.hidden,
        depth=arch.depth,
        image_only_blocks=image_only,
        softmax_joint=arch.depth - (len(converted) - converted_image_only),
        softmax_image_only=image_only - converted_image_only,
        accumulate=accumulate,
    )


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """The settings a memory plan depends on, beside the model and the batch."""

    mode: Literal["ddp", "fsdp2"]
    """Parallelism (`--parallel.mode`)."""
    world_size: int
    """Processes, one per GPU."""
    precision: Literal["fp32", "bf16"]
    """Compute precision (`--training.precision`)."""
    gradient_checkpointing: bool
    """Recompute blocks in backward (`--training.gradient_checkpointing`)."""
    teacher_params: int = 0
    """Parameters of the frozen teacher (0 = none)."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Estimated GiB per rank: the training peak by component and the loading peak; `fits` checks
    the larger against `budget_gib`."""

    components: dict[str, float]
    budget_gib: float | None
    load_gib: float = 0.0
    time: TimeEstimate | None = None

    @property
    def total_gib(self) -> float:
        return max(sum(self.components.values()), self.load_gib)

    @property
    def fits(self) -> bool:
        return self.budget_gib is None or self.total_gib <= self.budget_gib

    def summary(self) -> str:
        parts = ", ".join(f"{name} {gib:.2f}" for name, gib in self.components.items() if gib > 0)
        budget = "no GPU budget to check" if self.budget_gib is None else f"budget {self.budget_gib:.1f} GiB"
        text = (
            f"{self.total_gib:.2f} GiB per GPU (training {sum(self.components.values()):.2f}: {parts}; "
            f"loading {self.load_gib:.2f}); {budget}"
        )
        return text if self.time is None else f"{text}; {self.time.summary()}"


def plan_memory(
    counts: ParamCounts,
    shape: RunShape,
    settings: PlanSettings,
    *,
    budget_gib: float | None = None,
    runtime_margin_gib: float = RUNTIME_MARGIN_GIB,
) -> MemoryPlan:
    """Estimate the memory per GPU of one configuration.

    Args:
        counts (`ParamCounts`): parameters of the converted student by role.
        shape (`RunShape`): batch per rank and token counts.
        settings (`PlanSettings`): parallelism, precision, checkpointing and the teacher.
        budget_gib (`float`, *optional*): memory per GPU to check against.
        runtime_margin_gib (`float`, *optional*): fixed GPU runtime overhead; 0 for a CPU run.
    """
    mode, teacher_params = settings.mode, settings.teacher_params
    low = 2 if settings.precision == "bf16" else 4
    shards = settings.world_size if mode == "fsdp2" else 1
    frozen_bytes = 4 if mode == "fsdp2" else low
    teacher = teacher_params * low / shards / GIB  # stored in the compute dtype, sharded under FSDP2
    components = {
        "trained weights+grads+AdamW": counts.trained * TRAINED_BYTES / shards / GIB,
        "frozen weights": counts.frozen * frozen_bytes / shards / GIB,
        "buffers": counts.buffers * 4 / GIB,
        "teacher": teacher,
        "FSDP2 gathered blocks": (FSDP_PREFETCH_BLOCKS * counts.largest_block * low / GIB) if mode == "fsdp2" else 0.0,
    }
    tokens = shape.batch_per_rank * (shape.image_tokens + shape.text_tokens)
    per_block = BLOCK_ACTIVATION_WIDTHS * tokens * shape.hidden * low
    if settings.gradient_checkpointing:
        # Saved: each block's two input streams; live: one block being recomputed.
        activations = shape.depth * 2 * tokens * shape.hidden * low + per_block
    else:
        activations = shape.depth * per_block
    components["activations"] = activations / GIB
    scratch = counts.trained * ADAMW_SCRATCH_BYTES / shards
    components["AdamW step scratch beyond activations"] = max(scratch - activations, 0) / GIB
    components["runtime margin"] = runtime_margin_gib
    # Loading casts frozen weights before they move (DDP) or moves one block at a time and shards it (FSDP2).
    if mode == "fsdp2":
        weights = (counts.trained + counts.frozen) * 4 / shards + counts.largest_block * 4
    else:
        weights = counts.trained * 4 + counts.frozen * low
    load = (weights + counts.buffers * 4 + teacher_params * low / shards) / GIB + runtime_margin_gib
    return MemoryPlan(components, budget_gib, load_gib=load)


_FIXES = (
    ("--training.gradient_checkpointing true", dict(gradient_checkpointing=True)),
    ("--training.precision bf16", dict(precision="bf16")),
    ("--parallel.mode fsdp2", dict(mode="fsdp2")),
    (
        "--parallel.mode fsdp2 --training.precision bf16 --training.gradient_checkpointing true",
        dict(mode="fsdp2", precision="bf16", gradient_checkpointing=True),
    ),
)
"""Flag changes `suggest` tries, cheapest first, with the `PlanSettings` fields they set."""


def suggest(counts: ParamCounts, shape: RunShape, settings: PlanSettings, *, budget_gib: float) -> list[str]:
    """Flag changes that make a plan fit, cheapest first (each checked with `plan_memory`)."""
    found = []
    for flags, change in _FIXES:
        if all(getattr(settings, key) == value for key, value in change.items()):
            continue
        plan = plan_memory(counts, shape, dataclasses.replace(settings, **change), budget_gib=budget_gib)
        if plan.fits:
            found.append(f"{flags} (about {plan.total_gib:.1f} GiB)")
    if shape.batch_per_rank > 1:
        # More micro-batches per step, the largest that fits: the same global batch and numbers, in more time.
        for split in (n for n in range(2, shape.batch_per_rank + 1) if shape.batch_per_rank % n == 0):
            micro = dataclasses.replace(
                shape, batch_per_rank=shape.batch_per_rank // split, accumulate=shape.accumulate * split
            )
            plan = plan_memory(counts, micro, settings, budget_gib=budget_gib)
            if plan.fits:
                found.append(
                    f"--training.accumulate {micro.accumulate} (the same global batch, {micro.batch_per_rank} per GPU "
                    f"at a time; about {plan.total_gib:.1f} GiB)"
                )
                break
        smaller = dataclasses.replace(shape, batch_per_rank=1)
        plan = plan_memory(counts, smaller, settings, budget_gib=budget_gib)
        if plan.fits:
            batch = settings.world_size * shape.accumulate
            found.append(f"--training.batch_size {batch} (1 per GPU; about {plan.total_gib:.1f} GiB)")
    return found


def plan_training(
    config: TrainConfig,
    counts: ParamCounts,
    shape: RunShape,
    *,
    world_size: int,
    budget_gib: float | None,
    device_name: str | None,
    teacher_params: int = 0,
) -> tuple[MemoryPlan, PlanSettings]:
    """The memory and time plan of the training steps as `config` says, and the settings it was made with.

    Args:
        config (`TrainConfig`): the run's settings (precision, checkpointing, parallel mode, steps).
        counts (`ParamCounts`), shape (`RunShape`): the converted model and the largest batch.
        world_size (`int`): processes. budget_gib (`float`, *optional*): memory per GPU; None = no check
            and no runtime margin (a CPU run). device_name (`str`, *optional*): the GPU, for the time estimate.
        teacher_params (`int`, *optional*): parameters of the frozen teacher.
    """
    training = config.training
    settings = PlanSettings(
        mode=config.parallel.mode,
        world_size=world_size,
        precision=training.precision,
        gradient_checkpointing=training.gradient_checkpointing,
        teacher_params=teacher_params,
    )
    margin = RUNTIME_MARGIN_GIB if budget_gib is not None else 0.0
    plan = plan_memory(counts, shape, settings, budget_gib=budget_gib, runtime_margin_gib=margin)
    gpu = find_gpu(device_name, budget_gib)
    if gpu is None and device_name:
        known = ", ".join(gpu.name for gpu in GPUS)
        logger.info("No time estimate: %s is not a GPU trainer.planning.time_estimate knows (%s)", device_name, known)
    if gpu is not None:
        time = estimate_time(
            counts,
            shape,
            gpu=gpu,
            gradient_checkpointing=settings.gradient_checkpointing,
            steps=training.steps,
            max_minutes=training.max_minutes,
            transfer_steps=config.transfer.steps,
        )
        plan = dataclasses.replace(plan, time=time)
    return plan, settings


def training_fixes(counts: ParamCounts, shape: RunShape, settings: PlanSettings, *, budget_gib: float) -> str:
    """What to try when the training steps do not fit: `suggest`'s flags, or training fewer weights."""
    fixes = suggest(counts, shape, settings, budget_gib=budget_gib)
    return "; ".join(fixes) if fixes else "train fewer weights (--model.trainable t5)"


def check_plan(plan: MemoryPlan, settings: PlanSettings, counts: ParamCounts, shape: RunShape) -> MemoryPlan:
    """`plan` (from `plan_training`), refused when it does not fit its budget.

    Raises:
        PlanDoesNotFit: the plan does not fit; the message lists flag changes that would, or says that none does.
    """
    if plan.fits:
        return plan
    budget = plan.budget_gib
    raise PlanDoesNotFit(
        f"the run needs about {plan.total_gib:.1f} GiB per GPU but has {budget:.1f} GiB ({plan.summary()}). "
        f"Try: {training_fixes(counts, shape, settings, budget_gib=budget)}."
    )


def device_budget(parallel: ParallelConfig, world: World) -> tuple[float | None, str | None]:
    """The memory per GPU to plan for (`--parallel.gpu_memory_gib`, else the device's own; None on CPU) and
    the GPU's name (None on CPU)."""
    budget = parallel.gpu_memory_gib or None
    device_name = torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else None
    if budget is None and device_name is not None:
        budget = torch.cuda.get_device_properties(world.device).total_memory / GIB
    return budget, device_name


def plan_run(
    config: TrainConfig,
    handle: T5Handle,
    split: ParamSplit,
    *,
    source: Source,
    plan: BatchPlan,
    world: World,
    teacher: nn.Module | None,
) -> MemoryPlan:
    """`plan_training` and `check_plan` for a built run: its largest bucket that trains (holds a full batch),
    batch per rank and teacher, against `--parallel.gpu_memory_gib` or else this machine's GPU (a CPU run has no
    budget to check)."""
    patch = handle.model.config.patch_size
    trained = [hw for hw, indices in plan.buckets.items() if len(indices) >= plan.batch_size]  # the others never train
    latent_h, latent_w = max(trained, key=lambda hw: hw[0] * hw[1])
    sample = source.load([plan.buckets[(latent_h, latent_w)][0]])
    shape = run_shape(
        handle.arch,
        list(handle.modules),
        batch_per_rank=config.training.batch_size // (world.world_size * config.training.accumulate),
        accumulate=config.training.accumulate,
        image_tokens=(latent_h // patch) * (latent_w // patch),
        text_tokens=sample.context.shape[1],
    )
    budget, device_name = device_budget(config.parallel, world)
    counts = count_parameters(handle, split)
    plan, settings = plan_training(
        config,
        counts,
        shape,
        world_size=world.world_size,
        budget_gib=budget,
        device_name=device_name,
        teacher_params=sum(p.numel() for p in teacher.parameters()) if teacher is not None else 0,
    )
    memory = check_plan(plan, settings, counts, shape)
    logger.info("Memory plan: %s", memory.summary())
    return memory

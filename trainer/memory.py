"""Memory planning: the estimated memory per GPU of a run, checked before training starts.

The estimate adds up, per rank: trained weights with their fp32 master copy, gradient and two AdamW
moments (16 bytes per parameter; divided by the world size under FSDP2), frozen weights (bf16 under
bf16 precision with DDP, sharded fp32 under FSDP2), buffers, the optional frozen teacher, the
unsharded blocks FSDP2 holds while computing, activations, and a fixed runtime margin. It is an
estimate for planning, not a measurement: benchmarks/bench_trainer_memory.py prints it for SD3.5.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["MemoryPlan", "ParamCounts", "RunShape", "plan_memory", "suggest"]

logger = logging.getLogger(__name__)

GIB = 1024**3
TRAINED_BYTES = 16
"""fp32 weight + fp32 gradient + AdamW exp_avg + exp_avg_sq, 4 bytes each."""
BLOCK_ACTIVATION_WIDTHS = 24
"""Tensors of width `hidden` per token that one joint block keeps for backward: the two adaLN-
modulated inputs, q, k, v, attention output and its projection (7), the residual sums (2), the
image-only attn2 branch (5), the MLP input, its 4x hidden GELU pre- and post-activation (1 + 8) and
output (1). Rounded to 24; the T5 inner state (H x D x D per sample) is negligible beside it."""
FSDP_PREFETCH_BLOCKS = 2
"""FSDP2 holds the block being computed plus the next one being gathered."""
RUNTIME_MARGIN_GIB = 2.0
"""CUDA context, NCCL buffers and allocator fragmentation: a planning margin, not a measurement."""


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameter counts of the converted model by role, and of one transformer block at most."""

    trained: int
    frozen: int
    buffers: int
    largest_block: int


@dataclass(frozen=True, slots=True)
class RunShape:
    """What the activations depend on: batch per rank, tokens and the model's width and depth."""

    batch_per_rank: int
    image_tokens: int
    text_tokens: int
    hidden: int
    depth: int


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Estimated GiB per rank by component; `fits` compares the total with `budget_gib`."""

    components: dict[str, float]
    budget_gib: float | None
    settings: dict[str, object] = field(default_factory=dict)

    @property
    def total_gib(self) -> float:
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        return self.budget_gib is None or self.total_gib <= self.budget_gib

    def summary(self) -> str:
        parts = ", ".join(f"{name} {gib:.2f}" for name, gib in self.components.items() if gib > 0)
        budget = "no GPU budget to check" if self.budget_gib is None else f"budget {self.budget_gib:.1f} GiB"
        return f"{self.total_gib:.2f} GiB per GPU ({parts}); {budget}"


def plan_memory(
    counts: ParamCounts,
    shape: RunShape,
    *,
    mode: str,
    world_size: int,
    precision: str,
    gradient_checkpointing: bool,
    teacher_params: int = 0,
    budget_gib: float | None = None,
    runtime_margin_gib: float = RUNTIME_MARGIN_GIB,
) -> MemoryPlan:
    """Estimate the memory per GPU of one configuration.

    Args:
        counts (`ParamCounts`): parameters of the converted student by role.
        shape (`RunShape`): batch per rank and token counts.
        mode (`"ddp" | "fsdp2"`): parallelism. world_size: processes.
        precision (`"fp32" | "bf16"`): compute precision.
        gradient_checkpointing (`bool`): recompute blocks in backward.
        teacher_params (`int`, *optional*): parameters of the frozen teacher (0 = none).
        budget_gib (`float`, *optional*): memory per GPU to check against.
        runtime_margin_gib (`float`, *optional*): fixed GPU runtime overhead; 0 for a CPU run.
    """
    low = 2 if precision == "bf16" else 4
    shards = world_size if mode == "fsdp2" else 1
    frozen_bytes = 4 if mode == "fsdp2" else low
    components = {
        "trained weights+grads+AdamW": counts.trained * TRAINED_BYTES / shards / GIB,
        "frozen weights": counts.frozen * frozen_bytes / shards / GIB,
        "buffers": counts.buffers * 4 / GIB,
        "teacher": teacher_params * (4 if mode == "fsdp2" else low) / shards / GIB,
        "FSDP2 gathered blocks": (FSDP_PREFETCH_BLOCKS * counts.largest_block * low / GIB) if mode == "fsdp2" else 0.0,
    }
    tokens = shape.batch_per_rank * (shape.image_tokens + shape.text_tokens)
    per_block = BLOCK_ACTIVATION_WIDTHS * tokens * shape.hidden * low
    if gradient_checkpointing:
        # Saved: each block's two input streams; live: one block being recomputed.
        activations = shape.depth * 2 * tokens * shape.hidden * low + per_block
    else:
        activations = shape.depth * per_block
    components["activations"] = activations / GIB
    components["runtime margin"] = runtime_margin_gib
    settings = dict(
        mode=mode, world_size=world_size, precision=precision, gradient_checkpointing=gradient_checkpointing
    )
    return MemoryPlan(components, budget_gib, settings)


def suggest(
    counts: ParamCounts,
    shape: RunShape,
    *,
    mode: str,
    world_size: int,
    precision: str,
    gradient_checkpointing: bool,
    teacher_params: int,
    budget_gib: float,
) -> list[str]:
    """Flag changes that make a plan fit, cheapest first (each checked with `plan_memory`)."""
    options = [
        ("--training.gradient_checkpointing true", dict(gradient_checkpointing=True)),
        ("--training.precision bf16", dict(precision="bf16")),
        ("--parallel.mode fsdp2", dict(mode="fsdp2")),
        (
            "--parallel.mode fsdp2 --training.precision bf16 --training.gradient_checkpointing true",
            dict(mode="fsdp2", precision="bf16", gradient_checkpointing=True),
        ),
    ]
    base = dict(mode=mode, world_size=world_size, precision=precision, gradient_checkpointing=gradient_checkpointing)
    found = []
    for flags, change in options:
        if all(base[key] == value for key, value in change.items()):
            continue
        plan = plan_memory(counts, shape, **{**base, **change}, teacher_params=teacher_params, budget_gib=budget_gib)
        if plan.fits:
            found.append(f"{flags} (about {plan.total_gib:.1f} GiB)")
    return found

"""The time estimate of a run: the matmul and attention FLOPs of a step over a GPU's dense bf16 peak
at an assumed utilisation. A planning figure, never a measurement; `trainer.planning.memory.plan_training`
prints it beside the memory plan. `ParamCounts` and `RunShape`, what the time and the memory
estimates read, are defined here (`trainer.planning.memory` builds them from a model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ASSUMED_UTILISATION",
    "GPUS",
    "GpuSpec",
    "ParamCounts",
    "RunShape",
    "TimeEstimate",
    "estimate_time",
    "find_gpu",
    "step_flops",
    "transfer_step_flops",
]


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameter counts of the converted model by role, and of one transformer block at most."""

    trained: int
    frozen: int
    buffers: int
    largest_block: int


@dataclass(frozen=True, slots=True)
class RunShape:
    """What activations and FLOPs depend on: batch per rank, tokens, the model's width and depth, and
    how many attention modules of each kind stay softmax (their cost grows with tokens squared).

    Activations follow `batch_per_rank`, the samples of one forward and backward (a micro-batch); a step's
    FLOPs follow its `accumulate` micro-batches."""

    batch_per_rank: int
    image_tokens: int
    text_tokens: int
    hidden: int
    depth: int
    image_only_blocks: int = 0
    softmax_joint: int = 0
    softmax_image_only: int = 0
    accumulate: int = 1


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU the time estimate knows.

    Parameters:
        name (`str`): how the estimate names it ("RTX 4090").
        memory_gib (`float`): memory as torch reports it (`total_memory`, GiB).
        bf16_tflops (`float`): dense bf16 tensor-core peak with fp32 accumulation (no sparsity).
        device_names (`tuple[str, ...]`): what `torch.cuda.get_device_name` and nvidia-smi report for it.
    """

    name: str
    memory_gib: float
    bf16_tflops: float
    device_names: tuple[str, ...]


# bf16_tflops: NVIDIA's datasheets and architecture whitepapers, dense (half the "with sparsity"
# figure), fp32 accumulation: GeForce cards run it at half their fp16-accumulate rate (RTX 3090 71,
# Ampere GA102 whitepaper; RTX 4090 165, Ada whitepaper; RTX 5090 209.5, RTX Blackwell whitepaper),
# RTX A6000 154.8 (GA102 whitepaper), L40S 362 (datasheet: 733 with sparsity), A100 312, H100 SXM
# 989, H100 PCIe 756, H20 148, H200 989 (datasheets). memory_gib: `total_memory` as PyTorch reports
# it (its out-of-memory messages), a little under the nominal size. Without a device name the first
# card with at least the budget stands in, so cards are appended: the first five keep that order.
GPUS = (
    GpuSpec(name="RTX 4090", memory_gib=23.6, bf16_tflops=165.0, device_names=("NVIDIA GeForce RTX 4090",)),
    GpuSpec(name="H100 80GB", memory_gib=79.1, bf16_tflops=989.0, device_names=("NVIDIA H100 80GB HBM3",)),
    GpuSpec(
        name="A100 80GB",
        memory_gib=79.1,
        bf16_tflops=312.0,
        device_names=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
    ),
    GpuSpec(name="H20", memory_gib=94.0, bf16_tflops=148.0, device_names=("NVIDIA H20",)),
    GpuSpec(name="H200", memory_gib=139.8, bf16_tflops=989.0, device_names=("NVIDIA H200",)),
    GpuSpec(name="RTX 3090", memory_gib=23.7, bf16_tflops=71.0, device_names=("NVIDIA GeForce RTX 3090",)),
    GpuSpec(name="RTX 5090", memory_gib=31.4, bf16_tflops=209.5, device_names=("NVIDIA GeForce RTX 5090",)),
    GpuSpec(name="RTX A6000", memory_gib=47.5, bf16_tflops=154.8, device_names=("NVIDIA RTX A6000",)),
    GpuSpec(name="L40S", memory_gib=44.4, bf16_tflops=362.0, device_names=("NVIDIA L40S",)),
    GpuSpec(
        name="A100 40GB",
        memory_gib=39.4,
        bf16_tflops=312.0,
        device_names=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
    ),
    GpuSpec(name="H100 PCIe", memory_gib=79.1, bf16_tflops=756.0, device_names=("NVIDIA H100 PCIe",)),
)
ASSUMED_UTILISATION = 0.35
"""Fraction of the bf16 peak a fine-tune reaches (an assumption for the estimate, not a measurement)."""
_VENDOR_WORDS = frozenset({"nvidia", "geforce", "tesla"})
"""Words older drivers leave out or add ("GeForce RTX 3090", "Tesla ..."): not part of the model."""


def _model(device_name: str) -> str:
    """The model a device name names, in one spelling: lower case, without vendor words, with hyphens,
    underscores and spaces alike ("NVIDIA A100-SXM4-80GB" -> "a100 sxm4 80gb")."""
    words = re.split(r"[\s_-]+", device_name.strip().lower())
    return " ".join(word for word in words if word and word not in _VENDOR_WORDS)


def find_gpu(device_name: str | None, budget_gib: float | None) -> GpuSpec | None:
    """The `GPUS` entry of the card `device_name` names, else the first with at least `budget_gib`.

    The whole model is compared, so an RTX 3090 is never taken for an RTX 4090, nor an H200 for an
    H20, and a card not in `GPUS` gives None (no estimate rather than another card's).

    Args:
        device_name (`str`, *optional*): as `torch.cuda.get_device_name` reports it; None when there
            is no GPU to name (planning with `--parallel.gpu_memory_gib` on another machine).
        budget_gib (`float`, *optional*): memory per GPU, used only without a device name.

    Returns:
        The card, or None when the named card is unknown or no card has the budget.
    """
    if device_name:
        model = _model(device_name)
        return next((gpu for gpu in GPUS if model in map(_model, gpu.device_names)), None)
    if budget_gib is None:
        return None
    return next((gpu for gpu in GPUS if gpu.memory_gib >= budget_gib), None)


def step_flops(shape: RunShape, *, trained_fraction: float, gradient_checkpointing: bool) -> float:
    """Estimated FLOPs of one training step on one rank.

    Per token, a joint block's image and text streams each run 12 hidden^2 weights (q, k, v, output,
    4x MLP) and an image-only block 4 more on image tokens; each softmax module adds 4 * tokens^2 *
    hidden. Backward computes input gradients everywhere (one more forward) and weight gradients for the
    trained fraction; softmax attention's backward is twice its forward; checkpointing adds a forward.
    T5 modules cost linear time like the projections, small beside them, and are left out. A step runs all
    its micro-batches.
    """
    h, b = shape.hidden, shape.batch_per_rank * shape.accumulate
    tokens = shape.image_tokens + shape.text_tokens
    linear = 2 * b * h * h * (12 * shape.depth * tokens + 4 * shape.image_only_blocks * shape.image_tokens)
    attention = 4 * b * h * (shape.softmax_joint * tokens**2 + shape.softmax_image_only * shape.image_tokens**2)
    recompute = 1 if gradient_checkpointing else 0
    return linear * (2 + trained_fraction + recompute) + attention * (3 + recompute)


def transfer_step_flops(shape: RunShape) -> float:
    """Estimated FLOPs of one attention-transfer step on one rank (`trainer.transfer`).

    The softmax model's forward, every attention module softmax; then each converted module runs its own
    q, k, v and output projections again (4 hidden^2 weights per token of each stream) and backpropagates
    through the output projection to its T5 parameters (one more hidden^2). T5 itself is left out, as in
    `step_flops`; a step runs all its micro-batches.
    """
    h, b = shape.hidden, shape.batch_per_rank * shape.accumulate
    tokens = shape.image_tokens + shape.text_tokens
    forward = 2 * b * h * h * (12 * shape.depth * tokens + 4 * shape.image_only_blocks * shape.image_tokens)
    softmax = 4 * b * h * (shape.depth * tokens**2 + shape.image_only_blocks * shape.image_tokens**2)
    converted_joint = shape.depth - shape.softmax_joint
    converted_image = shape.image_only_blocks - shape.softmax_image_only
    projections = 2 * b * h * h * 5 * (converted_joint * tokens + converted_image * shape.image_tokens)
    return forward + softmax + projections


@dataclass(frozen=True, slots=True)
class TimeEstimate:
    """An estimated run time: FLOPs per step on one rank over an assumed share of a GPU's peak, for the
    fine-tune's steps and the attention transfer's before them."""

    gpu: GpuSpec
    flops_per_step: float
    steps: int
    max_minutes: float = 0.0
    transfer_steps: int = 0
    transfer_flops_per_step: float = 0.0

    def _seconds(self, flops: float) -> float:
        return flops / (self.gpu.bf16_tflops * 1e12 * ASSUMED_UTILISATION)

    @property
    def seconds_per_step(self) -> float:
        return self._seconds(self.flops_per_step)

    @property
    def transfer_hours(self) -> float:
        return self.transfer_steps * self._seconds(self.transfer_flops_per_step) / 3600

    @property
    def capped(self) -> bool:
        """Whether `--training.max_minutes` ends the fine-tune before its last step."""
        return bool(self.max_minutes) and self.steps * self.seconds_per_step > self.max_minutes * 60

    @property
    def hours(self) -> float:
        """The whole run: the transfer, then the fine-tune (whose time `--training.max_minutes` caps)."""
        fine_tune = self.max_minutes / 60 if self.capped else self.steps * self.seconds_per_step / 3600
        return self.transfer_hours + fine_tune

    def summary(self) -> str:
        capped = " (stopped by --training.max_minutes)" if self.capped else ""
        transfer = (
            f"{self.transfer_steps} transfer steps x {self._seconds(self.transfer_flops_per_step):.2f} s, then "
            if self.transfer_steps
            else ""
        )
        return (
            f"estimated time {self.hours:.1f} h{capped}: {transfer}{self.steps} steps x {self.seconds_per_step:.2f} s "
            f"({self.flops_per_step / 1e12:.1f} TFLOP per step per GPU on an {self.gpu.name}, "
            f"{self.gpu.bf16_tflops:g} TFLOPS bf16 at an assumed {ASSUMED_UTILISATION:.0%} utilisation; an estimate)"
        )


def estimate_time(
    counts: ParamCounts,
    shape: RunShape,
    *,
    gpu: GpuSpec,
    gradient_checkpointing: bool,
    steps: int,
    max_minutes: float,
    transfer_steps: int = 0,
) -> TimeEstimate:
    """The `TimeEstimate` of `transfer_steps` attention-transfer steps, then `steps` optimizer steps (the
    latter stopping early at `max_minutes` when it is set)."""
    fraction = counts.trained / max(counts.trained + counts.frozen, 1)
    flops = step_flops(shape, trained_fraction=fraction, gradient_checkpointing=gradient_checkpointing)
    return TimeEstimate(gpu, flops, steps, max_minutes, transfer_steps, transfer_step_flops(shape))

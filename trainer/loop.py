"""The training loop: one step of the recipe, and the loop that stops on steps or the time budget.

Noise, sigmas and caption dropout of step s are drawn for the whole global batch from the stream
`derived_seed(seed, "noise", s)` and each rank keeps its rows, so a run gives the same numbers with
one process or N and after a resume. With `--training.accumulate` a rank runs its rows in equal
micro-batches and adds up their gradients before the one optimizer step, which changes only the order
of floating-point sums.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer.checkpoint import CheckpointManager, Start
from trainer.config import TrainConfig
from trainer.config_file import config_to_toml
from trainer.data import Batch, BatchPlan, Source
from trainer.distributed import World
from trainer.losses import AttentionCapture, sample_sigmas, step_losses
from trainer.metrics import MetricsWriter, Progress
from trainer.optim import finish_step
from trainer.parallelize import gradient_sync
from trainer.seeds import derived_seed

__all__ = ["BatchParts", "LoopResult", "TrainParts", "micro_batches", "train_loop", "train_step"]

logger = logging.getLogger(__name__)

SigmaSampler = Callable[..., Tensor]
"""`draw(count, generator=...)` -> `(count,)` sigmas."""


@dataclass
class TrainParts:
    """Everything the loop touches, built by `trainer.train`."""

    config: TrainConfig
    world: World
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    source: Source
    plan: BatchPlan
    checkpoints: CheckpointManager
    metrics: MetricsWriter
    teacher: nn.Module | None = None
    captures: tuple[AttentionCapture, AttentionCapture] | None = None
    """(student, teacher) attention outputs for `--loss.feature_weight`."""
    validate: Callable[[int], dict[str, float]] | None = None
    """Validation (`trainer.validation`): step -> its metrics, merged into that step's line; run at step 0 of a
    fresh start, every `--validation.every` steps and at the last step."""


@dataclass(frozen=True, slots=True)
class LoopResult:
    """How the loop ended: steps reached, why it stopped, and the last step's losses."""

    step: int
    stop_reason: str
    last: dict[str, float]
    seconds: float


class BatchParts(Protocol):
    """What drawing a step's batch reads (the fine-tune's `TrainParts` and the transfer's parts)."""

    config: TrainConfig
    world: World
    source: Source
    plan: BatchPlan


def _noise(
    parts: BatchParts, batch: Batch, step: int, *, stream: str, draw_sigmas: SigmaSampler
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's rows of the global batch's noise, sigmas and caption-dropout mask."""
    size = parts.plan.batch_size
    generator = torch.Generator().manual_seed(derived_seed(parts.config.training.seed, stream, step))
    noise = torch.randn((size, *batch.latents.shape[1:]), generator=generator)
    sigmas = draw_sigmas(size, generator=generator)
    dropped = torch.rand(size, generator=generator) < parts.config.data.caption_dropout
    rows = slice(parts.world.rank * len(batch), (parts.world.rank + 1) * len(batch))
    return noise[rows], sigmas[rows], dropped[rows]


def micro_batches(
    parts: BatchParts, step: int, *, stream: str = "noise", draw_sigmas: SigmaSampler | None = None
) -> Iterator[tuple[Batch, Tensor, Tensor]]:
    """This rank's rows of global batch `step` with their captions dropped, noise and sigmas, cut into
    `--training.accumulate` equal micro-batches in row order, each moved to the device when it is reached.

    Args:
        stream: the random stream of noise, sigmas and dropout (`derived_seed(seed, stream, step)`).
        draw_sigmas: draws `(count,)` sigmas from a generator; default: `--loss`'s logit-normal density.

    Yields:
        `(batch, noise, sigmas)` of each micro-batch, on the device.
    """
    if draw_sigmas is None:
        draw_sigmas = functools.partial(sample_sigmas, config=parts.config.loss)
    indices = parts.plan.local_indices(step, rank=parts.world.rank, world_size=parts.world.world_size)
    batch = parts.source.load(indices)
    noise, sigmas, dropped = _noise(parts, batch, step, stream=stream, draw_sigmas=draw_sigmas)
    if dropped.any():
        context, pooled = parts.source.uncond()
        batch = Batch(
            batch.latents,
            torch.where(dropped.view(-1, 1, 1), context.expand_as(batch.context), batch.context),
            torch.where(dropped.view(-1, 1), pooled.expand_as(batch.pooled), batch.pooled),
        )
    device = parts.world.device
    size = len(batch) // parts.config.training.accumulate
    for start in range(0, len(batch), size):
        rows = slice(start, start + size)
        micro = Batch(batch.latents[rows], batch.context[rows], batch.pooled[rows])
        yield micro.to(device), noise[rows].to(device), sigmas[rows].to(device)


def train_step(parts: TrainParts, step: int) -> dict[str, float]:
    """Run optimizer step `step` (0-based) over its micro-batches and return its metrics: the losses averaged
    over the global batch."""
    accumulate = parts.config.training.accumulate
    lrs = {f"lr/{group['name']}": group["lr"] for group in parts.optimizer.param_groups}
    means: dict[str, Tensor] = {}
    for index, (batch, noise, sigmas) in enumerate(micro_batches(parts, step)):
        with gradient_sync(parts.model, enabled=index == accumulate - 1):
            with parts.world.autocast(parts.config.training.autocast_dtype):
                losses = step_losses(
                    parts.model,
                    batch.latents,
                    noise=noise,
                    sigmas=sigmas,
                    context=batch.context,
                    pooled=batch.pooled,
                    config=parts.config.loss,
                    teacher=parts.teacher,
                    captures=parts.captures,
                )
            # Micro-batches are equal in size: their scaled gradients add up to the gradient of the rank's mean.
            (losses.total / accumulate).backward()
        for name, value in {"total": losses.total.detach(), **losses.terms}.items():
            means[name] = means.get(name, 0.0) + value.float() / accumulate
    grad_norm = finish_step(parts.optimizer, parts.scheduler, grad_clip=parts.config.optim.grad_clip)
    metrics = {f"loss/{name}": value for name, value in parts.world.mean_over_ranks(means).items()} | lrs
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics


def _out_of_time(parts: TrainParts, deadline: float | None) -> bool:
    """Rank 0's clock decides for everyone, so all ranks stop after the same step."""
    flag = torch.tensor([1 if deadline is not None and time.monotonic() >= deadline else 0], device=parts.world.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _validate(parts: TrainParts, step: int, *, last: bool) -> dict[str, float]:
    """`parts.validate(step)` every `--validation.every` steps and at the run's last step; {} otherwise."""
    every = parts.config.validation.every
    if parts.validate is None or not (last or (every and step % every == 0)):
        return {}
    return parts.validate(step)


def train_loop(parts: TrainParts, *, start: Start) -> LoopResult:
    """Train from `start` until `--training.steps`, or until the run's training time (this session's and
    the resumed checkpoint's) reaches `--training.max_minutes`; checkpoint on the way."""
    config = parts.config
    total = config.training.steps
    progress = Progress(total=total, initial=start.step, enabled=parts.world.is_main and config.output.progress)
    started = time.monotonic()
    budget = config.training.max_minutes * 60
    deadline = started + budget - start.seconds if budget else None
    run_state = {"world_size": parts.world.world_size, "config": config_to_toml(config)}
    step, reason, last = start.step, "steps", {}
    if budget and start.seconds >= budget:  # resumed only to export: the time was spent before
        return LoopResult(step, "time", last, 0.0)
    validated = _validate(parts, 0, last=True) if start.step == 0 else {}
    if validated:
        parts.metrics.write(0, validated)
    try:
        while step < total:
            tick = time.perf_counter()
            last = train_step(parts, step)
            step += 1
            seconds = time.perf_counter() - tick
            last["time/step(s)"] = seconds
            last["throughput(img/s)"] = config.training.batch_size / seconds
            if parts.world.device.type == "cuda":
                last["memory/max_reserved(GiB)"] = torch.cuda.max_memory_reserved(parts.world.device) / 1024**3
            stop = _out_of_time(parts, deadline)
            validated = _validate(parts, step, last=step == total or stop)
            last.update(validated)
            if validated or step % config.output.log_every == 0 or step == total or stop:
                parts.metrics.write(step, last)
            logger.debug("step %d: %s", step, last)
            progress.update(last["loss/total"])
            every = config.checkpoint.every
            if (every and step % every == 0) or step == total or stop:
                trained = start.seconds + time.monotonic() - started
                parts.checkpoints.save(step, state={**run_state, "trained_seconds": trained})
            if stop:
                reason = "time"
                logger.info(
                    "Stopping after step %d: the %.1f-minute budget is spent", step, config.training.max_minutes
                )
                break
    finally:
        progress.close()
    return LoopResult(step, reason, last, time.monotonic() - started)

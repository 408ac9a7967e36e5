"""Attention transfer: before the fine-tune, each converted module's T5 parameters learn to reproduce its
softmax output on the softmax model's own activations (`--transfer.*`, docs/training.md).

Until the fine-tune starts, the converted model's inherited weights are the base's, so running it with
its original processors (`T5Handle.softmax`) is the softmax teacher: no copy is needed. One such forward
per batch, without gradients, visits every converted module; a forward hook on each runs the module's
T5 attention on the same inputs and backpropagates the MSE to the softmax output into that module's T5
parameters alone, so memory is the softmax forward plus one module's T5 activations. The batch runs in
`--training.accumulate` micro-batches, whose scaled gradients add up; they are averaged over ranks by hand
(the modules are called outside DDP) before one AdamW step.

The stage checkpoints into `<output.dir>/checkpoints/transfer` and resumes from there as the fine-tune
does; its metrics lines in `metrics.jsonl` carry `"stage": "transfer"` and a loss per module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from t5core.hosts.diffusers import T5Handle
from t5core.hosts.diffusers_runtime import T5AttnProcessor
from t5core.sd3_keys import diffusers_module
from trainer.checkpoint import CheckpointManager, Resume, RunAlreadyFinished, Start, check_resume_config, read_state
from trainer.config import LossConfig, OptimConfig, ParallelConfig, TrainConfig, TransferConfig
from trainer.config_file import config_to_toml
from trainer.data import BatchPlan, Source
from trainer.distributed import World
from trainer.loop import micro_batches
from trainer.losses import add_noise, predict_velocity, sample_sigmas, shift_sigmas
from trainer.metrics import MetricsWriter, Progress
from trainer.optim import build_scheduler, finish_step

__all__ = [
    "STAGE",
    "TransferCapture",
    "TransferParts",
    "check_transfer_mode",
    "resume_transfer",
    "run_transfer",
    "transfer_sigmas",
]

logger = logging.getLogger(__name__)

STAGE = "transfer"
"""The `stage` of the transfer's lines in `metrics.jsonl`, and its checkpoints' subfolder."""


def transfer_sigmas(count: int, *, generator: torch.Generator, transfer: TransferConfig, loss: LossConfig) -> Tensor:
    """`(count,)` sigmas as `--transfer.timesteps` says: uniform across the schedule, or the fine-tune's density."""
    if transfer.timesteps == "logit_normal":
        return sample_sigmas(count, generator=generator, config=loss)
    return shift_sigmas(torch.rand(count, generator=generator), loss.shift)


def _joined(output: Tensor | tuple[Tensor | None, ...]) -> Tensor:
    """An attention module's output as one tensor: joint attention's image and text rows along tokens."""
    parts = output if isinstance(output, tuple) else (output,)
    return torch.cat([part for part in parts if part is not None], dim=1)


class TransferCapture:
    """Forward hooks on the converted attention modules that, while `recording`, train each module's T5
    attention against the softmax output the module just produced.

    Each hook runs the module's `T5AttnProcessor` on the module's inputs with gradients on, and adds the
    gradient of the MSE to the softmax output, times the recording's `scale`, to its T5 parameters' `.grad`;
    `losses` holds each module's MSE of the last forward.
    """

    def __init__(self, handle: T5Handle) -> None:
        processors = handle.model.attn_processors
        self.handle = handle
        self.losses: dict[str, Tensor] = {}
        self._grid: tuple[int, int] | None = None
        self._scale = 1.0
        self._hooks = []
        for name, t5 in handle.modules.items():
            module = handle.model.get_submodule(diffusers_module(name))
            processor = processors[diffusers_module(name) + ".processor"]
            hook = module.register_forward_hook(self._hook(name, processor, list(t5.parameters())), with_kwargs=True)
            self._hooks.append(hook)

    def _hook(self, name: str, processor: T5AttnProcessor, params: list[nn.Parameter]):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Tensor | tuple) -> None:
            if self._grid is None:
                return
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            with torch.enable_grad():
                student = processor(module, hidden, kwargs.get("encoder_hidden_states"), t5_grid=self._grid)
                loss = F.mse_loss(_joined(student).float(), _joined(output).float())
                grads = torch.autograd.grad(loss * self._scale, params, allow_unused=True)
            for param, grad in zip(params, grads, strict=True):
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad + grad
            self.losses[name] = loss.detach()

        return hook

    @contextlib.contextmanager
    def recording(self, grid: tuple[int, int], *, scale: float = 1.0) -> Iterator[dict[str, Tensor]]:
        """Train the modules on the next forwards (of latents with this token grid) inside; `scale` weighs their
        gradients (1 / micro-batches of a step, so the step's add up to the gradient of its mean)."""
        self.losses, self._grid, self._scale = {}, grid, scale
        try:
            yield self.losses
        finally:
            self._grid = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@dataclass
class TransferParts:
    """What the transfer loop touches, built by `trainer.train`."""

    config: TrainConfig
    world: World
    handle: T5Handle
    wrapped: nn.Module
    """The student as the fine-tune wraps it (what checkpoints save)."""
    source: Source
    plan: BatchPlan
    checkpoints: CheckpointManager
    metrics: MetricsWriter


def _optimizer(parts: TransferParts) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    config = parts.config
    params = list(parts.handle.t5_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": params, "name": "new", "lr": config.transfer.lr}],
        lr=config.transfer.lr,
        betas=(config.optim.beta1, config.optim.beta2),
        eps=config.optim.eps,
        weight_decay=0.0,
        foreach=True,
    )
    schedule = OptimConfig(lr=config.transfer.lr, warmup_steps=config.transfer.warmup_steps, schedule="cosine")
    return optimizer, build_scheduler(optimizer, schedule, steps=config.transfer.steps)


def _reduce_grads(params: list[nn.Parameter], world: World) -> None:
    """Average the gradients over ranks in one collective (the hooks call the modules outside DDP)."""
    if world.world_size == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world.world_size
    for param, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        param.grad = chunk.view_as(param)


def transfer_step(
    parts: TransferParts,
    capture: TransferCapture,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
) -> dict[str, float]:
    """Run transfer step `step` (0-based) over its micro-batches; returns its metrics, averaged over the global
    batch."""
    sampler = functools.partial(transfer_sigmas, transfer=parts.config.transfer, loss=parts.config.loss)
    accumulate = parts.config.training.accumulate
    patch = parts.handle.model.config.patch_size
    dtype = parts.config.training.autocast_dtype
    means: dict[str, Tensor] = {}
    for batch, noise, sigmas in micro_batches(parts, step, stream=STAGE, draw_sigmas=sampler):
        x_t = add_noise(batch.latents, noise, sigmas)
        grid = (x_t.shape[-2] // patch, x_t.shape[-1] // patch)
        recording = capture.recording(grid, scale=1 / accumulate)
        with torch.no_grad(), parts.handle.softmax(), recording as losses, parts.world.autocast(dtype):
            predict_velocity(parts.handle.model, x_t, sigmas, context=batch.context, pooled=batch.pooled)
        for name, loss in losses.items():
            means[name] = means.get(name, 0.0) + loss / accumulate
    _reduce_grads(list(parts.handle.t5_parameters()), parts.world)
    lr = optimizer.param_groups[0]["lr"]
    grad_norm = finish_step(optimizer, scheduler, grad_clip=parts.config.optim.grad_clip)
    losses = parts.world.mean_over_ranks(means)
    metrics = {"transfer/loss": sum(losses.values()) / len(losses), "lr/transfer": lr}
    metrics |= {f"transfer/{name}": value for name, value in losses.items()}
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics


def resume_transfer(config: TrainConfig, checkpoints: CheckpointManager, weights: Path) -> Resume | None:
    """The transfer checkpoint to continue from (None: start the transfer fresh), for a run whose fine-tune
    has no checkpoint to resume; checked as `trainer.checkpoint.resume_path` checks the fine-tune's.

    Raises:
        RunAlreadyFinished: `auto`, a transfer-only run (`--training.steps 0`) whose transfer is complete and
            whose weights file exists.
        ValueError: a checkpoint past `--transfer.steps`, or trained with other settings.
        FileExistsError: `never`, and the folder holds an earlier run's transfer checkpoints.
    """
    mode, steps = config.checkpoint.resume, checkpoints.steps()
    if mode not in ("auto", "never") or not steps or not config.transfer.steps:
        return None
    if mode == "never":
        raise FileExistsError(
            f"{checkpoints.folder} holds attention-transfer checkpoints of an earlier run (steps {steps}). Pass "
            "--checkpoint.resume auto to continue it, force to train again from the start, or choose another "
            "--output.dir."
        )
    if steps[-1] > config.transfer.steps:
        raise ValueError(
            f"{checkpoints.folder} holds a transfer checkpoint at step {steps[-1]}, past --transfer.steps "
            f"{config.transfer.steps}; nothing was changed. Raise --transfer.steps to at least that, pass "
            "--checkpoint.resume force to train again from the start, or choose another --output.dir."
        )
    if config.training.steps == 0 and steps[-1] == config.transfer.steps and weights.is_file():
        raise RunAlreadyFinished(
            f"{checkpoints.folder.parent.parent} holds a finished transfer-only run (transfer step {steps[-1]} of "
            f"{config.transfer.steps}); nothing was changed. To train again from the start pass --checkpoint.resume "
            "force, or choose another --output.dir."
        )
    chosen = Resume(checkpoints.latest(), read_state(checkpoints.latest()))
    check_resume_config(chosen.state["config"], config)
    return chosen


def check_transfer_mode(transfer: TransferConfig, parallel: ParallelConfig, resume: Resume | None) -> None:
    """Refuse, before anything loads, a transfer that still has steps to run under FSDP2: it trains each
    converted module on its own, outside the block shards FSDP2 gathers. A complete transfer checkpoint
    (from a DDP run in the same folder) is fine: the FSDP2 fine-tune starts from it."""
    done = resume.state["step"] if resume is not None else 0
    if parallel.mode == "fsdp2" and done < transfer.steps:
        raise ValueError(
            f"--transfer.steps: {transfer.steps - done} attention-transfer steps are left to run, and the "
            "transfer does not run under --parallel.mode fsdp2. Run it first with --parallel.mode ddp "
            "--training.steps 0 in the same --output.dir (one process or several), then run this command again: "
            "the FSDP2 fine-tune starts from the finished transfer."
        )


def run_transfer(parts: TransferParts, *, resume: Resume | None) -> int:
    """Run the transfer from `resume` (or from its start) to `--transfer.steps`, checkpointing on the way;
    returns the steps done. A complete transfer checkpoint only restores the T5 parameters it holds."""
    config, world = parts.config, parts.world
    total = config.transfer.steps
    optimizer, scheduler = _optimizer(parts)
    parts.checkpoints.track(parts.wrapped, optimizer, scheduler)
    start = Start() if resume is None else parts.checkpoints.load(resume.path, state=resume.state)
    parts.metrics.resume_at(start.step, stage=STAGE)
    if start.step == total:
        logger.info("Transfer: complete at step %d (from %s)", total, resume.path)
        return total
    capture = TransferCapture(parts.handle)
    progress = Progress(total=total, initial=start.step, enabled=world.is_main and config.output.progress)
    run_state = {"world_size": world.world_size, "config": config_to_toml(config), "stage": STAGE}
    started = time.monotonic()
    logger.info(
        "Transfer: %d modules, steps %d-%d, lr %.3g", len(parts.handle.modules), start.step, total, config.transfer.lr
    )
    try:
        for step in range(start.step, total):
            tick = time.perf_counter()
            last = transfer_step(parts, capture, optimizer, scheduler, step)
            last["time/step(s)"] = time.perf_counter() - tick
            done = step + 1
            if done % config.output.log_every == 0 or done == total:
                parts.metrics.write(done, last, stage=STAGE)
            progress.update(last["transfer/loss"])
            every = config.checkpoint.every
            if (every and done % every == 0) or done == total:
                seconds = start.seconds + time.monotonic() - started
                parts.checkpoints.save(done, state={**run_state, "trained_seconds": seconds})
    finally:
        progress.close()
        capture.remove()
    return total

"""AdamW with one parameter group per role (new T5 parameters, trained inherited weights), the LR schedule
and the optimizer step."""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from trainer.config import OptimConfig
from trainer.model import ParamSplit

__all__ = ["build_optimizer", "build_scheduler", "finish_step", "optimizer_step", "strip_wrapper_prefix"]

logger = logging.getLogger(__name__)

_DDP_PREFIX = "module."


def strip_wrapper_prefix(name: str) -> str:
    """A parameter name of the wrapped model as the unwrapped model names it."""
    return name.removeprefix(_DDP_PREFIX)


def build_optimizer(model: nn.Module, split: ParamSplit, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `model` (wrapped or not), grouped by role.

    Group `new` runs at `lr * new_lr_mult`, group `inherited` at `lr * inherited_lr_mult`; each group
    records its `name`. Groups without parameters are left out.
    """
    roles = {name: "new" for name in split.new} | {name: "inherited" for name in split.inherited}
    grouped: dict[str, list[nn.Parameter]] = {"new": [], "inherited": []}
    for name, param in model.named_parameters():
        role = roles.get(strip_wrapper_prefix(name))
        if role is not None and param.requires_grad:
            grouped[role].append(param)
    multipliers = {"new": config.new_lr_mult, "inherited": config.inherited_lr_mult}
    groups = [
        {"params": params, "name": role, "lr": config.lr * multipliers[role]}
        for role, params in grouped.items()
        if params
    ]
    optimizer = torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=True,
    )
    logger.info(
        "Optimizer: AdamW, %s",
        ", ".join(f"{g['name']} lr {g['lr']:.3g} ({sum(p.numel() for p in g['params']) / 1e6:.2f}M)" for g in groups),
    )
    return optimizer


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, *, steps: int) -> LambdaLR:
    """Linear warm-up over `warmup_steps`, then constant, or cosine decay to `min_lr_ratio` at `steps`."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "cosine":
            progress = (step - config.warmup_steps) / max(steps - config.warmup_steps, 1)
            cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
            return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine
        return 1.0

    return LambdaLR(optimizer, factor)


def optimizer_step(
    loss: Tensor, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, *, grad_clip: float
) -> Tensor | None:
    """Backpropagate `loss`, then `finish_step`: a step on one batch. Returns the norm before clipping (None
    without)."""
    loss.backward()
    return finish_step(optimizer, scheduler, grad_clip=grad_clip)


def finish_step(optimizer: torch.optim.Optimizer, scheduler: LRScheduler, *, grad_clip: float) -> Tensor | None:
    """Once the gradients of a step are in `.grad` (one backward or several micro-batches'): clip the optimizer's
    global gradient norm to `grad_clip` (0 = no clipping), step the optimizer and the schedule, clear the
    gradients.

    Returns:
        The gradient norm before clipping; None without clipping.
    """
    grad_norm = None
    if grad_clip > 0:
        trainable = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm

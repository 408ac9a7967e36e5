"""Wrap the model for the run: activation checkpointing, then DDP or FSDP2 (torch's own stack).

Each `apply_*` does one thing and logs "Applied ..." once; `parallelize` places the models on the device
and applies them as the config says. Checkpointing goes first, so DDP and FSDP2 wrap the checkpointed
blocks. One process is a world of one and takes the same path. `gradient_sync` holds back the reduction of
a step's gradients over ranks until its last micro-batch (`--training.accumulate`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ParallelConfig, TrainingConfig
from trainer.distributed import World

__all__ = [
    "apply_activation_checkpointing",
    "apply_ddp",
    "apply_fsdp",
    "gradient_sync",
    "parallelize",
    "store_frozen_in",
]

logger = logging.getLogger(__name__)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (diffusers' non-reentrant per-block checkpoint)."""
    model.enable_gradient_checkpointing()
    logger.info("Applied activation checkpointing to %d transformer blocks", len(model.transformer_blocks))


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep frozen parameters in `dtype` (bf16 halves their memory; autocast computes in bf16 anyway)."""
    count = 0
    for param in model.parameters():
        if not param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
            count += param.numel()
    if count:
        logger.info("Applied %s storage to %.2fM frozen parameters", str(dtype).removeprefix("torch."), count / 1e6)


def apply_ddp(model: nn.Module, world: World) -> DistributedDataParallel:
    """Replicate the model on every rank and all-reduce gradients (mean over ranks)."""
    wrapped = DistributedDataParallel(
        model,
        device_ids=[world.device.index] if world.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    logger.info("Applied DDP over %d process(es)", world.world_size)
    return wrapped


def apply_fsdp(model: nn.Module, *, param_dtype: torch.dtype | None, name: str = "model") -> nn.Module:
    """Shard each transformer block, then the root, with FSDP2's `fully_shard`, which moves each one's weights
    to the device as it shards them.

    Args:
        model: a diffusers SD3 transformer (student or frozen teacher).
        param_dtype: dtype of the gathered parameters for compute (bf16 under bf16 precision), or
            None to compute in the stored dtype. Gradients are always reduced in fp32.
        name: for the log line.
    """
    # Imported here: FSDP2 is public from torch 2.6, and the library's tests import this package on 2.4
    # (the trainer itself refuses a torch older than trainer.distributed.MIN_TORCH).
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.transformer_blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    dtype = "stored dtype" if param_dtype is None else str(param_dtype).removeprefix("torch.")
    logger.info(
        "Applied FSDP2 to the %s: %d blocks + root, params in %s, fp32 reduce",
        name,
        len(model.transformer_blocks),
        dtype,
    )
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Run one micro-batch's forward and backward inside: its gradients are reduced over ranks only when
    `enabled` (the step's last micro-batch); otherwise they add up on each rank until then.

    Args:
        model: the student as `parallelize` wrapped it (DDP: `no_sync`; FSDP2: `set_requires_gradient_sync`);
            an unwrapped model has nothing to sync.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield


def parallelize(
    student: nn.Module, teacher: nn.Module | None, *, training: TrainingConfig, parallel: ParallelConfig, world: World
) -> nn.Module:
    """Put the student (training mode) and the teacher on the device, wrapped as `--training` and `--parallel` say
    (checkpointing, then DDP or FSDP2); returns the wrapped student.

    Frozen weights never reach the device in fp32 when they will not stay so: DDP under bf16 casts them on the
    host before the move, and FSDP2 moves each block to the device as it shards it.
    """
    student.train()
    if training.gradient_checkpointing:
        apply_activation_checkpointing(student)
    bf16 = training.autocast_dtype
    if parallel.mode == "ddp":
        if bf16 is not None:
            store_frozen_in(student, bf16)
        student.to(world.device)
        if teacher is not None:
            teacher.to(world.device)
        return apply_ddp(student, world)
    model = apply_fsdp(student, param_dtype=bf16)
    if teacher is not None:
        apply_fsdp(teacher, param_dtype=bf16, name="teacher")
    return model

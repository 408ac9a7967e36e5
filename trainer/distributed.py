"""Process-group setup shared by one process and N: ranks, device, teardown (seeds: `trainer.seeds`).

Under `torchrun` the world comes from its environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`). A plain `python trainer/run.py` becomes a world of one with an
in-memory store, so DDP, FSDP2 and the collectives run the same code path in both cases.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.config import ParallelConfig

__all__ = ["MIN_TORCH", "World", "init_world"]

logger = logging.getLogger(__name__)

MIN_TORCH = "2.11"
"""The oldest torch the trainer runs on (pyproject's `train` extra; the library alone runs on 2.4)."""


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the run.

    Attributes:
        rank, world_size: as torchrun sets them (0, 1 for a single process).
        device: the device this rank trains on.
        owns_group: whether this run created the process group (and so destroys it).
    """

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def mean_over_ranks(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Each scalar's mean over the ranks (collective: one all-reduce for all of them)."""
        stacked = torch.stack(list(values.values()))
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return dict(zip(values, (stacked / self.world_size).tolist(), strict=True))

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
        """Autocast to `dtype` on this rank's device (`--training.precision`); None runs in full precision."""
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Destroy the process group if this run created it (safe to call twice)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _pick_device(config: ParallelConfig, local_rank: int) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "--parallel.device cuda was requested but CUDA is not available; use --parallel.device cpu."
            )
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}. "
                "Start no more processes per node than GPUs (torchrun --nproc_per_node)."
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_world(config: ParallelConfig) -> World:
    """Join (or create) the process group and pick this rank's device.

    Raises:
        RuntimeError: torch older than `MIN_TORCH`, CUDA requested but absent, more local ranks than GPUs,
            or nccl without CUDA.
    """
    if torch.__version__ < MIN_TORCH:
        raise RuntimeError(
            f"the trainer needs torch >= {MIN_TORCH} (the oldest it is tested on: on 2.8 FSDP2 over gloo trains "
            f"to other weights than one process, on 2.6 a DDP resume fails in torch's state-dict load); this is "
            f"torch {torch.__version__}. "
            f"Upgrade torch: pip install 'torch>={MIN_TORCH}' (the library alone runs on torch >= 2.4)."
        )
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(config, local_rank)
    backend = config.backend if config.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeError("--parallel.backend nccl needs CUDA devices; use gloo on CPU.")
    owns_group = not dist.is_initialized()
    if owns_group:
        if env_world > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = World(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, owns_group=owns_group)
    logger.info("Distributed: rank %d of %d on %s (%s)", world.rank, world.world_size, device, dist.get_backend())
    return world

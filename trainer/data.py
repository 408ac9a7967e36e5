"""Training samples: pluggable sources and the deterministic plan of global batches.

A source holds samples addressed by index and grouped into buckets of equal latent size. The plan
turns (seed, step) into the indices of one global batch, all from one bucket; each rank takes its
contiguous slice. So N processes see exactly the batch one process would, and the data position is
just the step number (resume is exact). Sources: a model preset's own (`trainer.presets`, such as the
toy's `sd3_testbed.preset.ToySource`, made on the fly) and `CacheSource` (`trainer.inputs.cache`, written by
`trainer.inputs.prepare`). The buckets' pixel sizes come from `--data.buckets` (`bucket_sizes`, `nearest_bucket`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from trainer.seeds import derived_seed

__all__ = ["Batch", "BatchPlan", "Source", "bucket_sizes", "nearest_bucket"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Batch:
    """Model inputs of B samples: `latents (B, C, h, w)`, `context (B, T, J)`, `pooled (B, P)`."""

    latents: Tensor
    context: Tensor
    pooled: Tensor

    def to(self, device: torch.device) -> Batch:
        """This batch on `device`, in float32."""
        return Batch(*(t.to(device=device, dtype=torch.float32) for t in (self.latents, self.context, self.pooled)))

    def __len__(self) -> int:
        return self.latents.shape[0]


class Source(Protocol):
    """Samples by index. `buckets` maps a latent size `(h, w)` to the indices of that size."""

    def buckets(self) -> dict[tuple[int, int], list[int]]: ...

    def load(self, indices: list[int]) -> Batch: ...

    def uncond(self) -> tuple[Tensor, Tensor]:
        """The empty caption's `(context (T, J), pooled (P,))`, for caption dropout."""
        ...


class BatchPlan:
    """Which samples form global batch `step`: a pure function of (seed, step).

    Every epoch shuffles each bucket, cuts it into full global batches (a remainder smaller than a
    batch waits for the next epoch's shuffle) and shuffles the batch order across buckets. Samples in
    `exclude` (held out for validation) are never drawn.

    Raises:
        ValueError: no bucket holds a full global batch (says how many samples each bucket has).
    """

    def __init__(
        self,
        buckets: dict[tuple[int, int], list[int]],
        *,
        batch_size: int,
        seed: int,
        exclude: Collection[int] = (),
    ) -> None:
        left_out = set(exclude)
        kept = {key: [index for index in value if index not in left_out] for key, value in sorted(buckets.items())}
        self.buckets = {key: value for key, value in kept.items() if value}
        self.batch_size, self.seed = batch_size, seed
        self._cached: tuple[int, list[list[int]]] | None = None
        self.batches_per_epoch = sum(len(v) // batch_size for v in self.buckets.values())
        if self.batches_per_epoch == 0:
            sizes = ", ".join(f"{h}x{w}: {len(v)}" for (h, w), v in self.buckets.items()) or "none"
            raise ValueError(
                f"no aspect bucket holds a full global batch of {batch_size} samples (samples per latent "
                f"bucket: {sizes}). Add data or lower --training.batch_size."
            )

    def _epoch(self, epoch: int) -> list[list[int]]:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        generator = torch.Generator().manual_seed(derived_seed(self.seed, "data", epoch))
        batches: list[list[int]] = []
        for indices in self.buckets.values():
            order = torch.randperm(len(indices), generator=generator).tolist()
            full = len(order) - len(order) % self.batch_size
            batches += [[indices[i] for i in order[j : j + self.batch_size]] for j in range(0, full, self.batch_size)]
        order = torch.randperm(len(batches), generator=generator).tolist()
        self._cached = (epoch, [batches[i] for i in order])
        return self._cached[1]

    def global_indices(self, step: int) -> list[int]:
        """The sample indices of global batch `step` (0-based)."""
        epoch, position = divmod(step, self.batches_per_epoch)
        return self._epoch(epoch)[position]

    def local_indices(self, step: int, *, rank: int, world_size: int) -> list[int]:
        """This rank's contiguous slice of global batch `step`."""
        per_rank = self.batch_size // world_size
        return self.global_indices(step)[rank * per_rank : (rank + 1) * per_rank]


def bucket_sizes(spec: str, resolution: int, multiple: int) -> list[tuple[int, int]]:
    """Pixel `(width, height)` of each `w:h` bucket: about `resolution**2` pixels, sides a multiple of `multiple`.

    Raises:
        ValueError: a malformed bucket (names it and the expected form).
    """
    sizes = []
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        w_text, sep, h_text = item.partition(":")
        try:
            ratio = float(w_text) / float(h_text)
        except (ValueError, ZeroDivisionError):
            ratio = 0.0
        if not sep or not 0 < ratio < math.inf:
            raise ValueError(f"--data.buckets: {item!r} is not a ratio like 4:3.")
        width = max(multiple, round(resolution * math.sqrt(ratio) / multiple) * multiple)
        height = max(multiple, round(resolution / math.sqrt(ratio) / multiple) * multiple)
        if (width, height) not in sizes:
            sizes.append((width, height))
    if not sizes:
        raise ValueError("--data.buckets is empty; give ratios like 1:1,4:3,3:4.")
    return sizes


def nearest_bucket(width: int, height: int, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to `width / height` (in log space)."""
    aspect = math.log(width / height)
    return min(sizes, key=lambda size: abs(math.log(size[0] / size[1]) - aspect))

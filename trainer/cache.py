"""The prepared-data cache: sharded safetensors written once, read by `CacheSource`.

A cache folder holds `shard-{i:05d}.safetensors` files, each of one latent size (aspect bucket) with
`latents (n, C, h, w)`, `context (n, T, J)` and `pooled (n, P)`; `uncond.safetensors` with the empty
caption's conditioning (for caption dropout); and `manifest.json`, written last, listing the shards
and what was skipped. Every file is written to a temp name and renamed, so an interrupted
preparation resumes shard by shard and a folder without a manifest is never read as complete.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from t5core.atomic import write_atomic, write_text_atomic
from trainer.data import Batch

__all__ = ["CACHE_FORMAT", "MANIFEST", "CacheSource", "shard_name", "write_manifest", "write_tensors"]

logger = logging.getLogger(__name__)

CACHE_FORMAT = "t5-trainer-cache/1"
MANIFEST = "manifest.json"
UNCOND = "uncond.safetensors"
_OPEN_SHARDS = 4
"""Shards kept in memory by a reader (a global batch comes from one bucket, so one is usually enough)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_tensors(path: Path, batch: Batch, *, metadata: dict[str, str] | None = None) -> None:
    """Write one shard (or the uncond file) atomically."""
    tensors = {"latents": batch.latents, "context": batch.context, "pooled": batch.pooled}
    contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    write_atomic(path, lambda temp: save_file(contiguous, temp, metadata=metadata))


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Write `manifest.json` atomically: the mark that the cache is complete."""
    return write_text_atomic(folder / MANIFEST, json.dumps({"format": CACHE_FORMAT, **manifest}, indent=1))


class CacheSource:
    """A prepared cache folder: `manifest.json` plus safetensors shards of one bucket each.

    Each shard holds `latents (n, C, h, w)`, `context (n, T, J)` and `pooled (n, P)`; the manifest
    lists the shards, their bucket and sample count, and the empty caption's conditioning file.

    Raises:
        FileNotFoundError: no such folder, or no `manifest.json` (preparation never finished).
        ValueError: a manifest of another format, or a cache without samples.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        manifest_path = self.folder / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"{self.folder} is not a prepared data cache (no {MANIFEST}). Prepare it with "
                "--data.source images or prompts, or point --data.path at a finished cache."
            )
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if manifest.get("format") != CACHE_FORMAT:
            raise ValueError(f"{manifest_path}: format {manifest.get('format')!r}, expected {CACHE_FORMAT!r}.")
        self.manifest = manifest
        self._open: dict[str, dict[str, Tensor]] = {}
        self._shards: list[tuple[str, int]] = []
        self._buckets: dict[tuple[int, int], list[int]] = {}
        start = 0
        for shard in manifest["shards"]:
            bucket = (int(shard["latent_hw"][0]), int(shard["latent_hw"][1]))
            count = int(shard["count"])
            self._buckets.setdefault(bucket, []).extend(range(start, start + count))
            self._shards.append((shard["file"], start))
            start += count
        if start == 0:
            raise ValueError(
                f"{self.folder}: the cache holds no samples; every input was skipped (see its {MANIFEST})."
            )

    def buckets(self) -> dict[tuple[int, int], list[int]]:
        return self._buckets

    def _read(self, file: str) -> dict[str, Tensor]:
        """A shard's tensors; the last few shards read stay in memory (batches come from one bucket)."""
        if file not in self._open:
            if len(self._open) >= _OPEN_SHARDS:
                self._open.pop(next(iter(self._open)))
            with safe_open(str(self.folder / file), framework="pt") as handle:
                self._open[file] = {key: handle.get_tensor(key) for key in ("latents", "context", "pooled")}
        return self._open[file]

    def _locate(self, index: int) -> tuple[str, int]:
        for file, start in reversed(self._shards):
            if index >= start:
                return file, index - start
        raise IndexError(index)

    def load(self, indices: list[int]) -> Batch:
        rows = [self._locate(index) for index in indices]
        picked = {key: [] for key in ("latents", "context", "pooled")}
        for file, row in rows:
            tensors = self._read(file)
            for key in picked:
                picked[key].append(tensors[key][row])
        return Batch(*(torch.stack(picked[key]).float() for key in ("latents", "context", "pooled")))

    def uncond(self) -> tuple[Tensor, Tensor]:
        tensors = self._read(UNCOND)
        return tensors["context"][0].float(), tensors["pooled"][0].float()

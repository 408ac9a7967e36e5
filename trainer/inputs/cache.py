"""The prepared-data cache: sharded safetensors written once (`trainer.inputs.prepare`), read by `CacheSource`.

A cache folder holds `shard-{i:05d}.safetensors` files, each of one latent size (aspect bucket) with
`latents (n, C, h, w)`, `context (n, T, J)` and `pooled (n, P)` and metadata (`latent_hw`, `pixel_wh`,
`count`, `skipped`); `plan.json`, what the shards are planned to hold; `uncond.safetensors` with the
empty caption's conditioning (for caption dropout); and `manifest.json`, written last, listing the
shards and what was skipped. Every file is written to a temp name and renamed, so an interrupted
preparation resumes shard by shard and a folder without a manifest is never read as complete. This
module owns the format: the writers below and the reader are its only users.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from t5core.atomic import write_atomic, write_text_atomic
from trainer.data import Batch

if TYPE_CHECKING:
    from trainer.distributed import World

__all__ = [
    "CACHE_FORMAT",
    "MANIFEST",
    "PLAN",
    "UNCOND",
    "CacheSource",
    "check_finished",
    "check_plan",
    "finish_cache",
    "shard_name",
    "write_manifest",
    "write_shard",
    "write_tensors",
]

logger = logging.getLogger(__name__)

CACHE_FORMAT = "t5-trainer-cache/1"
MANIFEST = "manifest.json"
UNCOND = "uncond.safetensors"
PLAN = "plan.json"
_TENSORS = ("latents", "context", "pooled")
"""The tensors of a shard (and of the uncond file), in `Batch`'s field order."""
_OPEN_SHARDS = 4
"""Shards kept in memory by a reader (a global batch comes from one bucket, so one is usually enough)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_tensors(path: Path, batch: Batch, *, metadata: dict[str, str] | None = None) -> None:
    """Write one shard (or the uncond file) atomically."""
    contiguous = {key: getattr(batch, key).detach().to("cpu").contiguous() for key in _TENSORS}
    write_atomic(path, lambda temp: save_file(contiguous, temp, metadata=metadata))


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Write `manifest.json` atomically: the mark that the cache is complete."""
    return write_text_atomic(folder / MANIFEST, json.dumps({"format": CACHE_FORMAT, **manifest}, indent=1))


def write_shard(folder: Path, index: int, batch: Batch, *, pixel_wh: tuple[int, int], skipped: dict[str, str]) -> None:
    """Write shard `index`: `batch` (one bucket, `pixel_wh` its pixel size) and the inputs of the shard
    that could not be used, `{key: why}`."""
    metadata = {
        "latent_hw": json.dumps(list(batch.latents.shape[-2:])),
        "pixel_wh": json.dumps(list(pixel_wh)),
        "count": str(len(batch)),
        "skipped": json.dumps(skipped),
    }
    write_tensors(folder / shard_name(index), batch, metadata=metadata)


def check_plan(folder: Path, plan: dict[str, Any], world: World) -> None:
    """Record what the shards of `folder` are planned to hold (rank 0, while no shard is written, so a run
    that failed before its first shard, say out of memory, can be retried with other settings) and refuse
    a folder with shards planned otherwise (collective).

    Raises:
        ValueError: on every rank, when the folder's shards were planned for other inputs or settings
            (names each setting that differs).
    """
    path = folder / PLAN
    if world.is_main and not any(folder.glob("shard-*.safetensors")):
        write_text_atomic(path, json.dumps(plan, indent=1))
    world.barrier()
    differ = _differences(json.loads(path.read_text(encoding="utf-8")), plan)
    if differ:
        raise ValueError(
            f"{folder} holds an unfinished cache of other inputs or settings ({differ}); rerun with those, or "
            "delete the folder or choose another --data.cache_dir to start over."
        )


def check_finished(folder: Path, settings: dict[str, Any]) -> None:
    """Refuse a finished cache whose `plan.json` records other settings than `settings` (the plan without
    the inputs' digest, which needs the pipeline to compute).

    Raises:
        ValueError: names each setting that differs.
    """
    path = folder / PLAN
    differ = _differences(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}, settings)
    if differ:
        raise ValueError(
            f"{folder} holds a finished cache made with other settings ({differ}); rerun with those, train on it as "
            f"it is with --data.source cache --data.path {folder}, or choose another --data.cache_dir."
        )


def _differences(saved: dict[str, Any], plan: dict[str, Any]) -> str:
    """Each setting of `plan` that `saved` records otherwise (one it does not record, as in caches made
    before it was kept, is not compared)."""
    return ", ".join(
        f"{key} {saved[key]!r} -> {value!r}" for key, value in plan.items() if saved.get(key, value) != value
    )


def finish_cache(folder: Path, *, kind: str, uncond: Batch, skipped: dict[str, str]) -> tuple[int, int, dict[str, str]]:
    """Close a cache whose shards are all written (rank 0): the uncond file, then the manifest when any
    sample was kept (an empty cache stays unfinished).

    Args:
        kind (`str`): what the samples were made from (`images`, `prompts`).
        uncond (`Batch`): the empty caption's conditioning, one row.
        skipped (`dict[str, str]`): inputs left out before sharding, `{key: why}`; each shard's own are added.

    Returns:
        The samples kept, the shards, and every skipped input.
    """
    write_tensors(folder / UNCOND, uncond)
    shards, all_skipped = [], dict(skipped)
    for path in sorted(folder.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
        all_skipped.update(json.loads(meta["skipped"]))
        shards.append({"file": path.name, "latent_hw": json.loads(meta["latent_hw"]), "count": int(meta["count"])})
    kept = sum(shard["count"] for shard in shards)
    if kept:
        write_manifest(folder, {"kind": kind, "shards": shards, "skipped": all_skipped})
    return kept, len(shards), all_skipped


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
                self._open[file] = {key: handle.get_tensor(key) for key in _TENSORS}
        return self._open[file]

    def _locate(self, index: int) -> tuple[str, int]:
        for file, start in reversed(self._shards):
            if index >= start:
                return file, index - start
        raise IndexError(index)

    def load(self, indices: list[int]) -> Batch:
        rows = [self._locate(index) for index in indices]
        picked = {key: [] for key in _TENSORS}
        for file, row in rows:
            tensors = self._read(file)
            for key in picked:
                picked[key].append(tensors[key][row])
        return Batch(*(torch.stack(picked[key]).float() for key in _TENSORS))

    def uncond(self) -> tuple[Tensor, Tensor]:
        tensors = self._read(UNCOND)
        return tensors["context"][0].float(), tensors["pooled"][0].float()

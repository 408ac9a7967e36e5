"""What toy experiments keep between runs under `experiments/results/.cache/` (not committed), keyed by a
digest of what made it: the ToyEval samples of a toy checkpoint, with softmax attention (the reference
every toy row is compared with) or with a T5 weights file applied, and the `file_digest` other cached
files are named by.
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from sd3_testbed.eval import eval_set, generate
from sd3_testbed.model import load_toy_base
from t5core.atomic import write_atomic
from t5core.file_stamp import sha256_file
from t5core.hosts.diffusers import linearize

__all__ = ["CACHE", "file_digest", "toy_model", "toy_samples"]

logger = logging.getLogger(__name__)

CACHE = ".cache"
"""The cache folder's name under an experiment's results folder."""


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's sha256."""
    return sha256_file(path)[:16]


def toy_model(path: Path, *, t5_file: Path | None = None) -> nn.Module:
    """The SD3-named toy checkpoint `path` (eval mode, no gradients), with softmax attention or with the T5
    weights file `t5_file` applied (`t5core.hosts.diffusers.linearize`, torch path)."""
    model = load_toy_base(path=path)
    if t5_file is not None:
        linearize(model, weights=t5_file, backend="torch")
    return model


def toy_samples(path: Path, count: int, cache: Path, *, seed: int = 0, t5_file: Path | None = None) -> Tensor:
    """The ToyEval samples of the SD3-named toy checkpoint `path`, with softmax attention or with the T5
    weights file `t5_file` applied (`t5core.hosts.diffusers.linearize`), before the decoder's clamp, on
    `eval_set(count, seed=seed)` (20 Euler steps, CFG 3, as `toy_eval`).

    They are deterministic (fixed captions, noise and weights), so they are read from the `cache` folder
    when these files were sampled before, and written there otherwise.

    Returns:
        `(count, 3, S, S)` float32 images.
    """
    model = "softmax" if t5_file is None else f"t5-{file_digest(t5_file)}-on"
    stored = cache / f"{model}-{file_digest(path)}-seed{seed}-{count}-raw.safetensors"
    if stored.is_file():
        return load_file(stored)["images"]
    captions, noise = eval_set(count, seed=seed)
    raw = generate(toy_model(path, t5_file=t5_file), captions, noise, clamp=False)
    write_atomic(stored, lambda temp: save_file({"images": raw.contiguous()}, str(temp)))
    logger.info("cached %d samples of %s in %s", count, Path(path).name, stored)
    return raw

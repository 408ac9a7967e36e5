"""The shipped teacher's ToyEval samples, so that a run's evaluation samples only its student.

The teacher and the evaluation set are fixed, so the teacher's samples are the same in every run: the
pretraining script (`python -m sd3_testbed.pretrain`, or `--record-only` for the shipped file) writes
them beside the teacher as `<teacher>_eval.safetensors`, raw (before the decoder's clamp), with what made
them in the file's metadata. `teacher_samples` returns them only when all of it matches: the teacher
file's digest, the evaluation seed, steps, CFG and image size, and at least `count` samples (the first k
samples of a larger set are exactly the set of size k, `sd3_testbed.eval.eval_set`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from sd3_testbed.data import IMAGE_SIZE
from sd3_testbed.model import WEIGHTS_FILE
from t5core.atomic import write_atomic
from t5core.file_stamp import sha256_file

__all__ = ["TOY_EVAL", "EvalSettings", "samples_file", "save_teacher_samples", "teacher_samples"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EvalSettings:
    """What a ToyEval sampling depends on besides the model: `eval_set(count, seed=seed, size=size)`
    sampled with `steps` Euler steps at CFG `cfg`."""

    seed: int = 0
    steps: int = 20
    cfg: float = 3.0
    size: int = IMAGE_SIZE

    def as_metadata(self) -> dict[str, str]:
        return {f"eval.{name}": str(value) for name, value in asdict(self).items()}


TOY_EVAL = EvalSettings()
"""The settings of the trainer's ToyEval and of the shipped teacher's record."""


def samples_file(teacher: Path) -> Path:
    """Where the samples of the teacher file `teacher` are stored: `<teacher>_eval.safetensors` beside it."""
    return teacher.with_name(f"{teacher.stem}_eval.safetensors")


def save_teacher_samples(raw: Tensor, settings: EvalSettings, *, teacher: Path) -> Path:
    """Write `raw`, the teacher file's ToyEval samples `(count, 3, S, S)` before the clamp, made with
    `settings`, to `samples_file(teacher)`, atomically."""
    path = samples_file(teacher)
    metadata = {"teacher.sha256": sha256_file(teacher), **settings.as_metadata()}
    write_atomic(path, lambda temp: save_file({"images": raw.float().contiguous()}, str(temp), metadata=metadata))
    return path


def teacher_samples(count: int, settings: EvalSettings = TOY_EVAL, *, teacher: Path = WEIGHTS_FILE) -> Tensor | None:
    """The first `count` stored ToyEval samples of the teacher file `teacher` made with `settings`, raw;
    None (logged) when no stored samples match it."""
    path = samples_file(teacher)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as stored:
        metadata = stored.metadata() or {}
        expected = {"teacher.sha256": sha256_file(teacher), **settings.as_metadata()}
        stale = sorted(key for key, value in expected.items() if metadata.get(key) != value)
        available = stored.get_slice("images").get_shape()[0]
        if stale or available < count:
            reason = f"made with other {', '.join(stale)}" if stale else f"{available} samples, {count} asked"
            logger.info("the teacher's stored ToyEval samples %s do not fit (%s): sampling the teacher", path, reason)
            return None
        return stored.get_slice("images")[:count]

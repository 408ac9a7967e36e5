"""After a toy run: ToyEval of the softmax teacher and the trained student, a table and a picture.

Uses the toy's own evaluation (`trainer.toy.report.compare`: same captions and noise for both
models) and writes `toy_eval.md` and `grid.png` (teacher rows above student rows) into the run folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from trainer.distributed import World

__all__ = ["evaluate_toy"]

logger = logging.getLogger(__name__)


def evaluate_toy(
    student: nn.Module, output: Path, world: World, *, samples: int, sharded: bool
) -> dict[str, Any] | None:
    """Evaluate on rank 0 and return the numbers for the run report (None when skipped).

    A model sharded over several processes (FSDP2) cannot run on rank 0 alone; then the
    evaluation is skipped with a note, and the exported file can be evaluated instead.
    """
    if samples == 0 or not world.is_main:
        return None
    if sharded and world.world_size > 1:
        logger.info("ToyEval skipped: the student is sharded over %d processes (FSDP2)", world.world_size)
        return None
    from trainer.toy.model import load_toy_base
    from trainer.toy.report import compare, write_grid

    student.eval()
    comparison = compare(load_toy_base().to(world.device), student, count=samples)
    (output / "toy_eval.md").write_text(comparison.table() + "\n", encoding="utf-8")
    write_grid(output / "grid.png", comparison)
    logger.info(
        "ToyEval: teacher %.3f, T5 student %.3f (overall); wrote %s and %s",
        comparison.teacher_score.overall,
        comparison.student_score.overall,
        output / "toy_eval.md",
        output / "grid.png",
    )
    return comparison.as_dict()

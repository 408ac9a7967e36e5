"""Teacher vs student on the toy: one call that evaluates both, a markdown table and a PNG grid.

comparison = compare(teacher, student)          # same prompts and noise for both
print(comparison.table())
write_grid(run_dir / "grid.png", comparison)    # row pairs: teacher above, student below
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from t5core.atomic import write_bytes_atomic
from trainer.toy.data import Caption
from trainer.toy.eval import ToyEvalScore, eval_set, generate, score_images, teacher_distance, validation_loss

logger = logging.getLogger(__name__)

__all__ = ["Comparison", "compare", "write_grid"]


@dataclass(frozen=True, slots=True)
class Comparison:
    """ToyEval, validation loss and samples of a teacher and a student from the same noise."""

    captions: tuple[Caption, ...]
    teacher_score: ToyEvalScore
    student_score: ToyEvalScore
    teacher_val_loss: float
    student_val_loss: float
    distance: float
    teacher_images: Tensor
    student_images: Tensor

    def table(self, *, student_name: str = "T5") -> str:
        """A markdown table: one row per model, ToyEval per attribute, val loss, distance to teacher."""
        lines = [
            "| model | ToyEval overall | color | shape | position | size | val loss | dist. to teacher |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, score, loss, dist in (
            ("softmax teacher", self.teacher_score, self.teacher_val_loss, 0.0),
            (student_name, self.student_score, self.student_val_loss, self.distance),
        ):
            lines.append(
                f"| {name} | {score.overall:.3f} | {score.color:.3f} | {score.shape:.3f} | {score.position:.3f} | "
                f"{score.size:.3f} | {loss:.4f} | {dist:.4f} |"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "teacher": {"toyeval": self.teacher_score.as_dict(), "val_loss": self.teacher_val_loss},
            "student": {"toyeval": self.student_score.as_dict(), "val_loss": self.student_val_loss},
            "teacher_distance": self.distance,
        }


@torch.no_grad()
def compare(teacher, student, *, count: int = 180, steps: int = 20, cfg: float = 3.0, seed: int = 0) -> Comparison:
    """Sample the fixed evaluation set with both models from the same noise and score both."""
    captions, noise = eval_set(count, seed=seed)
    teacher_images = generate(teacher, captions, noise, steps=steps, cfg=cfg)
    student_images = generate(student, captions, noise, steps=steps, cfg=cfg)
    return Comparison(
        captions=captions,
        teacher_score=score_images(teacher_images, captions),
        student_score=score_images(student_images, captions),
        teacher_val_loss=validation_loss(teacher),
        student_val_loss=validation_loss(student),
        distance=teacher_distance(student_images, teacher_images),
        teacher_images=teacher_images,
        student_images=student_images,
    )


def write_grid(path: Path | str, comparison: Comparison, *, columns: int = 12, scale: int = 3) -> Path:
    """Write a PNG of the first samples: each pair of rows is teacher (top) and student (bottom)
    for the same captions and noise, separated by a grey line; pixels are upscaled `scale` times."""
    from PIL import Image

    teacher, student = comparison.teacher_images, comparison.student_images
    count = min(teacher.shape[0], columns * 4)
    pairs = []
    for start in range(0, count, columns):
        chunk = slice(start, min(start + columns, count))
        pad = columns - (chunk.stop - chunk.start)
        rows = [
            torch.cat(list(images[chunk]) + [torch.zeros_like(images[0])] * pad, dim=2) for images in (teacher, student)
        ]
        pairs.append(torch.cat([rows[0], rows[1], torch.full((3, 2, rows[0].shape[2]), 0.5)], dim=1))
    grid = torch.cat(pairs, dim=1)
    pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(pixels).resize((pixels.shape[1] * scale, pixels.shape[0] * scale), Image.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return write_bytes_atomic(path, buffer.getvalue())

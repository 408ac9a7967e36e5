"""Teacher vs student on the toy: one call that evaluates both, a markdown table and a PNG grid.

comparison = compare(teacher, student)          # same prompts and noise for both
print(comparison.table())
write_grid(run_dir / "grid.png", comparison)    # captions, then teacher and student rows, titled
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

__all__ = ["Comparison", "compare", "comparison_table", "write_grid"]


def comparison_table(comparison: dict, *, student_name: str = "T5") -> str:
    """The markdown table of a comparison in its `Comparison.as_dict()` form (as run reports store it):
    one row per model, ToyEval per attribute, val loss, distance to teacher."""
    lines = [
        "| model | ToyEval overall | color | shape | position | size | val loss | dist. to teacher |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, key, distance in (
        ("softmax teacher", "teacher", 0.0),
        (student_name, "student", comparison["teacher_distance"]),
    ):
        score = comparison[key]["toyeval"]
        cells = " | ".join(f"{score[part]:.3f}" for part in ("overall", "color", "shape", "position", "size"))
        lines.append(f"| {name} | {cells} | {comparison[key]['val_loss']:.4f} | {distance:.4f} |")
    return "\n".join(lines)


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
        return comparison_table(self.as_dict(), student_name=student_name)

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


def _wrap(draw, text: str, font, width: int) -> list[str]:
    """`text` broken at spaces into lines no wider than `width` pixels (a longer word keeps its line)."""
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def write_grid(
    path: Path | str, comparison: Comparison, *, columns: int = 12, scale: int = 3, student_name: str = "T5"
) -> Path:
    """Write a labelled PNG of the first samples, in blocks of `columns`: each block has the captions on
    top, then the teacher's row and the student's row for those captions and the same noise, each row
    titled on the left; pixels are upscaled `scale` times."""
    from PIL import Image, ImageDraw, ImageFont

    teacher, student = comparison.teacher_images, comparison.student_images
    count = min(teacher.shape[0], columns * 4)
    tile, pad = teacher.shape[-1] * scale, 4
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_height = sum(font.getmetrics()) + 2
    titles = ("teacher", student_name)
    margin = int(max(measure.textlength(title, font=font) for title in titles)) + 2 * pad
    captions = [_wrap(measure, str(caption), font, tile + pad - 2) for caption in comparison.captions[:count]]
    band = max(len(lines) for lines in captions) * line_height + pad
    block = band + 2 * tile + 2 * pad
    blocks = (count + columns - 1) // columns
    image = Image.new("RGB", (margin + columns * (tile + pad), blocks * block), (24, 24, 24))
    draw = ImageDraw.Draw(image)
    for index in range(count):
        row, column = divmod(index, columns)
        left, top = margin + column * (tile + pad), row * block
        for number, line in enumerate(captions[index]):
            draw.text((left + 1, top + pad + number * line_height), line, fill=(220, 220, 220), font=font)
        for offset, images in enumerate((teacher, student)):
            pixels = (images[index].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            picture = Image.fromarray(pixels).resize((tile, tile), Image.NEAREST)
            image.paste(picture, (left, top + band + offset * (tile + pad)))
    for row in range(blocks):
        for offset, title in enumerate(titles):
            y = row * block + band + offset * (tile + pad) + (tile - line_height) // 2
            draw.text((pad, y), title, fill=(255, 255, 255), font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return write_bytes_atomic(path, buffer.getvalue())

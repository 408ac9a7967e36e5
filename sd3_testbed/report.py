"""Teacher vs student on the toy: one call that evaluates both, a markdown table and a PNG grid.

comparison = compare(teacher, student)          # same prompts and noise for both
print(comparison.table())
write_grid(run_dir / "grid.png", comparison)    # captions, then teacher and student rows, titled
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from sd3_testbed.artifacts import (
    BackgroundError,
    background_error,
    background_level,
    open_background_level,
    token_period_energy,
)
from sd3_testbed.data import Caption
from sd3_testbed.eval import (
    GENERATE_BATCH,
    ToyEvalScore,
    eval_set,
    generate,
    sample_hits,
    score_images,
    teacher_distance,
    validation_loss,
)
from sd3_testbed.reference import TOY_EVAL, EvalSettings
from sd3_testbed.stats import paired_difference
from t5core.atomic import write_bytes_atomic

logger = logging.getLogger(__name__)

__all__ = ["Comparison", "compare", "comparison_table", "write_grid"]


def comparison_table(comparison: dict, *, student_name: str = "T5") -> str:
    """The markdown table of a comparison in its `Comparison.as_dict()` form (as run reports store it):
    one row per model, ToyEval per attribute, val loss, distance to teacher and the artifact measures
    (`sd3_testbed.artifacts`), then the paired ToyEval difference with its 95% interval."""
    lines = [
        "| model | ToyEval overall | color | shape | position | size | val loss | dist. to teacher "
        "| background | open background | token-period energy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, key in (("softmax teacher", "teacher"), (student_name, "student")):
        entry = comparison[key]
        score = entry["toyeval"]
        cells = " | ".join(f"{score[part]:.3f}" for part in ("overall", "color", "shape", "position", "size"))
        distance = comparison["teacher_distance"] if key == "student" else 0.0
        energy = f"{entry['token_period_energy']:.4f}" if key == "student" else "-"
        # reports written before the open-background measure existed have no such entry
        open_level = f"{entry['open_background']:.5f}" if "open_background" in entry else "-"
        lines.append(
            f"| {name} | {cells} | {entry['val_loss']:.4f} | {distance:.4f} | {entry['background']:.4f} "
            f"| {open_level} | {energy} |"
        )
    paired = comparison["paired"]
    lines += [
        "",
        f"{student_name} - teacher, paired on the same {paired['samples']} captions and noise: "
        f"{paired['mean']:+.3f} ToyEval, 95% interval [{paired['low']:+.3f}, {paired['high']:+.3f}] (bootstrap over "
        "samples). Background: mean pixel level where the teacher's image is black; open background: the same "
        "more than 2 px from either image's objects (a lift, not a displaced object); token-period energy: share "
        f"of the {student_name}-minus-teacher residual on the token lattice of the spectrum (white noise: 0.0065).",
    ]
    # reports written before the measure existed have no such entry
    if all("background_error" in comparison[key] for key in ("teacher", "student")):
        lines += ["", *_background_error_table(comparison, student_name)]
    return "\n".join(lines)


def _background_error_table(comparison: dict, student_name: str) -> list[str]:
    lines = [
        "The open background before the decoder's clamp (the data's is exactly black, 0; the clamp hides what lies "
        "below, so a level above can come from a bias as much as from noise):",
        "",
        "| model | bias | noise | token pattern | share above black |",
        "|---|---|---|---|---|",
    ]
    for name, key in (("softmax teacher", "teacher"), (student_name, "student")):
        e = comparison[key]["background_error"]
        lines.append(f"| {name} | {e['bias']:+.4f} | {e['noise']:.4f} | {e['token_pattern']:.4f} | {e['lit']:.2f} |")
    return lines


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
    teacher_background: BackgroundError
    """The teacher's open background before the decoder's clamp (`sd3_testbed.artifacts.background_error`)."""
    student_background: BackgroundError

    def table(self, *, student_name: str = "T5") -> str:
        """A markdown table: one row per model, ToyEval per attribute, val loss, distance to teacher."""
        return comparison_table(self.as_dict(), student_name=student_name)

    def as_dict(self) -> dict:
        teacher_hits, student_hits = (
            [int(hit["overall"]) for hit in sample_hits(images, self.captions)]
            for images in (self.teacher_images, self.student_images)
        )
        paired = paired_difference([student_hits], teacher_hits)
        teacher, student = self.teacher_images, self.student_images
        return {
            "teacher": {
                "toyeval": self.teacher_score.as_dict(),
                "val_loss": self.teacher_val_loss,
                "background": background_level(teacher, teacher),
                "open_background": open_background_level(teacher, teacher),
                "background_error": asdict(self.teacher_background),
            },
            "student": {
                "toyeval": self.student_score.as_dict(),
                "val_loss": self.student_val_loss,
                "background": background_level(student, teacher),
                "open_background": open_background_level(student, teacher),
                "token_period_energy": token_period_energy(student, teacher),
                "background_error": asdict(self.student_background),
            },
            "teacher_distance": self.distance,
            "paired": {"mean": paired.mean, "low": paired.low, "high": paired.high, "samples": paired.samples},
        }


@torch.no_grad()
def compare(
    teacher,
    student,
    *,
    count: int = 180,
    settings: EvalSettings = TOY_EVAL,
    teacher_raw: Tensor | None = None,
    progress: bool = False,
) -> Comparison:
    """Sample the fixed evaluation set (`settings`) with both models from the same noise and score both;
    `teacher_raw` are the teacher's samples of that set before the clamp where they are known
    (`sd3_testbed.reference.teacher_samples`), and then only the student is sampled. `progress` shows a
    bar with an ETA over the sampling batches (the evaluation takes minutes on a CPU)."""
    captions, noise = eval_set(count, seed=settings.seed, size=settings.size)
    if teacher_raw is not None and teacher_raw.shape != (count, 3, settings.size, settings.size):
        raise ValueError(f"teacher_raw: {count} samples of {settings.size} px expected, got {tuple(teacher_raw.shape)}")
    models = (student,) if teacher_raw is not None else (teacher, student)
    batches = len(models) * math.ceil(count / GENERATE_BATCH)
    with tqdm(total=batches, desc="ToyEval", unit="batch", disable=not progress, dynamic_ncols=True) as bar:
        sampled = [
            generate(model, captions, noise, steps=settings.steps, cfg=settings.cfg, on_batch=bar.update, clamp=False)
            for model in models
        ]
    if teacher_raw is None:
        teacher_raw, student_raw = sampled
    else:
        (student_raw,) = sampled
        teacher_raw = teacher_raw.to(student_raw.device)
    teacher_images, student_images = teacher_raw.clamp(0.0, 1.0), student_raw.clamp(0.0, 1.0)
    return Comparison(
        captions=captions,
        teacher_score=score_images(teacher_images, captions),
        student_score=score_images(student_images, captions),
        teacher_val_loss=validation_loss(teacher),
        student_val_loss=validation_loss(student),
        distance=teacher_distance(student_images, teacher_images),
        teacher_images=teacher_images,
        student_images=student_images,
        teacher_background=background_error(teacher_raw, teacher_images),
        student_background=background_error(student_raw, teacher_images),
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

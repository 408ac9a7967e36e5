"""The toy as a trainer model preset (`--model.base toy`): its model, data source, evaluation (ToyEval)
and model-card section. Two ablations of the toy are presets of their own, the same toy with a changed
student (`sd3_testbed.baselines`): `toy-linear` runs plain elu+1 linear attention on the inherited q/k/v in
place of T5, and `toy-no-inherit` re-initialises the converted modules' inherited attention weights, which
then train at the new parameters' rate. No T5 weights file holds either student, so their runs write none
(`ModelPreset.exports`). `register_toy_finetune` registers the toy on a fine-tune of the teacher and the
palette it learned, so a run makes a file of the fine-tune itself (`experiments.reuse`).

Importing this module registers the preset (`trainer.presets`); the trainer imports it the first
time it looks the name up.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sd3_testbed import data as toy_data
from sd3_testbed.baselines import PlainLinearAttention, reinit_inherited
from sd3_testbed.model import TOY_CONFIG, TOY_SHIFT, WEIGHTS_FILE, load_toy_base
from t5core.atomic import write_text_atomic
from t5core.hosts.diffusers import T5Handle
from trainer.config import DataConfig, TrainConfig
from trainer.data import Batch
from trainer.distributed import World
from trainer.presets import ModelPreset, register_preset

__all__ = [
    "TOY_LINEAR_PRESET",
    "TOY_NO_INHERIT_PRESET",
    "TOY_PRESET",
    "ToySource",
    "card_section",
    "evaluate_toy",
    "register_toy_finetune",
]

logger = logging.getLogger(__name__)


class ToySource:
    """The toy's procedural captioned shapes (`sd3_testbed.data`): sample i is `make_batch(1, seed=i)`, its
    colour words drawn in `palette`."""

    def __init__(self, samples: int, *, size: int, palette: toy_data.Palette = toy_data.COLORS) -> None:
        self.size = size
        self.palette = palette
        self._buckets = {(size // 2, size // 2): list(range(samples))}

    def buckets(self) -> dict[tuple[int, int], list[int]]:
        return self._buckets

    def load(self, indices: list[int]) -> Batch:
        parts = [toy_data.make_batch(1, seed=index, size=self.size, palette=self.palette) for index in indices]
        return Batch(
            torch.cat([p.latents for p in parts]),
            torch.cat([p.encoder_hidden_states for p in parts]),
            torch.cat([p.pooled_projections for p in parts]),
        )

    def uncond(self) -> tuple[Tensor, Tensor]:
        context, pooled = toy_data.embed_captions([""])
        return context[0], pooled[0]


def evaluate_toy(student: nn.Module, config: TrainConfig, output: Path, world: World) -> dict[str, Any] | None:
    """ToyEval of the softmax teacher and the trained student on rank 0 (`--output.toy_eval_samples`
    captions): `toy_eval.md` and `grid.png` (teacher rows above student rows, same captions and noise)
    in the run folder, and the numbers for the run report (None when skipped). The teacher's samples
    are the ones shipped beside it where they cover the set (`sd3_testbed.reference`).

    A model sharded over several processes (FSDP2) cannot run on rank 0 alone; then the
    evaluation is skipped with a note, and the exported file can be evaluated instead.
    """
    samples = config.output.toy_eval_samples
    if samples == 0 or not world.is_main:
        return None
    if config.parallel.mode == "fsdp2" and world.world_size > 1:
        logger.info("ToyEval skipped: the student is sharded over %d processes (FSDP2)", world.world_size)
        return None
    from sd3_testbed.reference import teacher_samples
    from sd3_testbed.report import compare, comparison_table, write_grid

    if config.training.autocast_dtype is not None:  # frozen weights are held in bf16: sample an fp32 copy
        student = copy.deepcopy(student).float()
    student.eval()
    teacher = load_toy_base().to(world.device)
    comparison = compare(
        teacher, student, count=samples, teacher_raw=teacher_samples(samples), progress=config.output.progress
    )
    numbers = comparison.as_dict()
    write_text_atomic(output / "toy_eval.md", comparison_table(numbers) + "\n")
    write_grid(output / "grid.png", comparison)
    logger.info(
        "ToyEval: teacher %.3f, T5 student %.3f (overall); wrote %s and %s",
        comparison.teacher_score.overall,
        comparison.student_score.overall,
        output / "toy_eval.md",
        output / "grid.png",
    )
    return numbers


def card_section(evaluation: Mapping[str, Any]) -> list[str]:
    """The model card's validation text for `evaluate_toy`'s numbers: the teacher vs student table."""
    from sd3_testbed.report import comparison_table

    return [
        "ToyEval of the softmax teacher and the trained T5 student, same captions and noise (higher is better; "
        "val loss and distance lower):",
        "",
        comparison_table(evaluation),
    ]


def _largest_size() -> int:
    """The toy's largest image side: its position table's patches x patch size x the 2x latent downsampling."""
    return int(TOY_CONFIG["pos_embed_max_size"]) * int(TOY_CONFIG["patch_size"]) * 2


def _source(data: DataConfig, palette: toy_data.Palette = toy_data.COLORS) -> ToySource:
    size = data.resolution or toy_data.IMAGE_SIZE
    if not 32 <= size <= _largest_size():
        raise ValueError(
            f"--data.resolution: the toy draws 32 to {_largest_size()} px images (multiples of 16); got {size}. "
            f"0 = its {toy_data.IMAGE_SIZE} px."
        )
    return ToySource(data.toy_samples, size=size, palette=palette)


def _plain_linear(handle: T5Handle, config: TrainConfig) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Plain linear attention in place of each converted module's T5 computation; the T5 modules stay in the
    model, unused and frozen."""
    for module in handle.modules.values():
        module.forward = PlainLinearAttention().forward
    return [], list(handle.t5_parameters())


def _reinit_inherited(handle: T5Handle, config: TrainConfig) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The converted modules' inherited attention weights re-initialised (from the run's seed); they train as new."""
    return reinit_inherited(handle.model, tuple(handle.modules), seed=config.training.seed), []


def _toy_preset(
    name: str,
    description: str,
    adapt_student: Callable[[T5Handle, TrainConfig], tuple[list[nn.Parameter], list[nn.Parameter]]] | None = None,
    *,
    weights: Path = WEIGHTS_FILE,
    palette: str = "default",
    evaluate: Callable[[nn.Module, TrainConfig, Path, World], dict[str, Any] | None] = evaluate_toy,
) -> ModelPreset:
    return register_preset(
        ModelPreset(
            name=name,
            description=description,
            data_source="toy",
            load_base=lambda: load_toy_base(path=weights).requires_grad_(True),
            weight_files=lambda: {weights.name: weights},
            build_source=functools.partial(_source, palette=toy_data.PALETTES[palette]),
            evaluate=evaluate,
            evaluation_name="toy_eval",
            card_section=card_section,
            card_note=f"The toy model samples with `ModelSamplingSD3` shift {TOY_SHIFT} and its own captions; "
            "see docs/toy.md.",
            adapt_student=adapt_student,
            # a changed student is a baseline: no T5 weights file holds it
            exports=adapt_student is None,
        )
    )


def _not_evaluated(student: nn.Module, config: TrainConfig, output: Path, world: World) -> None:
    logger.info(
        "ToyEval skipped: it compares with the shipped teacher; python -m experiments.reuse measures a fine-tune"
    )


def register_toy_finetune(name: str, weights: Path, palette: str) -> ModelPreset:
    """Register the toy preset `name` on another SD3-named toy checkpoint, `weights` (a fine-tune of the
    teacher), trained on its captions drawn in `palette` (a name of `sd3_testbed.data.PALETTES`), so a run
    makes a T5 file of the fine-tune itself. Its runs skip ToyEval, which compares with the shipped teacher.

    Raises:
        KeyError: `palette` is not a palette's name.
    """
    if palette not in toy_data.PALETTES:
        raise KeyError(f"palette {palette!r}: give one of {sorted(toy_data.PALETTES)}.")
    description = f"a fine-tune of the built-in toy ({weights.name}, `{palette}` palette)"
    return _toy_preset(name, description, weights=weights, palette=palette, evaluate=_not_evaluated)


TOY_PRESET = _toy_preset("toy", "the built-in toy SD3.5-Medium-like model")
TOY_LINEAR_PRESET = _toy_preset(
    "toy-linear", "the built-in toy with plain elu+1 linear attention in place of T5 (a baseline)", _plain_linear
)
TOY_NO_INHERIT_PRESET = _toy_preset(
    "toy-no-inherit",
    "the built-in toy with re-initialised inherited attention weights (an ablation)",
    _reinit_inherited,
)

"""The model card of an exported T5 weights file: what it was made from, how, how well, and how to use it.

`model_card` is a pure function of the resolved config and the run report (the dict of `report.json`);
`base_digests` hashes the base model's files, so the card pins the exact base the weights belong to.
The card is `README.md` in `<output.dir>` (a run folder holds one weights file, and model hubs show
that name) and `<stem>.md` beside the file in ComfyUI's `models/t5_linearize/` (`card_name`), where
several weights files share one folder and the node lists only `.safetensors` files.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from t5core.file_stamp import sha256_file
from trainer.config import ModelConfig, TrainConfig
from trainer.config_file import config_to_toml
from trainer.model import base_weight_files
from trainer.presets import ModelPreset, get_preset
from trainer.validation import REPORT_KEY, card_section

__all__ = ["RUN_CARD", "base_digests", "card_name", "check_run_card", "model_card"]

RUN_CARD = "README.md"
"""The card's name in `<output.dir>`."""
_TITLE = "# T5 attention weights: "
_STOPS = {"steps": "`--training.steps` reached", "time": "`--training.max_minutes` spent"}


def card_name(weights_name: str) -> str:
    """The card's name beside the weights file in a shared folder: `t5_large.safetensors` -> `t5_large.md`."""
    return f"{Path(weights_name).stem}.md"


def check_run_card(folder: Path) -> None:
    """Refuse, before training, a run folder whose `README.md` is not an earlier run's model card (the user's
    own README, as in `--output.dir .`), which the card would overwrite.

    Raises:
        FileExistsError: `<folder>/README.md` exists and is not a model card.
    """
    card = folder / RUN_CARD
    if card.is_file() and not card.read_text(encoding="utf-8", errors="replace").startswith(_TITLE):
        raise FileExistsError(
            f"{card} exists and is not a model card of an earlier run; the run writes its model card there, so "
            "nothing was trained. Give the run a folder of its own with --output.dir, or move that file away."
        )


def base_digests(config: ModelConfig) -> dict[str, str]:
    """File name -> sha256 of the files holding the base model's weights (`trainer.model.base_weight_files`:
    a preset's files, a single-file checkpoint, or a diffusers folder's or Hub repo's transformer weights),
    in file-name order."""
    return {name: sha256_file(file) for name, file in sorted(base_weight_files(config).items())}


def _value(value: object) -> str:
    return "`none`" if value is None else f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _rows(pairs: list[tuple[str, object]]) -> list[str]:
    return ["| setting | value |", "|---|---|", *(f"| {name} | {_value(value)} |" for name, value in pairs)]


def _base_section(model: ModelConfig, report: Mapping[str, Any], preset: ModelPreset | None) -> list[str]:
    what = preset.description if preset is not None else f"`{model.base}`"
    lines = ["## Base model", "", f"Trained from {what} (`--model.base {model.base}`).", ""]
    if model.start_from:
        lines += [
            f"Adapted from the T5 weights file `{Path(model.start_from).name}` (`--model.start_from`): the run started "
            "from its T5 modules and deltas, and this file's deltas are against the base above.",
            "",
        ]
    digests = report.get("base_sha256") or {}
    if digests:
        lines += ["| base file | sha256 |", "|---|---|", *(f"| `{name}` | `{sha}` |" for name, sha in digests.items())]
    if report.get("parameters", {}).get("inherited"):
        form = f"rank-{model.rank} deltas" if model.rank else "full deltas"
        lines += [
            "",
            f"The file also holds the changes of the inherited weights that trained ({form}, `--model.trainable "
            f"{model.trainable}`), which both hosts add to the model they are given, and the base's "
            "fingerprint: it also serves fine-tunes of this base, with a warning naming both fingerprints.",
        ]
    return lines


def _conversion_section(model: ModelConfig, report: Mapping[str, Any]) -> list[str]:
    layers = list(report.get("converted_layers", []))
    return [
        "## Conversion",
        "",
        *_rows(
            [
                ("layer spec (`--model.layers`)", model.layers),
                *((f"`--model.{name}`", value) for name, value in model.t5_config().settings().items()),
            ]
        ),
        "",
        f"Converted attention modules ({len(layers)}): {', '.join(f'`{name}`' for name in layers) or 'none'}.",
    ]


def _recipe_section(config: TrainConfig, report: Mapping[str, Any]) -> list[str]:
    optim, training, loss = config.optim, config.training, config.loss
    pairs: list[tuple[str, object]] = [
        ("trainable", config.model.trainable),
        ("data", config.data.source),
        ("lr of new T5 parameters", optim.lr * optim.new_lr_mult),
        (
            "lr of inherited parameters",
            optim.lr * optim.inherited_lr_mult if config.model.trainable != "t5" else "frozen",
        ),
        ("schedule", f"{optim.warmup_steps} warm-up steps, then {optim.schedule}"),
        *(
            [
                (
                    "attention transfer",
                    f"{config.transfer.steps} steps, lr {config.transfer.lr:g}, {config.transfer.timesteps} timesteps",
                )
            ]
            if config.transfer.steps
            else []
        ),
        (
            "low-rank deltas (`--model.rank`, alpha)",
            f"{config.model.rank}, {config.model.alpha or config.model.rank:g}" if config.model.rank else "off (full)",
        ),
        ("steps", training.steps),
        ("global batch", training.batch_size),
        ("precision", training.precision),
        ("loss weights (flow, distill, feature)", f"{loss.flow_weight}, {loss.distill_weight}, {loss.feature_weight}"),
        ("timestep shift", loss.shift),
        ("processes", f"{report.get('processes', 1)} ({config.parallel.mode})"),
    ]
    return [
        "## Recipe",
        "",
        *_rows(pairs),
        "",
        "<details><summary>The resolved config (<code>config.toml</code>)</summary>",
        "",
        "```toml",
        config_to_toml(config).rstrip(),
        "```",
        "",
        "</details>",
    ]


def _training_section(report: Mapping[str, Any]) -> list[str]:
    stop = report.get("stop_reason", "")
    lines = ["## Training", "", f"Trained to step {report.get('step')}; stopped: {_STOPS.get(stop, stop)}.", ""]
    losses = {key: value for key, value in report.get("last_step", {}).items() if key.startswith("loss/")}
    if losses:
        lines += ["Losses of the last step:", "", *(f"* `{key}`: {value:.4f}" for key, value in losses.items())]
    return lines


def _validation_section(report: Mapping[str, Any], preset: ModelPreset | None) -> list[str]:
    evaluation = report.get(preset.evaluation_name) if preset is not None else None
    if evaluation:
        return ["## Validation", "", *preset.card_section(evaluation)]
    if report.get(REPORT_KEY):
        return ["## Validation", "", *card_section(report[REPORT_KEY])]
    return ["## Validation", "", "None ran in this run; compare samples with the base model."]


def _usage_section(report: Mapping[str, Any], preset: ModelPreset | None, weights_name: str) -> list[str]:
    count = len(report.get("converted_layers", []))
    lines = [
        "## Use in ComfyUI",
        "",
        f"1. Put `{weights_name}` into `ComfyUI/models/t5_linearize/` (this card may go beside it as "
        f"`{card_name(weights_name)}`).",
        "2. Load the base model above with ComfyUI's own loader, connect its MODEL to the **T5 Linearize** node "
        f"(category T5) and pick `{weights_name}` as `weights`.",
        f"3. `layers`: empty converts all {count} modules of the file; a subset of them (a layer spec such as "
        "`joint:0-3` or `blocks.2.attn`, comma separated) trades speed for quality. `enabled` off gives the "
        "original model back.",
        "",
        "The file must match its base model: the node refuses a file made for another architecture, and the "
        "weights are only trained for the base model hashed above.",
        "",
        "This file has nothing to do with the `t5xxl` text encoder: T5 names the test-time-training attention "
        "here. SD3 still loads its T5-XXL text encoder (`models/text_encoders/`) as usual.",
    ]
    if preset is not None and preset.card_note:
        lines += ["", preset.card_note]
    return lines


def model_card(config: TrainConfig, report: Mapping[str, Any], *, weights_name: str) -> str:
    """The markdown model card of a run's weights file.

    Args:
        config: the run's resolved config.
        report: the run report (`report.json`): `step`, `stop_reason`, `last_step`, `processes`,
            `parameters`, and when present `converted_layers`, `base_sha256`, and the base preset's
            evaluation (under its `evaluation_name`) or the run's validation (`trainer.validation.REPORT_KEY`).
        weights_name: the weights file's name (`--output.name`).

    Returns:
        The card text, ending in a newline.
    """
    title = [
        f"{_TITLE}`{weights_name}`",
        "",
        "Trained T5 (linear-time test-time-training) attention for an SD3-family model, made by "
        "`trainer/run.py` of T5 Linearize (arXiv 2605.02772). Load it with the T5 Linearize node.",
    ]
    preset = get_preset(config.model.base)
    sections = (
        title,
        _base_section(config.model, report, preset),
        _conversion_section(config.model, report),
        _recipe_section(config, report),
        _training_section(report),
        _validation_section(report, preset),
        _usage_section(report, preset, weights_name),
    )
    return "\n\n".join("\n".join(section) for section in sections) + "\n"

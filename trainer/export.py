"""Final export: the T5 weights file (with `base.*` for fine-tuned inherited weights) and the run report.

Under FSDP2 the live parameters are shards, so the handle cannot be saved as it stands: every rank
takes part in gathering the full tensors it needs (the T5 parameters, the trained inherited weights
and the untrained parts that share an SD3 tensor with them, such as the rest of a fused qkv), and
rank 0 writes the file through `t5core.weights.save`. Which inherited tensors go in, and their SD3
names, come from `t5core.convert.base_sources` / `base_tensors`. DDP and one process take the same path.

`export_run`, `run_report` and `publish` are the trainer's last steps. With `--output.comfyui`, `comfyui_target`
checks the ComfyUI folder before training and `install_in_comfyui` copies the file and its model card into
`models/t5_linearize/` after it, atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from t5core.atomic import write_atomic, write_bytes_atomic, write_text_atomic
from t5core.attention import T5Attention, file_name
from t5core.convert import base_sources, base_tensors
from t5core.hosts.diffusers import T5Handle
from t5core.weights import save
from trainer.config import OutputConfig, TrainConfig
from trainer.distributed import World
from trainer.hub import HubTarget, push_to_hub
from trainer.model import ParamSplit, base_checkpoint_dtype
from trainer.model_card import RUN_CARD, base_digests, card_name, model_card, sha256_file

if TYPE_CHECKING:
    from trainer.loop import LoopResult
    from trainer.memory import MemoryPlan

__all__ = [
    "ComfyTarget",
    "comfyui_target",
    "export_run",
    "install_in_comfyui",
    "publish",
    "run_report",
    "t5_parameter_names",
    "write_report",
]

COMFYUI_FOLDER = Path("models") / "t5_linearize"
"""Where ComfyUI's T5 Linearize node lists weights files, relative to the ComfyUI folder."""

logger = logging.getLogger(__name__)


def t5_parameter_names(handle: T5Handle) -> dict[str, str]:
    """Model parameter name -> weights-file name `{module}.{param}` (`blocks.3.attn.w1` for the model's
    `....t5.fast.w1`) for every T5 parameter."""
    qualified = {id(module): name for name, module in handle.model.named_modules()}
    names: dict[str, str] = {}
    for module_name, module in handle.modules.items():
        prefix = qualified[id(module)]
        for param_name, _ in module.named_parameters():
            names[f"{prefix}.{param_name}"] = f"{module_name}.{file_name(param_name)}"
    return names


def _gather(model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """Full CPU copies of the named parameters (collective under FSDP2: every rank calls it alike)."""
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    out = {}
    for name in names:
        tensor = params[name].detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.to("cpu", torch.float32).clone()
    return out


def export_run(config: TrainConfig, handle: T5Handle, split: ParamSplit, world: World, *, steps: int) -> Path:
    """Write the T5 weights file `<output.dir>/<output.name>` of the trained student with the run's provenance
    (collective; rank 0 writes, through `t5core.weights.save`).

    Its `base.*` tensors are in the precision `--output.base_dtype` says: the base checkpoint's
    (`trainer.model.base_checkpoint_dtype`) or float32; T5 parameters stay float32.

    Returns:
        The file's path (on every rank).
    """
    base_dtype = torch.float32 if config.output.base_dtype == "fp32" else base_checkpoint_dtype(config.model)
    t5_names = t5_parameter_names(handle)
    base_names = base_sources(handle.arch, params=split.inherited)
    tensors = _gather(handle.model, sorted(t5_names) + list(base_names))
    path = Path(config.output.dir).expanduser() / config.output.name
    if not world.is_main:
        return path
    modules: dict[str, T5Attention] = {}
    for module_name in handle.modules:
        module = T5Attention.from_config(handle.config, handle.arch.heads, handle.arch.head_dim, layer=module_name)
        state = {
            t5_names[full].removeprefix(module_name + "."): tensors[full]
            for full in t5_names
            if t5_names[full].startswith(module_name + ".")
        }
        module.load_file_state(state)
        modules[module_name] = module
    base = {key: t.to(base_dtype) for key, t in base_tensors(tensors, handle.arch, params=split.inherited).items()}
    dtype_name = str(base_dtype).removeprefix("torch.")
    provenance = {
        "trainer": "trainer/run.py",
        "steps": steps,
        "base": config.model.base,
        "trainable": config.model.trainable,
        "data": config.data.source,
        "loss_weights": {key: getattr(config.loss, f"{key}_weight") for key in ("flow", "distill", "feature")},
        "base_dtype": dtype_name,
    }
    save(path, modules, arch=handle.arch, config=handle.config, base=base, provenance=provenance)
    logger.info("Export: %s (%d T5 modules, %d base tensors in %s)", path, len(modules), len(base), dtype_name)
    return path


def run_report(
    config: TrainConfig,
    result: LoopResult,
    *,
    weights: Path,
    world: World,
    handle: T5Handle,
    split: ParamSplit,
    memory: MemoryPlan,
    evaluation: dict[str, Any],
) -> dict[str, Any]:
    """The run's report: the loop's end, files, memory plan, what trained, the preset's `{name: evaluation}`."""
    output = weights.parent
    return {
        "step": result.step,
        "stop_reason": result.stop_reason,
        "loop_seconds": round(result.seconds, 2),
        "processes": world.world_size,
        "parallel": config.parallel.mode,
        "weights": str(weights),
        "config": str(output / "config.toml"),
        "metrics": str(output / "metrics.jsonl"),
        "last_step": result.last,
        "memory_plan_gib": {k: round(v, 3) for k, v in memory.components.items()},
        "parameters": {"new": len(split.new), "inherited": len(split.inherited), "frozen": len(split.frozen)},
        "converted_layers": list(handle.modules),
        **evaluation,
    }


def publish(
    config: TrainConfig,
    report: dict[str, Any],
    weights: Path,
    *,
    comfyui: ComfyTarget | None,
    hub: HubTarget | None,
) -> None:
    """Write the report and model card beside the weights (rank 0); install in ComfyUI and upload when asked."""
    output = weights.parent
    report = {**report, "base_sha256": base_digests(config.model)}
    write_report(output, report)
    card = model_card(config, report, weights_name=weights.name)
    write_text_atomic(output / RUN_CARD, card)
    if comfyui is not None:
        install_in_comfyui(comfyui, weights, card)
    if hub is not None:
        push_to_hub(hub, weights)


def _flatten(section: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """`{"a": {"b": 1}}` -> `[("a.b", 1)]`: a nested report section as rows of a two-column table."""
    rows: list[tuple[str, Any]] = []
    for key, value in section.items():
        if isinstance(value, dict):
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", f"{value:.4g}" if isinstance(value, float) else value))
    return rows


def _cell(value: Any) -> Any:
    """A report value as one line: a list's items joined by commas."""
    return ", ".join(map(str, value)) if isinstance(value, list) else value


def write_report(folder: str | Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """Write `report.json` and a short `report.md` of the run (each section a table), atomically."""
    folder = Path(folder)
    lines = [f"# T5 fine-tune report ({report['stop_reason']} stop after step {report['step']})", ""]
    lines += [f"* {key}: {_cell(value)}" for key, value in report.items() if not isinstance(value, dict)]
    for key, value in report.items():
        if isinstance(value, dict):
            lines += ["", f"## {key}", "", "| | |", "|---|---|"]
            lines += [f"| {name} | {cell} |" for name, cell in _flatten(value)]
    return (
        write_text_atomic(folder / "report.json", json.dumps(report, indent=1, default=str)),
        write_text_atomic(folder / "report.md", "\n".join(lines) + "\n"),
    )


@dataclass(frozen=True, slots=True)
class ComfyTarget:
    """Where `--output.comfyui` puts the weights file and its card, and what was there before the run.

    Attributes:
        weights, card: the two files in `<ComfyUI>/models/t5_linearize/`.
        found: sha256 of each file that existed when the run started (this run folder's own earlier
            export, the only thing the run may replace), None for a file that did not exist.
    """

    weights: Path
    card: Path
    found: dict[Path, str | None]


def _digest(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def _taken(path: Path) -> FileExistsError:
    return FileExistsError(
        f"{path} already exists and is not this run's export; nothing was written there. Choose another "
        "--output.name, or move that file away."
    )


def comfyui_target(output: OutputConfig) -> ComfyTarget | None:
    """Check `--output.comfyui` before training: a ComfyUI folder, writable, its file name free.

    A file of the same name may exist only as a copy of the export already in `--output.dir` (the same
    run trained again); any other file there is refused, so an install never silently replaces a file.

    Returns:
        The target, or None when `--output.comfyui` is not set.

    Raises:
        ValueError: the folder is not a ComfyUI folder (it has neither `models/` nor `main.py`).
        PermissionError: its `models/t5_linearize/` cannot be written.
        FileExistsError: a different file of the same name is already there.
    """
    if not output.comfyui:
        return None
    root = Path(output.comfyui).expanduser()
    if not ((root / "models").is_dir() or (root / "main.py").is_file()):
        raise ValueError(
            f"--output.comfyui {root} is not a ComfyUI folder (no models/ or main.py); give the folder that "
            "holds ComfyUI's models/."
        )
    folder = root / COMFYUI_FOLDER
    existing = next(path for path in (folder, folder.parent, root) if path.is_dir())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            f"--output.comfyui: {existing} is not writable, so {folder} cannot receive the weights file. Fix its "
            "permissions or give another ComfyUI folder."
        )
    run_folder = Path(output.dir).expanduser()
    target = ComfyTarget(folder / output.name, folder / card_name(output.name), {})
    for path, own in ((target.weights, run_folder / output.name), (target.card, run_folder / RUN_CARD)):
        found = _digest(path)
        if found is not None and found != _digest(own):
            raise _taken(path)
        target.found[path] = found
    return target


def install_in_comfyui(target: ComfyTarget, weights: Path, card: str) -> None:
    """Copy the exported weights file and write its card into ComfyUI's folder, each atomically.

    Raises:
        FileExistsError: a different file of the same name appeared there during the run.
    """
    card_bytes = card.encode("utf-8")
    new = {target.weights: sha256_file(weights), target.card: hashlib.sha256(card_bytes).hexdigest()}
    for path, digest in new.items():
        if _digest(path) not in (target.found[path], digest):
            raise _taken(path)
    write_atomic(target.weights, lambda temp: shutil.copyfile(weights, temp))
    write_bytes_atomic(target.card, card_bytes)
    logger.info("Export: installed %s and %s for ComfyUI", target.weights, target.card.name)

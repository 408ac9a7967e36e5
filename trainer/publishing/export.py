"""Final export: the T5 weights file (T5 parameters, and deltas for trained inherited weights) and the run report.

Under FSDP2 the live parameters are shards, so the handle cannot be saved as it stands: every rank
takes part in gathering the full tensors it needs (the T5 parameters and the trained inherited ones,
low-rank factors included), and rank 0 writes the file through `t5core.weights.save`. An inherited
weight's change is stored as a delta, never as its value, so the file adds to whatever base a host is
given (`t5core.deltas`): the factors of a low-rank delta, or the trained value minus the base value that
`record_base` kept before training. DDP and one process take the same path.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from t5core.atomic import write_atomic, write_bytes_atomic, write_text_atomic
from t5core.attention import T5Attention, file_name
from t5core.config import BaseArch
from t5core.deltas import Delta, sd3_deltas
from t5core.file_stamp import sha256_file
from t5core.hosts.diffusers import T5Handle
from t5core.sd3_keys import key_rules
from t5core.weights import save
from trainer.config import OutputConfig, TrainConfig
from trainer.distributed import World
from trainer.low_rank import factor_names
from trainer.model import ParamSplit, base_checkpoint_dtype
from trainer.publishing.hub import HubTarget, push_to_hub
from trainer.publishing.model_card import RUN_CARD, base_digests, card_name, model_card

if TYPE_CHECKING:
    from trainer.loop import LoopResult
    from trainer.planning.memory import MemoryPlan

__all__ = [
    "BaseRecord",
    "ComfyTarget",
    "complete_fused",
    "comfyui_target",
    "export_run",
    "install_in_comfyui",
    "publish",
    "record_base",
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


@dataclass(frozen=True)
class BaseRecord:
    """What the export needs of the base as loaded, taken before training changes it (on rank 0).

    Attributes:
        fingerprint: `t5core.deltas.fingerprint` of the base, stored in the file so a host can tell
            when it is given another base (a fine-tune of it, say).
        originals: the base values of the inherited parameters that train in full, on the CPU in the
            base checkpoint's precision (which holds them exactly); their change is a full delta.
        carried: the deltas of a run's start file (`--model.start_from`) of tensors the run does not train,
            exported as they are (`trainer.from_file.carried_deltas`).
    """

    fingerprint: str
    originals: dict[str, Tensor]
    carried: dict[str, Delta] = field(default_factory=dict)


def record_base(
    config: TrainConfig, handle: T5Handle, split: ParamSplit, world: World, *, fingerprint: str
) -> BaseRecord:
    """The `BaseRecord` of a converted model whose parameters have their roles but have not trained."""
    if not world.is_main:
        return BaseRecord(fingerprint, {})
    dtype = base_checkpoint_dtype(config.model)
    params = dict(handle.model.named_parameters())
    full = [name for name in split.inherited if name in params and not _is_factor(name)]
    originals = {name: value.to("cpu", dtype, copy=True) for name, value in handle.base_values(full).items()}
    return BaseRecord(fingerprint, originals, dict(split.carried))


def _is_factor(name: str) -> bool:
    return ".parametrizations." in name


def complete_fused(low_rank: dict[str, tuple[Tensor, Tensor]], full: dict[str, Tensor], arch: BaseArch) -> None:
    """Complete, in place, every fused qkv that changed in part (the last block's text q is frozen): each
    part without a delta gets a zero one in the form of a sibling's (q, k and v have one shape), so the
    fused tensor stays low rank where its trained parts are."""
    for rule in key_rules(arch):
        present = [name for name in rule.diffusers if name in low_rank or name in full]
        if not present or len(present) == len(rule.diffusers):
            continue
        for name in set(rule.diffusers) - set(present):
            if present[0] in low_rank:
                up, down = low_rank[present[0]]
                low_rank[name] = (torch.zeros_like(up), torch.zeros_like(down))
            else:
                full[name] = torch.zeros_like(full[present[0]])


def _deltas(
    handle: T5Handle, split: ParamSplit, record: BaseRecord, tensors: dict[str, Tensor], dtype: torch.dtype
) -> dict[str, Delta]:
    """The trained changes of the inherited weights as SD3-named `Delta`s, in `dtype`."""
    modules = dict(handle.model.named_modules())
    low_rank = {}
    for weight in split.low_rank:
        up, down = factor_names(weight)
        scale = modules[weight.removesuffix(".weight")].parametrizations.weight[0].scale
        low_rank[weight] = (scale * tensors[up], tensors[down])
    full = {name: tensors[name] - base.float() for name, base in record.originals.items()}
    # a tensor that did not change (all of them in a transfer-only run) needs no delta
    full = {name: diff for name, diff in full.items() if diff.any()}
    low_rank = {name: factors for name, factors in low_rank.items() if factors[0].any()}
    complete_fused(low_rank, full, handle.arch)
    low_rank = {name: (up.to(dtype), down.to(dtype)) for name, (up, down) in low_rank.items()}
    carried = {key: delta.to(dtype) for key, delta in record.carried.items()}
    return carried | sd3_deltas({name: diff.to(dtype) for name, diff in full.items()}, low_rank, handle.arch)


def export_run(
    config: TrainConfig, handle: T5Handle, split: ParamSplit, world: World, *, record: BaseRecord, steps: int
) -> Path:
    """Write the T5 weights file `<output.dir>/<output.name>` of the trained student with the run's provenance
    (collective; rank 0 writes, through `t5core.weights.save`).

    The file holds the T5 parameters (float32) and the change of every inherited weight that trained, as
    deltas (`t5core.deltas`): the factors of a low-rank delta (`--model.rank`), or the trained value minus
    the base's; both in the precision `--output.base_dtype` says (the base checkpoint's, or float32). It
    records the base's fingerprint.

    Returns:
        The file's path (on every rank).
    """
    base_dtype = torch.float32 if config.output.base_dtype == "fp32" else base_checkpoint_dtype(config.model)
    t5_names = t5_parameter_names(handle)
    tensors = _gather(handle.model, sorted(t5_names) + list(split.inherited))
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
    deltas = _deltas(handle, split, record, tensors, base_dtype)
    dtype_name = str(base_dtype).removeprefix("torch.")
    provenance = {
        "trainer": "trainer/run.py",
        "steps": steps,
        "base": config.model.base,
        "trainable": config.model.trainable,
        "rank": config.model.rank,
        "data": config.data.source,
        "loss_weights": {key: getattr(config.loss, f"{key}_weight") for key in ("flow", "distill", "feature")},
        "delta_dtype": dtype_name,
        **({"started_from": Path(config.model.start_from).name} if config.model.start_from else {}),
    }
    save(
        path,
        modules,
        arch=handle.arch,
        config=handle.config,
        deltas=deltas,
        fingerprint=record.fingerprint,
        provenance=provenance,
    )
    logger.info("Export: %s (%d T5 modules, %d deltas in %s)", path, len(modules), len(deltas), dtype_name)
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
            rows.append((f"{prefix}{key}", f"{value:.4g}" if isinstance(value, float) else _cell(value)))
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

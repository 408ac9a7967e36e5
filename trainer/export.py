"""Final export: the T5 weights file (with `base.*` for fine-tuned inherited weights) and the run report.

Under FSDP2 the live parameters are shards, so the handle cannot be saved as it stands: every rank
takes part in gathering the full tensors it needs (the T5 parameters, the trained inherited weights
and the untrained parts that share an SD3 tensor with them, such as the rest of a fused qkv), and
rank 0 writes the file through `t5core.weights.save`. Which inherited tensors go in, and their SD3
names, come from `t5core.convert.base_sources` / `base_tensors`. DDP and one process take the same path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from t5core.atomic import write_text_atomic
from t5core.attention import T5Attention
from t5core.convert import base_sources, base_tensors
from t5core.hosts.diffusers import T5Handle
from t5core.weights import save
from trainer.distributed import World
from trainer.model import ParamSplit

__all__ = ["export_weights", "t5_parameter_names", "write_report"]

logger = logging.getLogger(__name__)


def t5_parameter_names(handle: T5Handle) -> dict[str, str]:
    """Model parameter name -> `{module}.{param}` (`blocks.3.attn.w1`) for every T5 parameter."""
    qualified = {id(module): name for name, module in handle.model.named_modules()}
    names: dict[str, str] = {}
    for module_name, module in handle.modules.items():
        prefix = qualified[id(module)]
        for param_name, _ in module.named_parameters():
            names[f"{prefix}.{param_name}"] = f"{module_name}.{param_name}"
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


def export_weights(
    path: str | Path,
    handle: T5Handle,
    split: ParamSplit,
    world: World,
    *,
    provenance: dict[str, Any],
) -> Path | None:
    """Write the T5 weights file from the trained student (collective; rank 0 writes).

    Returns:
        The path on rank 0, None on other ranks.
    """
    t5_names = t5_parameter_names(handle)
    base_names = base_sources(handle.arch, params=split.inherited)
    tensors = _gather(handle.model, sorted(t5_names) + list(base_names))
    if not world.is_main:
        return None
    modules: dict[str, T5Attention] = {}
    for module_name in handle.modules:
        module = T5Attention.from_config(handle.config, handle.arch.heads, handle.arch.head_dim)
        state = {
            t5_names[full].removeprefix(module_name + "."): tensors[full]
            for full in t5_names
            if t5_names[full].startswith(module_name + ".")
        }
        module.load_state_dict(state, strict=True)
        modules[module_name] = module
    base = base_tensors(tensors, handle.arch, params=split.inherited)
    written = save(path, modules, arch=handle.arch, config=handle.config, base=base, provenance=provenance)
    logger.info("Export: %s (%d T5 modules, %d base tensors)", written, len(modules), len(base))
    return written


def write_report(folder: str | Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """Write `report.json` and a short `report.md` of the run, atomically."""
    folder = Path(folder)
    lines = [f"# T5 fine-tune report ({report['stop_reason']} stop after step {report['step']})", ""]
    lines += [f"* {key}: {value}" for key, value in report.items() if not isinstance(value, dict | list)]
    for key, value in report.items():
        if isinstance(value, dict):
            lines += ["", f"## {key}", ""] + [f"* {k}: {v}" for k, v in value.items()]
    written = []
    for name, text in (
        ("report.json", json.dumps(report, indent=1, default=str)),
        ("report.md", "\n".join(lines) + "\n"),
    ):
        written.append(write_text_atomic(folder / name, text))
    return written[0], written[1]

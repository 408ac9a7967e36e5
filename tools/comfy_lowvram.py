"""T5 Linearize under ComfyUI's partial (low-VRAM) load: every T5 parameter moved by ComfyUI's own
loader, none copied per call, and the latents of a full load.

    python -m tools.comfy_lowvram                    # the tree testing/comfy_env.py finds
    python -m tools.comfy_lowvram --comfyui PATH --results-dir DIR

Imports ComfyUI from the tree in this process (on CUDA when torch sees a GPU, else `--cpu`), loads a
tiny SD3.5-Medium-like checkpoint, converts every attention module with a T5 weights file, and runs
one model call twice: after a full load (`load_models_gpu`), then after ComfyUI's module-by-module
load with a weight budget of half the diffusion model (`ModelPatcher.patch_model(device,
lowvram_model_memory=...)`, what `load_models_gpu` runs under `--lowvram` or on a GPU short of
memory). The budget is set here because no GPU is short of memory for a tiny model, and a CPU
always loads fully. Checks, each recorded pass/fail with the evidence:

* partial_load: part of the diffusion model stayed on the offload device (the budget took effect);
* t5_loaded_by_comfyui: every T5 parameter belongs to a leaf module that ComfyUI loaded, and
  ComfyUI counts all of their bytes as loaded;
* t5_on_the_device: every T5 parameter is on the load device after the load;
* per_call_copies: T5 parameters copied to the device during the call (t5core logs each call at
  DEBUG); the goal is none. On a CPU load and offload device are one, so it holds trivially;
* matches_full_load: the latents equal those of the full load, to the bit.

Prints a table and writes `comfy_lowvram_<device>.json` (under `benchmarks/results/` unless
`--results-dir` says otherwise); exits 1 if a check failed.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import header_line, markdown_table, publish
from t5core.hosts.comfy_runtime import KEY
from testing import comfy_env, comfy_tiny
from testing.models import tiny_transformer
from tools.comfy_check import parse_check_args

TITLE = "ComfyUI partial (low-VRAM) load"

RUNTIME_LOGGER = "t5core.hosts.comfy_runtime"
PER_CALL = "for this call"
"""The phrase of t5core's DEBUG line for each call that copied T5 parameters."""


class _Records(logging.Handler):
    """Collects the log records of one logger (at DEBUG) while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _row(name: str, ok: bool, evidence: str) -> dict:
    return {"check": name, "ok": bool(ok), "evidence": evidence}


def run_check(base_dir: Path) -> tuple[list[dict], dict]:
    """Load, convert, run fully and partially loaded; the rows of the module docstring and facts for `meta`."""
    import comfy.model_management
    import comfy.sd

    from t5core.hosts.comfy import arch_of, linearize

    models = base_dir / "models"
    checkpoint = comfy_tiny.write_checkpoint(
        models / "diffusion_models" / "tiny_sd35m.safetensors", tiny_transformer(comfy_tiny.PRESET)
    )
    model = comfy.sd.load_diffusion_model(str(checkpoint))
    arch = arch_of(model)
    weights = comfy_tiny.write_t5_weights(
        models / "t5_linearize" / "tiny_all.safetensors", arch, arch.attention_modules()
    )
    patched = linearize(model, weights)
    inputs = comfy_tiny.inputs(batch=1)
    full = comfy_tiny.run(patched, inputs)

    budget = patched.model_size() // 2
    t5 = patched.additional_models[KEY][0]
    device = comfy.model_management.get_torch_device()
    logger = logging.getLogger(RUNTIME_LOGGER)
    records, level = _Records(), logger.level
    loaded = comfy_tiny.load_partially(patched, budget)
    try:
        lowvram = bool(getattr(patched.model, "model_lowvram", False))
        skipped = []
        for name, _ in t5.model.named_parameters():
            owner = t5.model.get_submodule(name.rpartition(".")[0])
            if list(owner.children()) or not getattr(owner, "comfy_patched_weights", False):
                skipped.append(name)
        counted = (t5.loaded_size(), t5.model_size())
        elsewhere = [name for name, p in t5.model.named_parameters() if p.device != torch.device(device)]
        logger.addHandler(records)
        logger.setLevel(logging.DEBUG)
        try:
            partial = comfy_tiny.run_loaded(patched, inputs)
        finally:
            logger.removeHandler(records)
            logger.setLevel(level)
    finally:
        comfy_tiny.unload(loaded)
    copies = [record.getMessage() for record in records.records if PER_CALL in record.getMessage()]
    difference = float((partial - full).abs().max())
    rows = [
        _row("partial_load", lowvram, f"budget {budget / 2**20:.2f} MiB of {patched.model_size() / 2**20:.2f} MiB"),
        _row(
            "t5_loaded_by_comfyui",
            not skipped and counted[0] == counted[1],
            f"skipped {skipped[:4] or 'none'}; loaded {counted[0]} of {counted[1]} bytes",
        ),
        _row("t5_on_the_device", not elsewhere, f"not on {device}: {elsewhere[:4] or 'none'}"),
        _row("per_call_copies", not copies, f"{len(copies)} calls copied T5 parameters: {copies[:3] or 'none'}"),
        _row("matches_full_load", difference == 0.0, f"max |partial - full| {difference:.3g}"),
    ]
    meta = {"budget_bytes": budget, "t5_bytes": counted[1], "copy_lines": copies}
    return rows, meta


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table of the checks (`python -m benchmarks.report` renders it)."""
    rows = [[item["check"], "ok" if item["ok"] else "FAIL", item["evidence"]] for item in result["rows"]]
    intro = (
        "T5 Linearize under ComfyUI's partial (low-VRAM) load with a weight budget of half the model, against a "
        "full load."
    )
    return [intro, "", *markdown_table(["check", "result", "evidence"], rows)]


def main(argv: list[str] | None = None) -> int:
    args = parse_check_args(__doc__.split("\n\n")[0], argv)
    tree = args.tree
    cuda = torch.cuda.is_available()
    print(header_line())
    with tempfile.TemporaryDirectory(prefix="t5-lowvram-") as temp:
        comfy_env.import_comfy(tree.resolve(), Path(temp), cpu=not cuda)
        rows, meta = run_check(Path(temp))
    name = f"comfy_lowvram_{'cuda' if cuda else 'cpu'}"
    publish(name, rows, {"comfyui": str(tree), **meta}, table=table, directory=args.results_dir)
    return 0 if all(item["ok"] for item in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

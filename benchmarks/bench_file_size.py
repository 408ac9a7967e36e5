"""How big is a T5 weights file? Per model, layer spec, `--model.trainable` and `--model.rank`, with the
deltas in the base checkpoint's precision (`--output.base_dtype base`, the default) and in fp32.

    python -m benchmarks.bench_file_size [--json]
    python -m benchmarks.bench_file_size --toy-weights runs/toy/t5.safetensors [--samples 180] [--json]

Builds each model on the meta device (no weights: the toy from its config, SD3.5 Medium and Large
from the shipped configs), converts it with the `paper` spec and with `all` hybrid (full linear time),
splits the parameters as the trainer does (`trainer.model.split_parameters`) and builds the deltas the
export would write (`trainer.publishing.export`: rank-r factors for each trained weight matrix under `--model.rank r`,
full deltas otherwise and for vectors, fused qkv completed) from meta tensors of the right shapes. The
file holds the new T5 parameters in fp32 and those deltas. Sizes are tensor bytes; the safetensors header
adds a few KiB. The base precision is the toy file's (float16, read by
`trainer.model.base_checkpoint_dtype`) and 16-bit for the released SD3.5 checkpoints (float16 or
bfloat16: two bytes either way). Before counting, the SD3.5 parameter totals are checked against the
released models; a mismatch prints FAIL instead of sizes.

`--toy-weights` also measures what the smaller file costs on the toy: a toy T5 file exported with fp32
deltas (`python trainer/run.py --output.base_dtype fp32`) is re-saved with its deltas rounded to the
toy's float16, and both files are loaded into the toy base and scored the same way (ToyEval on
`--samples` captions from the same noise, and the validation loss on its fixed batches), with the RMS
pixel difference between the two sets of samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_trainer_memory import PUBLISHED_PARAMS, meta_model, parameter_check
from benchmarks.timing import header_line, markdown_table, publish
from t5core.config import T5Config
from t5core.deltas import sd3_deltas
from t5core.hosts.diffusers import linearize
from testing.models import shipped_config
from trainer.config import ModelConfig, OptimConfig
from trainer.low_rank import low_rank_names
from trainer.model import base_checkpoint_dtype, split_parameters
from trainer.publishing.export import complete_fused

TITLE = "T5 weights file size"
SPECS = {"paper": {"layers": "paper"}, "all hybrid": {"layers": "all", "joint_mode": "hybrid"}}
"""The layer specs measured: the paper's, and full linear time."""
CHOICES = (("t5", 0), ("attention", 0), ("attention", 16), ("all", 0), ("all", 16))
"""(`--model.trainable`, `--model.rank`) pairs: 0 = full deltas."""
SD35_BASE_DTYPE = "16-bit"
"""The released SD3.5 checkpoints store their weights in two bytes each (float16 or bfloat16)."""


def delta_elements(handle, split, rank: int) -> int:
    """Elements of the deltas the export writes for this split at `--model.rank rank` (0: full)."""
    params = dict(handle.model.named_parameters())
    matrices = low_rank_names(handle.model, split.inherited) if rank else ()
    low_rank = {}
    for name in matrices:
        rows, cols = params[name].shape
        r = min(rank, rows, cols)
        low_rank[name] = (torch.empty(rows, r, device="meta"), torch.empty(r, cols, device="meta"))
    full = {name: torch.empty(params[name].shape, device="meta") for name in split.inherited if name not in low_rank}
    complete_fused(low_rank, full, handle.arch)
    deltas = sd3_deltas(full, low_rank, handle.arch)
    return sum(t.numel() for delta in deltas.values() for t in delta.stored().values())


def file_sizes(model, *, base_bytes: int) -> list[dict]:
    """One row per layer spec and (`--model.trainable`, `--model.rank`): parameter counts and tensor bytes."""
    rows = []
    for spec, settings in SPECS.items():
        config = T5Config(joint_mode=settings.get("joint_mode", "ttt"))
        for trainable, rank in CHOICES:
            handle = linearize(model, config=config, layers=settings["layers"])
            split = split_parameters(handle, ModelConfig(trainable=trainable), OptimConfig())
            params = dict(handle.model.named_parameters())
            new = sum(params[name].numel() for name in split.new)
            deltas = delta_elements(handle, split, rank)
            handle.remove()
            row = {"layers": spec, "modules": len(handle.modules), "trainable": trainable, "rank": rank}
            sizes = {"bytes_fp32": 4 * (new + deltas), "bytes_base": 4 * new + base_bytes * deltas}
            rows.append({**row, "t5_params": new, "delta_params": deltas, **sizes})
    return rows


def toy_cost(path: Path, *, samples: int) -> tuple[list[dict], float]:
    """ToyEval and validation loss of a toy T5 file as written (fp32 deltas) and with its deltas rounded
    to the toy's precision.

    Returns:
        One row per precision, and the RMS pixel difference between their samples.

    Raises:
        ValueError: the file has no deltas, or not in fp32.
    """
    from sd3_testbed.eval import teacher_distance, toy_eval, validation_loss
    from sd3_testbed.model import load_toy_base
    from t5core import weights as t5w

    loaded = t5w.load(path)
    stored = [t for delta in loaded.deltas.values() for t in delta.stored().values()]
    if not stored or any(t.dtype != torch.float32 for t in stored):
        raise ValueError(
            f"{path}: --toy-weights needs a toy file with fp32 deltas; train one with "
            "`python trainer/run.py --output.base_dtype fp32`."
        )
    dtype = base_checkpoint_dtype(ModelConfig())
    rounded_deltas = {
        key: dataclasses.replace(delta, **{name: t.to(dtype) for name, t in delta.stored().items()})
        for key, delta in loaded.deltas.items()
    }
    rows, images = [], []
    with tempfile.TemporaryDirectory(prefix="t5-file-size-") as temp:
        kept = {name: getattr(loaded, name) for name in ("arch", "config", "fingerprint", "provenance")}
        modules = t5w.build_modules(loaded, loaded.config.layers)
        rounded = t5w.save(Path(temp) / path.name, modules, deltas=rounded_deltas, **kept)
        for name, file in (("float32", path), (str(dtype).removeprefix("torch."), rounded)):
            student = linearize(load_toy_base(), weights=file).model.eval()
            score, sampled = toy_eval(student, count=samples)
            images.append(sampled)
            row = {"delta_dtype": name, "file_bytes": file.stat().st_size, **score.as_dict()}
            rows.append(row | {"val_loss": validation_loss(student)})
    return rows, teacher_distance(images[1], images[0])


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def main() -> None:
    from sd3_testbed.model import TOY_CONFIG

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/file_size.json")
    parser.add_argument("--toy-weights", type=Path, help="a toy T5 file with fp32 deltas: measure the cost")
    parser.add_argument("--samples", type=int, default=180, help="ToyEval captions for --toy-weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    print(header_line())
    toy_dtype = str(base_checkpoint_dtype(ModelConfig())).removeprefix("torch.")
    models = {"toy": (TOY_CONFIG, toy_dtype, torch.finfo(getattr(torch, toy_dtype)).bits // 8)}
    models.update({name: (shipped_config(name), SD35_BASE_DTYPE, 2) for name in PUBLISHED_PARAMS})
    rows = []
    for name, (config, dtype, base_bytes) in models.items():
        model = meta_model(config)
        if name in PUBLISHED_PARAMS and (failure := parameter_check(name, model)):
            rows.append({"model": name, "status": failure})
            continue
        rows += [{"model": name, "base_dtype": dtype, **row} for row in file_sizes(model, base_bytes=base_bytes)]
    meta: dict = {"specs": SPECS, "sd35_base_dtype": SD35_BASE_DTYPE}
    if args.toy_weights is not None:
        cost, distance = toy_cost(args.toy_weights, samples=args.samples)
        meta.update(toy_weights=str(args.toy_weights), toy_cost=cost, toy_sample_rms_difference=distance)
    publish("file_size", rows, meta, table=table, write=args.json)


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: file sizes per model, spec, trained weights and rank; the toy's cost below."""
    meta = result["meta"]
    intro = (
        "Tensor bytes of the exported T5 weights file per layer spec, `--model.trainable` and `--model.rank` (full: "
        "full deltas): the T5 parameters in fp32 and the deltas of trained inherited weights in fp32 "
        "(`--output.base_dtype fp32`) or in the base checkpoint's precision (`--output.base_dtype base`, the default)."
    )
    rows = []
    for row in result["rows"]:
        if "status" in row:
            rows.append([row["model"], row["status"]])
            continue
        params = [f"{row['t5_params'] / 1e6:.2f}M", f"{row['delta_params'] / 1e6:.1f}M"]
        sizes = [_size(row["bytes_fp32"]), f"{_size(row['bytes_base'])} ({row['base_dtype']})"]
        rows.append([row["model"], row["layers"], row["trainable"], str(row["rank"] or "full"), *params, *sizes])
    header = ["model", "layers", "trainable", "rank", "T5 params", "delta params", "file, fp32 deltas",
              "file, base precision"]  # fmt: skip
    lines = [intro, "", *markdown_table(header, rows)]
    if "toy_cost" in meta:
        scores = ("overall", "color", "shape", "position", "size")
        cost = [
            [row["delta_dtype"], _size(row["file_bytes"]), *(f"{row[name]:.3f}" for name in scores)]
            + [f"{row['val_loss']:.6f}"]
            for row in meta["toy_cost"]
        ]
        note = (
            f"What the smaller file costs on the toy: `{meta['toy_weights']}` as exported (fp32 deltas) and with its "
            f"deltas rounded to float16, ToyEval from the same noise; the two files' samples differ by "
            f"{meta['toy_sample_rms_difference']:.4f} RMS (pixels in [0, 1])."
        )
        header = ["deltas", "file", "ToyEval overall", "color", "shape", "position", "size", "val loss"]
        lines += ["", note, "", *markdown_table(header, cost)]
    return lines


if __name__ == "__main__":
    main()

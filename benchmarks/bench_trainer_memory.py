"""How much memory per GPU does the T5 fine-tune of SD3.5 Medium / Large need on 4 x 96 GB?

    python -m benchmarks.bench_trainer_memory [--gpus 4] [--gpu-gib 96] [--resolution 1024] [--batch 4]

Builds each model on the meta device from the shipped configs (no weights, no downloads), converts it
with the `paper` layer spec, splits the parameters exactly as the trainer does, and prints the
trainer's memory plan (`trainer.planning.memory.plan_memory`) for full and attention-only fine-tunes under
DDP and FSDP2, with and without the frozen teacher. The softmax column plans the same fine-tune of
the unconverted model, so the ratio shows what T5 itself adds. Before planning, the parameter counts
are checked against the published model sizes; a mismatch prints FAIL instead of numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import logging
from typing import Any

import torch

from benchmarks.timing import header_line, markdown_table, publish
from t5core.hosts.diffusers import linearize
from testing.models import shipped_config
from trainer.config import ModelConfig, OptimConfig
from trainer.model import split_parameters
from trainer.planning.memory import PlanSettings, count_parameters, plan_memory
from trainer.planning.time_estimate import ParamCounts, RunShape

TITLE = "Trainer memory plan"
PUBLISHED_PARAMS = {"sd3.5_medium": 2_243_171_520, "sd3.5_large": 8_056_627_520}
"""Parameter counts of the released transformers, which the models built from `trainer/configs/models` must match."""
CLIP_TOKENS = 77
T5_TOKENS = 256
TEXT_TOKENS = CLIP_TOKENS + T5_TOKENS
"""SD3's CLIP + T5 context at the default `--data.max_sequence_length`."""
VAE_FACTOR = 8


def meta_model(config: dict):
    """An `SD3Transformer2DModel` of `config` on the meta device: no memory, no weights."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        return SD3Transformer2DModel(**config)


def parameter_check(name: str, model) -> str | None:
    """None when a released model `name` has its published parameter count, else a FAIL saying both."""
    total = sum(p.numel() for p in model.parameters())
    published = PUBLISHED_PARAMS[name]
    return None if total == published else f"FAIL: {total:,} parameters, the released model has {published:,}"


def run_shape(config, resolution: int, batch: int) -> RunShape:
    """The shape of one step of an SD3 transformer (its `config`) at `resolution` px with SD3's text tokens."""
    side = resolution // (VAE_FACTOR * config["patch_size"])
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    return RunShape(
        batch_per_rank=batch, image_tokens=side**2, text_tokens=TEXT_TOKENS, hidden=hidden, depth=config["num_layers"]
    )


def _counts(model, trainable: str) -> tuple[ParamCounts, ParamCounts]:
    """Counts for the T5 fine-tune (`paper` layers) and for the same fine-tune without the T5 parameters."""
    handle = linearize(model, layers="paper")
    split = split_parameters(handle, ModelConfig(trainable=trainable), OptimConfig())
    counts = count_parameters(handle, split)
    params = dict(handle.model.named_parameters())
    new = sum(params[n].numel() for n in split.new)
    handle.remove()
    return counts, dataclasses.replace(counts, trained=counts.trained - new)


def _plan_rows(name: str, model, args: argparse.Namespace) -> list[dict]:
    """The plans of one released model: per trained weights, mode and teacher, T5 against softmax."""
    shape = run_shape(model.config, args.resolution, args.batch)
    total = sum(p.numel() for p in model.parameters())
    settings_of = functools.partial(PlanSettings, world_size=args.gpus, precision="bf16", gradient_checkpointing=True)
    rows = []
    for trainable in ("all", "attention"):
        # The softmax baseline fine-tunes the same weights of the unconverted model.
        t5_counts, softmax_counts = _counts(model, trainable)
        for mode, teacher in itertools.product(("ddp", "fsdp2"), (False, True)):
            settings = settings_of(mode=mode, teacher_params=total if teacher else 0)
            plan = plan_memory(t5_counts, shape, settings, budget_gib=args.gpu_gib)
            base_gib = plan_memory(softmax_counts, shape, settings).total_gib
            row = dict(model=name, trainable=trainable, mode=mode, teacher=teacher, t5_gib=round(plan.total_gib, 2))
            components = {k: round(v, 2) for k, v in plan.components.items()}
            rows.append(row | dict(softmax_gib=round(base_gib, 2), fits=plan.fits, components=components))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--gpu-gib", type=float, default=96.0)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="samples per GPU")
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/trainer_memory.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    print(header_line())
    rows = []
    for name in PUBLISHED_PARAMS:
        model = meta_model(shipped_config(name))
        failure = parameter_check(name, model)
        rows += [dict(model=name, status=failure)] if failure else _plan_rows(name, model, args)
    publish("trainer_memory", rows, vars(args), table=table, write=args.json)


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: the plan per model and trained weights, per mode, with and without the teacher."""
    meta = result["meta"]
    intro = (
        f"The trainer's memory plan per GPU (an estimate, not a measurement): {meta['gpus']} GPUs x "
        f"{meta['gpu_gib']:g} GiB, {meta['resolution']} px, batch {meta['batch']} per GPU, bf16, gradient "
        "checkpointing, `paper` layers."
    )
    plans = {(r["model"], r["trainable"], r["mode"], r["teacher"]): r for r in result["rows"] if "t5_gib" in r}
    rows = [[r["model"], r["status"], "", "", "", ""] for r in result["rows"] if "status" in r]
    for model, trainable in dict.fromkeys((r["model"], r["trainable"]) for r in plans.values()):
        cells = []
        for mode, teacher in [("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True)]:
            plan = plans[(model, trainable, mode, teacher)]
            cells.append(f"{plan['t5_gib']:.1f} GiB" + ("" if plan["fits"] else " (does not fit)"))
        rows.append([model, trainable, *cells])
    extra = [100 * (r["t5_gib"] / r["softmax_gib"] - 1) for r in plans.values()]
    header = ["model", "trains", "DDP", "DDP + teacher", "FSDP2", "FSDP2 + teacher"]
    note = f"T5 adds {min(extra):.1f}-{max(extra):.1f} % over the same fine-tune of the softmax model." if extra else ""
    return [intro, "", *markdown_table(header, rows), "", note]


if __name__ == "__main__":
    main()

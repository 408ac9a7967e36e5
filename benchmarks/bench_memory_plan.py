"""Is the trainer's memory plan right? One real SD3.5 Medium training step on CPU, measured against it.

    python -m benchmarks.bench_memory_plan [--resolution 256] [--json]

A fresh subprocess builds SD3.5 Medium's real transformer (the shipped config, random fp32 weights, as
`load_base` returns a checkpoint), converts it and runs the trainer's own steps on the recipe
`trainer/configs/sd35_medium_24gb.toml` with the `paper` layers (`PAPER_LAYERS`, the recipe the measurement
in benchmarks/README.md was made with; `attention` trainable, bf16: frozen weights
stored in bf16, bf16 autocast, AdamW, DDP over a world of one) at `--resolution`, batch 1: one step
without and one with gradient checkpointing, on random latents and text features of SD3.5's shapes.
It reads the process's resident memory from /proc: the baseline after the imports, the peak while
building and converting the model (the fp32 weights), and the peak of each step (the high-water mark
is reset before each phase). The parent prints each measured peak beside
`trainer.planning.memory.plan_memory` for the same settings, with no runtime margin (no CUDA context on
CPU), and marks a miss over 15%. Loading is compared as the device holds the student once it is there:
the settled memory after `parallelize` has cast the frozen weights.

Data preparation's phases run in children of their own, in the CPU pipeline's fp32 at
`--preparation-resolution`, beside `trainer.planning.run_plan`'s estimates: SD3's VAE encoding
`VAE_IMAGES` images in one call and decoding `trainer.validation.DECODE_BATCH` as validation does; the
three text encoders on `CAPTIONS` captions of their full token length; SD3.5 Medium's frozen
transformer on one guided call of `GENERATED` prompts.

How CPU accounting differs from CUDA's: resident memory counts pages in use, like CUDA's allocated
memory rather than its reserved memory, because the child runs with a fixed glibc mmap threshold
(`MMAP_THRESHOLD`: torch's CPU allocator caches nothing). There is no CUDA context, cuBLAS workspace
or NCCL buffer (the plan's runtime margin covers those on a GPU), and the baseline (Python, torch,
diffusers) is subtracted. On a GPU the base is read and cast on the host, then moved; here the host
and the device are one memory, so the load peak is the fp32 model itself. CPU autocast casts the
same matmuls and convolutions to bf16 as CUDA's does; the kernels and their workspaces differ
(oneDNN vs cuBLAS / cuDNN, SDPA's CPU flash kernel vs CUDA's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_trainer_memory import T5_TOKENS, TEXT_TOKENS, VAE_FACTOR, run_shape
from benchmarks.cases import sd3_inputs
from benchmarks.step_probes import reset_peak_resident, status_kib
from benchmarks.timing import REPO_ROOT, header_line, markdown_table, publish
from testing.models import sd35_medium_config
from trainer.inputs.sources import PARTS_CONFIG_DIR
from trainer.planning.memory import GIB, PlanSettings, plan_memory
from trainer.planning.run_plan import (
    VAE_DECODE_LIVE_WIDTHS,
    EncoderCounts,
    generation_gib,
    text_activations_gib,
    vae_activations_gib,
)
from trainer.planning.time_estimate import ParamCounts, RunShape
from trainer.validation import DECODE_BATCH

TITLE = "Memory plan vs a measured step"
RECIPE = REPO_ROOT / "trainer" / "configs" / "sd35_medium_24gb.toml"
PAPER_LAYERS = ("--model.layers", "paper", "--model.joint_mode", "ttt")
"""The layers measured on top of `RECIPE`: the paper's, as the committed measurement was made."""
TOLERANCE = 0.15
"""The plan must come within 15% of the measured peak."""
VAE_IMAGES = 2
"""Images in the measured VAE call."""
CAPTIONS = 16
"""Captions in the measured text-encoder calls."""
T5_LAYERS = 2
"""T5-XXL encoder layers built for the text phase (of 24): the plan is linear in its weights, checked in full
by the CLIP encoders."""
GENERATED = 2
"""Prompts in the measured guided generation call (twice as many samples)."""
MMAP_THRESHOLD = str(128 * 1024)
"""glibc serves every allocation above this from mmap and unmaps it on free (no cached heap pages)."""


def _gib_since(baseline_kib: int) -> float:
    return (status_kib("VmHWM") - baseline_kib) * 1024 / GIB


class _RandomSource:
    """One random sample with the shapes of an SD3 transformer's inputs (its `config`) at `resolution` px."""

    def __init__(self, config: dict, resolution: int) -> None:
        inputs = sd3_inputs(config, batch=1, resolution=resolution, text=TEXT_TOKENS, seed=0)
        self.latents, self.context = inputs["hidden_states"], inputs["encoder_hidden_states"]
        self.pooled = inputs["pooled_projections"]

    def buckets(self) -> dict[tuple[int, int], list[int]]:
        return {tuple(self.latents.shape[2:]): [0]}

    def load(self, indices: list[int]):
        from trainer.data import Batch

        return Batch(*(t.expand(len(indices), *t.shape[1:]) for t in (self.latents, self.context, self.pooled)))

    def uncond(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(self.context[0]), torch.zeros_like(self.pooled[0])


def _measure(resolution: int) -> dict:
    """The child: build, convert, wrap and train as `trainer.train.run` does; peaks in GiB above the baseline."""
    from diffusers import SD3Transformer2DModel

    from trainer.checkpoint import CheckpointManager
    from trainer.cli import parse_args
    from trainer.data import BatchPlan
    from trainer.distributed import init_world
    from trainer.loop import TrainParts, train_step
    from trainer.metrics import MetricsWriter
    from trainer.model import build_model
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.parallelize import apply_activation_checkpointing, parallelize
    from trainer.planning.memory import count_parameters

    flags = ["--config", str(RECIPE), *PAPER_LAYERS, "--model.base", "random SD3.5 Medium", "--data.source", "cache"]
    flags += ["--data.path", "(in memory)", "--training.gradient_checkpointing", "false", "--parallel.device", "cpu"]
    flags += ["--training.batch_size", "1", "--training.accumulate", "1"]
    config = parse_args(flags + ["--data.resolution", str(resolution)])
    torch.set_num_threads(config.training.threads)
    baseline = status_kib("VmRSS")
    reset_peak_resident()

    torch.manual_seed(0)
    arch = sd35_medium_config()
    base = SD3Transformer2DModel(**arch).eval()
    handle, split = build_model(base, config)
    result = {"baseline_gib": baseline * 1024 / GIB, "load_gib": _gib_since(baseline)}
    counts = count_parameters(handle, split)

    world = init_world(config.parallel)
    student = handle.model.to(world.device).train()
    model = parallelize(student, None, training=config.training, parallel=config.parallel, world=world)
    optimizer = build_optimizer(model, split, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, steps=config.training.steps)
    source = _RandomSource(arch, resolution)
    with tempfile.TemporaryDirectory() as scratch:
        parts = TrainParts(
            config=config, world=world, model=model, optimizer=optimizer, scheduler=scheduler, source=source,
            plan=BatchPlan(source.buckets(), batch_size=1, seed=0),
            checkpoints=CheckpointManager(Path(scratch) / "checkpoints", world, keep=1),
            metrics=MetricsWriter(Path(scratch) / "metrics.jsonl", enabled=False),
        )  # fmt: skip
        result["settled_gib"] = (status_kib("VmRSS") - baseline) * 1024 / GIB
        for step, checkpointing in enumerate((False, True)):
            if checkpointing:
                apply_activation_checkpointing(student)
            reset_peak_resident()
            start = time.perf_counter()
            loss = train_step(parts, step)["loss/total"]
            peak_gib, seconds = _gib_since(baseline), time.perf_counter() - start
            result[f"step_ckpt{int(checkpointing)}"] = dict(peak_gib=peak_gib, seconds=seconds, loss=loss)
    world.close()
    shape = dataclasses.asdict(run_shape(arch, resolution, batch=1))
    return {**result, "counts": dataclasses.asdict(counts), "shape": shape, "mode": config.parallel.mode}


def _measure_preparation(phase: str, resolution: int) -> dict:
    """The child for one preparation phase, in the CPU pipeline's fp32: its modules built from SD3's shipped
    configs with random weights, run without gradients as `trainer.inputs.prepare` runs them; peak GiB above the
    baseline (taken before the modules are built) and the plan's inputs."""
    baseline = status_kib("VmRSS")
    reset_peak_resident()
    torch.manual_seed(0)
    with torch.no_grad():
        if phase in ("vae", "decode"):
            inputs = _vae_phase(resolution, decode=phase == "decode")
        else:
            inputs = _text_phase() if phase == "text" else _generation_phase(resolution)
    return {"baseline_gib": baseline * 1024 / GIB, "peak_gib": _gib_since(baseline), **inputs}


def _vae_phase(resolution: int, *, decode: bool) -> dict:
    """SD3's VAE encoding `VAE_IMAGES` images, or decoding `DECODE_BATCH` latents, at `resolution` px."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_config(json.loads((PARTS_CONFIG_DIR / "vae" / "config.json").read_text())).eval()
    latent = resolution // VAE_FACTOR
    if decode:
        vae.decode(torch.randn(DECODE_BATCH, vae.config.latent_channels, latent, latent))
    else:
        vae.encode(torch.randn(VAE_IMAGES, 3, resolution, resolution))
    return {"vae_params": sum(p.numel() for p in vae.parameters()), "vae_width": vae.config.block_out_channels[0]}


def _text_phase() -> dict:
    """CLIP-L and CLIP-G at full size, T5-XXL's encoder cut to `T5_LAYERS` layers (its 19 GiB in fp32 do not fit
    this machine beside the others), each run on `CAPTIONS` captions of its full token length, one after another."""
    from transformers import AutoConfig, CLIPTextModelWithProjection, T5EncoderModel

    params, tokens, widths, heads, kept = 0, [], [], [], []
    for sub in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        config = AutoConfig.from_pretrained(PARTS_CONFIG_DIR / sub)
        if config.model_type == "t5":
            config.num_layers = T5_LAYERS
            model, length = T5EncoderModel(config).eval(), T5_TOKENS
            widths.append(config.d_ff), heads.append(config.num_heads), kept.append(0)
        else:
            model, length = CLIPTextModelWithProjection(config).eval(), config.max_position_embeddings
            widths.append(config.intermediate_size), heads.append(config.num_attention_heads)
            kept.append((config.num_hidden_layers + 1) * config.hidden_size)
        params += sum(p.numel() for p in model.parameters())
        tokens.append(length)
        ids = torch.randint(0, config.vocab_size, (CAPTIONS, length))
        model(ids, output_hidden_states=config.model_type != "t5")
    return {"text_params": params, "text_tokens": tokens, "text_widths": widths, "text_heads": heads, "text_kept": kept}


def _generation_phase(resolution: int) -> dict:
    """SD3.5 Medium's transformer, frozen, on one guided call of `GENERATED` prompts (twice as many samples)."""
    from diffusers import SD3Transformer2DModel

    arch = sd35_medium_config()
    model = SD3Transformer2DModel(**arch).eval().requires_grad_(False)
    samples = 2 * GENERATED
    model(**sd3_inputs(arch, batch=samples, resolution=resolution, text=TEXT_TOKENS))
    return {
        "weights": sum(p.numel() for p in model.parameters()),
        "buffers": sum(b.numel() for b in model.buffers()),
        "shape": dataclasses.asdict(run_shape(arch, resolution, batch=samples)),
    }


def _preparation_rows(resolution: int) -> list[dict]:
    """Each preparation phase measured in its own child, beside `trainer.planning.run_plan`'s estimate (fp32, no
    margin)."""
    vae = _run_child(resolution, "vae")
    counts = EncoderCounts(
        text_params=0, text_tokens=(), text_widths=(), text_heads=(), text_kept=(), vae_params=vae["vae_params"],
        vae_width=vae["vae_width"], vae_factor=VAE_FACTOR,
    )  # fmt: skip
    vae_plan = (vae["vae_params"] * 4) / GIB + vae_activations_gib(counts, VAE_IMAGES, resolution**2, dtype_bytes=4)
    decode = _run_child(resolution, "decode")
    decode_plan = (decode["vae_params"] * 4) / GIB + vae_activations_gib(
        counts, DECODE_BATCH, resolution**2, dtype_bytes=4, widths=VAE_DECODE_LIVE_WIDTHS
    )
    text = _run_child(resolution, "text")
    # the text child reports EncoderCounts' text fields by name (JSON lists for its tuples)
    text_fields = {name: tuple(value) if isinstance(value, list) else value for name, value in text.items()}
    text_counts = dataclasses.replace(counts, **{name: text_fields[name] for name in text if name.startswith("text_")})
    text_plan = text["text_params"] * 4 / GIB + text_activations_gib(text_counts, CAPTIONS, dtype_bytes=4)
    generation = _run_child(resolution, "generate")
    weights = ParamCounts(trained=0, frozen=generation["weights"], buffers=generation["buffers"], largest_block=0)
    generation_plan = generation_gib(weights, RunShape(**generation["shape"]), dtype_bytes=4)
    phases = {
        f"preparation: VAE encoding {VAE_IMAGES} images": (vae_plan, vae),
        f"validation: fp32 VAE decoding {DECODE_BATCH} image": (decode_plan, decode),
        f"preparation: text encoders, {CAPTIONS} captions (T5 at {T5_LAYERS} of 24 layers)": (text_plan, text),
        f"preparation: generating, {2 * GENERATED} samples": (generation_plan, generation),
    }
    return [_row(phase, plan, child["peak_gib"]) for phase, (plan, child) in phases.items()]


def _training_rows(measured: dict) -> list[dict]:
    """Loading and the train step without and with checkpointing: the plan beside the training child's peaks."""
    counts, shape = ParamCounts(**measured["counts"]), RunShape(**measured["shape"])
    rows = []
    for checkpointing in (False, True):
        settings = PlanSettings(
            mode=measured["mode"], world_size=1, precision="bf16", gradient_checkpointing=checkpointing
        )
        plan = plan_memory(counts, shape, settings, runtime_margin_gib=0.0)
        if not rows:
            rows.append(_row("loading: on the device, frozen cast", plan.load_gib, measured["settled_gib"]))
        step = measured[f"step_ckpt{int(checkpointing)}"]
        components = {k: round(v, 3) for k, v in plan.components.items()}
        phase = f"train step, checkpointing {'on' if checkpointing else 'off'}"
        extra = dict(seconds=round(step["seconds"], 1), components=components)
        rows.append(_row(phase, sum(plan.components.values()), step["peak_gib"], **extra))
    return rows


def _row(phase: str, plan_gib: float, measured_gib: float, **extra: Any) -> dict:
    """One row of the table: the plan against the measured peak, and whether it is within `TOLERANCE`."""
    ratio = plan_gib / measured_gib
    rounded = dict(plan_gib=round(plan_gib, 3), measured_gib=round(measured_gib, 3))
    return dict(phase=phase, **rounded, **extra, ratio=round(ratio, 3), within_tolerance=abs(ratio - 1) <= TOLERANCE)


def _run_child(resolution: int, phase: str = "train") -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    command = [sys.executable, "-m", "benchmarks.bench_memory_plan", "--child", phase, "--resolution", str(resolution)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/memory_plan_check.json")
    parser.add_argument("--preparation-resolution", type=int, default=512)
    parser.add_argument("--child", choices=("train", "vae", "decode", "text", "generate"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train = args.child == "train"
        print(json.dumps(_measure(args.resolution) if train else _measure_preparation(args.child, args.resolution)))
        return
    print(header_line())
    measured = _run_child(args.resolution)
    rows = _training_rows(measured) + _preparation_rows(args.preparation_resolution)
    meta = dict(vars(args), **{k: measured[k] for k in ("baseline_gib", "load_gib", "settled_gib", "counts", "shape")})
    meta.pop("child")
    publish("memory_plan_check", rows, meta, table=table, write=args.json)


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: per phase, the plan against the measured peak."""
    meta = result["meta"]
    trained = meta["counts"]["trained"] / 1e6
    intro = (
        f"The memory plan against a measured training step: SD3.5 Medium's real architecture (random weights), "
        f"{meta['resolution']} px, batch 1, `paper` layers, `attention` trainable ({trained:.0f}M parameters), "
        f"bf16, one CPU process; peak resident memory above the {meta['baseline_gib']:.2f} GiB baseline of a "
        "fresh process, the plan without its GPU runtime margin. The bar: within 15%."
    )
    rows = [
        [row["phase"], f"{row['plan_gib']:.2f}", f"{row['measured_gib']:.2f}", f"{row['ratio']:.3f}"]
        + ["yes" if row["within_tolerance"] else "NO"]
        for row in result["rows"]
    ]
    return [intro, "", *markdown_table(["phase", "plan GiB", "measured GiB", "plan / measured", "within 15%"], rows)]


if __name__ == "__main__":
    main()

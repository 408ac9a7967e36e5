"""Is the trainer's memory plan right? One real SD3.5 Medium training step on CPU, measured against it.

    python -m benchmarks.bench_memory_plan [--resolution 256] [--json]

A fresh subprocess builds SD3.5 Medium's real transformer (the shipped config, random fp32 weights, as
`load_base` returns a checkpoint), converts it and runs the trainer's own steps on the recipe
`trainer/configs/sd35_medium_24gb.toml` (`paper` layers, `attention` trainable, bf16: frozen weights
stored in bf16, bf16 autocast, AdamW, DDP over a world of one) at `--resolution`, batch 1: one step
without and one with gradient checkpointing, on random latents and text features of SD3.5's shapes.
It reads the process's resident memory from /proc: the baseline after the imports, the peak while
building and converting the model (the fp32 weights), and the peak of each step (the high-water mark
is reset before each phase). The parent prints each measured peak beside `trainer.memory.plan_memory`
for the same settings, with no runtime margin (no CUDA context on CPU), and marks a miss over 15%.

How CPU accounting differs from CUDA's: resident memory counts pages in use, like CUDA's allocated
memory rather than its reserved memory, because the child runs with a fixed glibc mmap threshold, so
every freed tensor above 128 KiB goes back to the OS (torch's CPU allocator caches nothing). There is
no CUDA context, cuBLAS workspace or NCCL buffer (the plan's runtime margin covers those on a GPU),
and the baseline (Python, torch, diffusers) is subtracted. On a GPU the base is read on the host and
then moved; here the host and the device are one memory, so the load peak is the fp32 model itself.
CPU autocast casts the same matmuls and convolutions to bf16 as CUDA's does; the kernels and their
workspaces differ (oneDNN vs cuBLAS / cuDNN, SDPA's CPU flash kernel vs CUDA's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.timing import header_line, write_json
from trainer.memory import GIB, PlanSettings, plan_memory
from trainer.time_estimate import ParamCounts, RunShape

RECIPE = Path(__file__).resolve().parent.parent / "trainer" / "configs" / "sd35_medium_24gb.toml"
TOLERANCE = 0.15
"""The plan must come within 15% of the measured peak (issue 13)."""
TEXT_TOKENS = 77 + 256
"""SD3's CLIP + T5 context at the default `--data.max_sequence_length`."""
VAE_FACTOR = 8
MMAP_THRESHOLD = str(128 * 1024)
"""glibc serves every allocation above this from mmap and unmaps it on free (no cached heap pages)."""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}; this benchmark needs Linux.")


def _reset_peak() -> None:
    """Reset the process's resident high-water mark (VmHWM) to its current resident size."""
    Path("/proc/self/clear_refs").write_text("5")


def _gib_since(baseline_kib: int) -> float:
    return (_status_kib("VmHWM") - baseline_kib) * 1024 / GIB


class _RandomSource:
    """One random sample with SD3.5's shapes: latents (16, h, w), context (T, 4096), pooled (2048,)."""

    def __init__(self, latent_hw: tuple[int, int], *, channels: int, text_dim: int, pooled_dim: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.latents = torch.randn(1, channels, *latent_hw, generator=generator)
        self.context = torch.randn(1, TEXT_TOKENS, text_dim, generator=generator)
        self.pooled = torch.randn(1, pooled_dim, generator=generator)

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

    from testing.models import sd35_medium_config
    from trainer.checkpoint import CheckpointManager
    from trainer.cli import parse_args
    from trainer.data import BatchPlan
    from trainer.distributed import init_world
    from trainer.loop import TrainParts, train_step
    from trainer.memory import count_parameters
    from trainer.metrics import MetricsWriter
    from trainer.model import build_model
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.parallelize import apply_activation_checkpointing, parallelize

    flags = ["--config", str(RECIPE), "--model.base", "random SD3.5 Medium", "--data.source", "cache"]
    flags += ["--data.path", "(in memory)", "--training.gradient_checkpointing", "false", "--parallel.device", "cpu"]
    flags += ["--training.batch_size", "1", "--training.accumulate", "1"]
    config = parse_args(flags + ["--data.resolution", str(resolution)])
    torch.set_num_threads(config.training.threads)
    baseline = _status_kib("VmRSS")
    _reset_peak()

    torch.manual_seed(0)
    arch = sd35_medium_config()
    base = SD3Transformer2DModel(**arch).eval()
    handle, split = build_model(base, config)
    result = {"baseline_gib": baseline * 1024 / GIB, "load_gib": _gib_since(baseline)}
    counts = count_parameters(handle, split)

    world = init_world(config.parallel)
    student = handle.model.to(world.device).train()
    model = parallelize(student, None, config=config, world=world)
    optimizer = build_optimizer(model, split, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, steps=config.training.steps)
    latent = resolution // VAE_FACTOR
    source = _RandomSource(
        (latent, latent),
        channels=arch["in_channels"],
        text_dim=arch["joint_attention_dim"],
        pooled_dim=arch["pooled_projection_dim"],
    )
    with tempfile.TemporaryDirectory() as scratch:
        parts = TrainParts(
            config=config,
            world=world,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            source=source,
            plan=BatchPlan(source.buckets(), batch_size=1, seed=0),
            checkpoints=CheckpointManager(Path(scratch) / "checkpoints", world, keep=1),
            metrics=MetricsWriter(Path(scratch) / "metrics.jsonl", enabled=False),
        )
        result["settled_gib"] = (_status_kib("VmRSS") - baseline) * 1024 / GIB
        for step, checkpointing in enumerate((False, True)):
            if checkpointing:
                apply_activation_checkpointing(student)
            _reset_peak()
            start = time.perf_counter()
            loss = train_step(parts, step)["loss/total"]
            result[f"step_ckpt{int(checkpointing)}"] = dict(
                peak_gib=_gib_since(baseline), seconds=time.perf_counter() - start, loss=loss
            )
    world.close()
    patch = arch["patch_size"]
    shape = RunShape(
        batch_per_rank=1,
        image_tokens=(latent // patch) ** 2,
        text_tokens=TEXT_TOKENS,
        hidden=arch["num_attention_heads"] * arch["attention_head_dim"],
        depth=arch["num_layers"],
    )
    return {**result, "counts": _fields_of(counts), "shape": _fields_of(shape), "mode": config.parallel.mode}


def _fields_of(obj: object) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}


def _run_child(resolution: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    command = [sys.executable, "-m", "benchmarks.bench_memory_plan", "--child", "--resolution", str(resolution)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/memory_plan_check.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.resolution)))
        return
    print(header_line())
    measured = _run_child(args.resolution)
    counts, shape = ParamCounts(**measured["counts"]), RunShape(**measured["shape"])
    print(
        f"SD3.5 Medium, {args.resolution}px, batch 1, paper layers, attention trainable ({counts.trained / 1e6:.0f}M), "
        f"bf16, {measured['mode']}; baseline {measured['baseline_gib']:.2f} GiB subtracted"
    )
    print(f"{'phase':36} {'plan GiB':>9} {'measured':>9} {'plan/meas':>9}  within 15%  step s")
    rows = []
    for checkpointing in (False, True):
        settings = PlanSettings(
            mode=measured["mode"], world_size=1, precision="bf16", gradient_checkpointing=checkpointing
        )
        plan = plan_memory(counts, shape, settings, runtime_margin_gib=0.0)
        if not rows:
            rows.append(
                dict(phase="load: fp32 model, converted", plan_gib=plan.load_gib, measured_gib=measured["load_gib"])
            )
        step = measured[f"step_ckpt{int(checkpointing)}"]
        rows.append(
            dict(
                phase=f"train step, checkpointing {'on' if checkpointing else 'off'}",
                plan_gib=sum(plan.components.values()),
                measured_gib=step["peak_gib"],
                seconds=round(step["seconds"], 1),
                components={k: round(v, 3) for k, v in plan.components.items()},
            )
        )
    for row in rows:
        ratio = row["plan_gib"] / row["measured_gib"]
        row.update(
            plan_gib=round(row["plan_gib"], 3), measured_gib=round(row["measured_gib"], 3), ratio=round(ratio, 3)
        )
        row["within_tolerance"] = abs(ratio - 1) <= TOLERANCE
        seconds = f"{row['seconds']:7.1f}" if "seconds" in row else ""
        print(
            f"{row['phase']:36} {row['plan_gib']:9.2f} {row['measured_gib']:9.2f} {ratio:9.3f}  "
            f"{'yes' if row['within_tolerance'] else 'NO':10} {seconds}"
        )
    if args.json:
        meta = dict(
            vars(args), **{k: measured[k] for k in ("baseline_gib", "load_gib", "settled_gib", "counts", "shape")}
        )
        meta.pop("child")
        write_json("memory_plan_check", rows, meta=meta)


if __name__ == "__main__":
    main()

"""`run(config)`: the whole fine-tune as one Python call, built step by step as a recipe.

world -> output folder -> base model -> data -> teacher -> linearize -> what trains -> memory plan
-> device and parallelism -> optimizer -> resume -> loop -> export -> report. `trainer/run.py` is
the CLI around it; benchmarks and ablations call it directly with different configs.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from t5core.atomic import write_text_atomic
from t5core.hosts.diffusers import T5Handle
from t5core.sd3_keys import diffusers_module
from trainer.checkpoint import CheckpointManager
from trainer.cli import config_from_toml_text, config_to_toml, save_config
from trainer.config import TrainConfig
from trainer.data import BatchPlan, Source
from trainer.distributed import World, init_world
from trainer.export import ComfyTarget, comfyui_target, export_weights, install_in_comfyui, write_report
from trainer.hub import HubTarget, hub_target, push_to_hub
from trainer.loop import TrainParts, train_loop
from trainer.losses import AttentionCapture
from trainer.memory import MemoryPlan, check_plan, count_parameters, run_shape
from trainer.metrics import MetricsWriter
from trainer.model import (
    ParamSplit,
    base_checkpoint_dtype,
    build_student,
    find_pipeline_folder,
    load_base,
    make_teacher,
    split_parameters,
)
from trainer.model_card import RUN_CARD, base_digests, model_card
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallelize import apply_activation_checkpointing, apply_ddp, apply_fsdp, store_frozen_in
from trainer.presets import check_config, get_preset
from trainer.seeds import rank_seed, seed_everything

__all__ = ["RunAlreadyFinished", "RunResult", "run"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
REAL_RESOLUTION = 1024
"""The image side of `images` / `prompts` data when `--data.resolution` is 0 (SD3.5's native size)."""
_RESUME_KEYS = (
    "model.base",
    "model.layers",
    "model.variant",
    "model.key_norm_eps",
    "model.locality",
    "model.trainable",
    "data.source",
    "data.path",
    "training.batch_size",
    "training.seed",
)
"""Settings a resumed run must share with its checkpoint (others, such as steps or the backend, may change)."""


@dataclass(frozen=True)
class RunResult:
    """What a finished run produced.

    Attributes:
        output_dir: the run's folder. weights: the exported T5 weights file.
        step: the last step reached. stop_reason: `steps` or `time`.
        last: the last step's metrics. seconds: wall time of the loop.
        handle: the converted student (unwrapped; its parameters are shards under FSDP2).
    """

    output_dir: Path
    weights: Path
    step: int
    stop_reason: str
    last: dict[str, float]
    seconds: float
    handle: T5Handle


def _prepare_output(folder: Path) -> None:
    """Create the output folder and prove it is writable before anything expensive happens (rank 0
    work: run it through `_on_main`)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".write-test.")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise PermissionError(
            f"output folder {folder} is not writable ({error}). Choose another --output.dir "
            "or fix its permissions; nothing in it was changed."
        ) from error


def _on_main(world: World, work: Callable[[], T]) -> T | None:
    """Do file work on rank 0 only (other nodes may not see the folder); its error is raised on every rank.

    Returns:
        What `work` returned on rank 0, None on other ranks.
    """
    result, error = None, None
    if world.is_main:
        try:
            result = work()
        except (OSError, ValueError) as caught:
            error = caught
    box = [error]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]
    return result


class RunAlreadyFinished(Exception):
    """`--checkpoint.resume auto` found a finished run in the output folder and left it untouched."""


def _resume_path(config: TrainConfig, checkpoints: CheckpointManager) -> Path | None:
    """The checkpoint to continue from, None to start fresh, as `--checkpoint.resume` says.

    Raises:
        RunAlreadyFinished: `auto`, and the newest checkpoint is the last step (nothing to redo).
        ValueError: `auto`, and the newest checkpoint is past `--training.steps`.
        FileExistsError: `never`, and the folder holds an earlier run's checkpoints.
    """
    mode, steps, wanted = config.checkpoint.resume, checkpoints.steps(), config.training.steps
    if mode == "force":
        return None
    if mode == "never":
        if steps:
            raise FileExistsError(
                f"{checkpoints.folder} holds checkpoints of an earlier run (steps {steps}). Pass "
                "--checkpoint.resume auto to continue it, force to train again from the start, or choose another "
                "--output.dir."
            )
        return None
    if mode != "auto":
        return Path(mode).expanduser()
    if not steps:
        return None
    if steps[-1] == wanted:
        raise RunAlreadyFinished(
            f"{checkpoints.folder.parent} holds a finished run (step {wanted} of {wanted}); nothing was changed. "
            "To train again from the start pass --checkpoint.resume force, to train longer raise --training.steps, "
            "or choose another --output.dir."
        )
    if steps[-1] > wanted:
        raise ValueError(
            f"{checkpoints.folder} holds a checkpoint at step {steps[-1]}, past --training.steps {wanted}; nothing "
            "was changed. Raise --training.steps to at least that, pass --checkpoint.resume force to train again from "
            "the start, or choose another --output.dir."
        )
    return checkpoints.latest()


def _flat(config: TrainConfig) -> dict[str, object]:
    return {f"{section}.{key}": value for section, fields in asdict(config).items() for key, value in fields.items()}


def _check_resume_config(saved_text: str, config: TrainConfig) -> None:
    saved, now = _flat(config_from_toml_text(saved_text)), _flat(config)
    differ = [
        f"--{key} {saved[key]!r} -> {now[key]!r}" for key in saved if key in _RESUME_KEYS and saved[key] != now[key]
    ]
    if differ:
        raise ValueError(
            f"the checkpoint was trained with other settings: {', '.join(differ)}. Resume with the same settings "
            "or start a new run in another --output.dir."
        )


def _build_source(config: TrainConfig, base: nn.Module, world: World, output: Path) -> Source:
    data = config.data
    preset = get_preset(config.model.base)
    if preset is not None:
        return preset.build_source(data)
    from trainer.cache import CacheSource

    if data.source == "cache":
        return CacheSource(data.path)
    from trainer.prepare import prepare_images, prepare_prompts

    cache_dir = Path(data.cache_dir or output / "data-cache")
    pipeline = find_pipeline_folder(config.model, data.pipeline)
    resolution = data.resolution or REAL_RESOLUTION
    prepare = prepare_images if data.source == "images" else prepare_prompts
    prepare(
        Path(data.path) if data.path else None,
        cache_dir,
        pipeline=pipeline,
        transformer=base,
        data=data,
        resolution=resolution,
        world=world,
        progress=config.output.progress,
    )
    return CacheSource(cache_dir)


def _plan(
    config: TrainConfig,
    handle: T5Handle,
    split: ParamSplit,
    source: Source,
    plan: BatchPlan,
    world: World,
    teacher: nn.Module | None,
) -> MemoryPlan:
    patch = handle.model.config.patch_size
    latent_h, latent_w = max(plan.buckets, key=lambda hw: hw[0] * hw[1])
    sample = source.load([plan.buckets[(latent_h, latent_w)][0]])
    shape = run_shape(
        handle.arch,
        list(handle.modules),
        batch_per_rank=config.training.batch_size // world.world_size,
        image_tokens=(latent_h // patch) * (latent_w // patch),
        text_tokens=sample.context.shape[1],
    )
    budget = config.parallel.gpu_memory_gib or None
    device_name = torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else None
    if budget is None and device_name is not None:
        budget = torch.cuda.get_device_properties(world.device).total_memory / 1024**3
    memory = check_plan(
        config,
        count_parameters(handle, split),
        shape,
        world_size=world.world_size,
        budget_gib=budget,
        device_name=device_name,
        teacher_params=sum(p.numel() for p in teacher.parameters()) if teacher is not None else 0,
    )
    logger.info("Memory plan: %s", memory.summary())
    return memory


def _publish(
    config: TrainConfig,
    report: dict[str, object],
    weights: Path,
    comfyui: ComfyTarget | None,
    hub: HubTarget | None,
) -> None:
    """Write the report and the model card beside the weights; install both in ComfyUI and upload them when asked."""
    output = weights.parent
    report = {**report, "base_sha256": base_digests(config.model)}
    write_report(output, report)
    card = model_card(config, report, weights_name=weights.name)
    write_text_atomic(output / RUN_CARD, card)
    if comfyui is not None:
        install_in_comfyui(comfyui, weights, card)
    if hub is not None:
        push_to_hub(hub, weights)


def run(config: TrainConfig) -> RunResult:
    """Fine-tune, checkpoint and export as `config` says; one process or one rank of a torchrun world.

    Raises:
        FileNotFoundError / ValueError / TypeError: a missing or unsuitable base, data or setting (the
            config is checked with `trainer.presets.check_config` first).
        PermissionError: the output folder is not writable.
        RuntimeError: the memory plan does not fit, or the machine cannot run a requested feature.
        trainer.hub.HubError: `--output.push_to_hub` cannot reach the Hub, or the upload failed (the run's files
            stay, and the message gives the command that retries the upload).
    """
    check_config(config)
    threads = torch.get_num_threads()
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    world = init_world(config.parallel)
    try:
        return _run(config, world)
    finally:
        world.close()
        torch.set_num_threads(threads)


def _run(config: TrainConfig, world: World) -> RunResult:
    output = Path(config.output.dir).expanduser()
    comfyui = _on_main(world, lambda: comfyui_target(config.output))
    hub = _on_main(world, lambda: hub_target(config.output))
    _on_main(world, lambda: _prepare_output(output))
    # The same seed on every rank while building: new T5 parameters start identical everywhere
    # (FSDP2, unlike DDP, does not broadcast rank 0's initial values).
    seed_everything(config.training.seed)
    checkpoints = CheckpointManager(output / "checkpoints", world, keep=config.checkpoint.keep)
    resume = _resume_path(config, checkpoints)
    if config.training.batch_size % world.world_size:
        raise ValueError(
            f"--training.batch_size {config.training.batch_size} does not split evenly over {world.world_size} "
            "processes; use a multiple of the process count."
        )
    if world.is_main:
        if config.checkpoint.resume == "force":
            checkpoints.clear()
        save_config(config, output / "config.toml")

    base = load_base(config.model)
    base_dtype = torch.float32 if config.output.base_dtype == "fp32" else base_checkpoint_dtype(config.model)
    source = _build_source(config, base, world, output)
    plan = BatchPlan(source.buckets(), batch_size=config.training.batch_size, seed=config.training.seed)
    teacher = make_teacher(base, dtype=config.training.dtype) if config.loss.needs_teacher else None
    handle = build_student(base, config.model)
    if config.loss.feature_weight > 0 and not handle.modules:
        raise ValueError("--loss.feature_weight aligns converted modules, but --model.layers converts none.")
    split = split_parameters(handle, config.model, config.optim)
    if not split.new and not split.inherited:
        raise ValueError(
            f"nothing would train: --model.layers {config.model.layers!r} converts no module and --model.trainable "
            f"{config.model.trainable!r} trains only converted ones. Convert layers or use --model.trainable all."
        )
    memory = _plan(config, handle, split, source, plan, world, teacher)

    student = handle.model.to(world.device).train()
    captures: tuple[AttentionCapture | None, AttentionCapture | None] = (None, None)
    if teacher is not None:
        teacher.to(world.device)
        if config.loss.feature_weight > 0:
            names = [diffusers_module(name) for name in handle.modules]
            captures = (AttentionCapture(student, names), AttentionCapture(teacher, names))
    if config.training.gradient_checkpointing:
        apply_activation_checkpointing(student)
    if config.parallel.mode == "ddp":
        if config.training.precision == "bf16":
            store_frozen_in(student, config.training.dtype)
        model = apply_ddp(student, world)
    else:
        param_dtype = config.training.dtype if config.training.precision == "bf16" else None
        model = apply_fsdp(student, param_dtype=param_dtype)
        if teacher is not None:
            apply_fsdp(teacher, param_dtype=param_dtype, name="teacher")
    seed_everything(rank_seed(config.training.seed, world.rank))
    optimizer = build_optimizer(model, split, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, steps=config.training.steps)

    metrics = MetricsWriter(output / "metrics.jsonl", enabled=world.is_main)
    start = 0
    if resume is not None:
        resumed = checkpoints.load(resume, model=model, optimizer=optimizer, scheduler=scheduler)
        _check_resume_config(resumed.state["config"], config)
        start = resumed.step
        metrics.resume_at(start)
    elif world.is_main and metrics.path.exists():
        metrics.path.unlink()
    logger.info(
        "Trainer built: %d converted modules, %d processes (%s), global batch %d, steps %d-%d, %s",
        len(handle.modules),
        world.world_size,
        config.parallel.mode,
        config.training.batch_size,
        start,
        config.training.steps,
        config.training.precision,
    )
    parts = TrainParts(
        config=config,
        world=world,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        source=source,
        plan=plan,
        checkpoints=checkpoints,
        metrics=metrics,
        teacher=teacher,
        student_capture=captures[0],
        teacher_capture=captures[1],
        extra_state={"world_size": world.world_size, "config": config_to_toml(config)},
    )
    budget = config.training.max_minutes * 60
    deadline = time.monotonic() + budget if budget else None
    result = train_loop(parts, start_step=start, deadline=deadline)

    weights = output / config.output.name
    provenance = {
        "trainer": "trainer/run.py",
        "steps": result.step,
        "base": config.model.base,
        "trainable": config.model.trainable,
        "data": config.data.source,
        "loss_weights": {key: getattr(config.loss, f"{key}_weight") for key in ("flow", "distill", "feature")},
        "base_dtype": str(base_dtype).removeprefix("torch."),
    }
    export_weights(weights, handle, split, world, provenance=provenance, base_dtype=base_dtype)
    preset = get_preset(config.model.base)
    evaluation = preset.evaluate(handle.model, config, output, world) if preset is not None else None
    report = {
        "step": result.step,
        "stop_reason": result.stop_reason,
        "loop_seconds": round(result.seconds, 2),
        "processes": world.world_size,
        "parallel": config.parallel.mode,
        "weights": str(weights),
        "config": str(output / "config.toml"),
        "metrics": str(metrics.path),
        "last_step": result.last,
        "memory_plan_gib": {k: round(v, 3) for k, v in memory.components.items()},
        "parameters": {"new": len(split.new), "inherited": len(split.inherited), "frozen": len(split.frozen)},
        "converted_layers": list(handle.modules),
        **({preset.evaluation_name: evaluation} if evaluation else {}),
    }
    _on_main(world, lambda: _publish(config, report, weights, comfyui, hub))
    # Leave together: a rank that tears down its process group while rank 0 still writes can abort gloo.
    world.barrier()
    return RunResult(output, weights, result.step, result.stop_reason, result.last, result.seconds, handle)

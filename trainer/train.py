"""`run(config)`: the whole fine-tune as one Python call, built step by step as a recipe.

world -> output folder -> resume policy -> the whole run's memory plan (`trainer.planning.run_plan`, from
configs, before anything loads) -> base model -> data (`trainer.inputs`) -> teacher -> convert and split -> memory
plan of the built model -> device and parallelism -> optimizer -> attention transfer -> resume -> loop -> export,
report and publish (`trainer.publishing`). Each step is one call into the module that owns it; `trainer/run.py` is
the CLI around `run`, and benchmarks and ablations call the same steps with different configs.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from t5core.hosts.diffusers import T5Handle, arch_of
from t5core.sd3_keys import diffusers_module
from trainer.checkpoint import CheckpointManager, resume_from, resume_path
from trainer.config import TrainConfig
from trainer.config_file import save_config
from trainer.data import BatchPlan, Source
from trainer.distributed import World, init_world
from trainer.inputs.sources import find_text_parts
from trainer.loop import LoopResult, TrainParts, train_loop
from trainer.losses import AttentionCapture
from trainer.metrics import MetricsWriter
from trainer.model import ParamSplit, base_fingerprint, build_model, load_base, make_teacher
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallelize import parallelize
from trainer.planning.memory import plan_run
from trainer.planning.run_plan import RunPlan, plan_whole_run
from trainer.presets import check_config, get_preset
from trainer.publishing.export import ComfyTarget, comfyui_target, export_run, publish, record_base, run_report
from trainer.publishing.hub import HubTarget, hub_target
from trainer.publishing.model_card import check_run_card
from trainer.seeds import rank_seed, seed_everything
from trainer.transfer import STAGE, TransferParts, check_transfer_mode, resume_transfer, run_transfer
from trainer.validation import Validator, build_validator

__all__ = ["RunResult", "run"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RunResult(LoopResult):
    """What a finished run produced: how its loop ended (the `LoopResult` fields: `step`, `stop_reason` `steps`
    or `time`, the `last` step's metrics, the loop's `seconds`), its files and the student.

    Attributes:
        output_dir: the run's folder. weights: the exported T5 weights file (None for a preset that exports
            none, `ModelPreset.exports`).
        handle: the converted student (unwrapped; its parameters are shards under FSDP2).
    """

    output_dir: Path
    weights: Path | None
    handle: T5Handle


def _check_outputs(config: TrainConfig, output: Path) -> tuple[ComfyTarget | None, HubTarget | None]:
    """Before anything expensive (rank 0 work: run it through `_on_main`): the ComfyUI folder and the Hub repo
    can take the results (`comfyui_target`, `hub_target`), the output folder exists and is writable, and its
    `README.md` is free for the model card (`check_run_card`).

    Returns:
        The ComfyUI and Hub targets (None where not asked for).
    """
    targets = comfyui_target(config.output), hub_target(config.output)
    try:
        output.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=output, prefix=".write-test.")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise PermissionError(
            f"output folder {output} is not writable ({error}). Choose another --output.dir "
            "or fix its permissions; nothing in it was changed."
        ) from error
    check_run_card(output)
    return targets


def _on_main(world: World, work: Callable[[], T]) -> T | None:
    """Do file work on rank 0 only (other nodes may not see the folder); its error, of any kind, is raised on
    every rank (a rank left out would wait in the next collective until the timeout).

    Returns:
        What `work` returned on rank 0, None on other ranks.
    """
    result, error = None, None
    if world.is_main:
        try:
            result = work()
        except Exception as caught:
            error = caught
    box = [error]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise error if world.is_main else box[0]
    return result


def _build_source(config: TrainConfig, base: nn.Module, world: World, *, vae_batch: int) -> Source:
    data = config.data
    preset = get_preset(config.model.base)
    if preset is not None:
        return preset.build_source(data)
    from trainer.inputs.cache import CacheSource

    if data.source == "cache":
        return CacheSource(data.path)
    from trainer.inputs.prepare import cache_dir_of, prepare_data

    cache_dir = cache_dir_of(config)
    pipeline = find_text_parts(config.model, data.pipeline)
    prepare_data(
        data, cache_dir, pipeline=pipeline, transformer=base, world=world, progress=config.output.progress,
        vae_batch=vae_batch,
    )  # fmt: skip
    return CacheSource(cache_dir)


def _plan_whole_run(config: TrainConfig, world: World) -> RunPlan | None:
    """Plan every phase of the run before anything heavy loads, and refuse one that does not fit (rank 0 logs it)."""
    # Planning converts a model on the meta device; the student built later must start from the run's seed.
    with torch.random.fork_rng(devices=[]):
        plan = plan_whole_run(config, world)
    if plan is not None:
        if world.is_main:
            logger.info("%s", plan.summary())
        plan.check()
    return plan


def run(config: TrainConfig) -> RunResult:
    """Fine-tune, checkpoint and export as `config` says; one process or one rank of a torchrun world.

    Raises:
        FileNotFoundError / ValueError / TypeError: a missing or unsuitable base, data or setting (the
            config is checked with `trainer.presets.check_config` first).
        PermissionError: the output folder is not writable.
        trainer.planning.memory.PlanDoesNotFit: the memory plan does not fit.
        RuntimeError: the machine cannot run a requested feature.
        trainer.publishing.hub.HubError: `--output.push_to_hub` cannot reach the Hub, or the upload failed (the run's
            files stay, and the message gives the command that retries the upload).
    """
    check_config(config)
    threads = torch.get_num_threads()
    world = init_world(config.parallel)
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    try:
        return _run(config, world)
    finally:
        world.close()
        torch.set_num_threads(threads)


def _check_batch_split(config: TrainConfig, world: World) -> None:
    """Each process runs the same number of samples in each micro-batch."""
    batch, accumulate = config.training.batch_size, config.training.accumulate
    if batch % (world.world_size * accumulate):
        raise ValueError(
            f"--training.batch_size {batch} does not split evenly over {world.world_size} process(es) x "
            f"--training.accumulate {accumulate} micro-batches; use a --training.batch_size that is a multiple of "
            f"{world.world_size * accumulate}, or another --training.accumulate."
        )


def _start_output(config: TrainConfig, world: World, checkpoints: list[CheckpointManager], output: Path) -> None:
    """On rank 0, once everything the run needs is built: clear the earlier run's checkpoints (the fine-tune's
    and the transfer's) under `force` (a run that fails before this point leaves them as they were) and save
    the config."""
    if world.is_main:
        if config.checkpoint.resume == "force":
            for manager in checkpoints:
                manager.clear()
        save_config(config, output / "config.toml")


def _train_parts(
    config: TrainConfig,
    world: World,
    handle: T5Handle,
    split: ParamSplit,
    *,
    teacher: nn.Module | None,
    source: Source,
    plan: BatchPlan,
    checkpoints: CheckpointManager,
    output: Path,
    validator: Validator | None,
) -> TrainParts:
    """What the loop runs: attention captures for `--loss.feature_weight`, the student wrapped on the device,
    per-rank seeds, the optimizer and its schedule, the metrics file and the validation hook."""
    captures = None
    if teacher is not None and config.loss.feature_weight > 0:
        names = [diffusers_module(name) for name in handle.modules]
        captures = AttentionCapture(handle.model, names), AttentionCapture(teacher, names)
    model = parallelize(handle.model, teacher, training=config.training, parallel=config.parallel, world=world)
    seed_everything(rank_seed(config.training.seed, world.rank))
    optimizer = build_optimizer(model, split, config.optim)
    return TrainParts(
        config=config,
        world=world,
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, config.optim, steps=config.training.steps),
        source=source,
        plan=plan,
        checkpoints=checkpoints,
        metrics=MetricsWriter(output / "metrics.jsonl", enabled=world.is_main),
        teacher=teacher,
        captures=captures,
        validate=validator.bind(handle) if validator else None,
    )


def _log_built(config: TrainConfig, handle: T5Handle, world: World, start: int) -> None:
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


def _evaluate(config: TrainConfig, handle: T5Handle, world: World, output: Path) -> dict[str, object]:
    """The preset's evaluation of the trained student, `{name: numbers}`; empty without one."""
    preset = get_preset(config.model.base)
    evaluation = preset.evaluate(handle.model, config, output, world) if preset is not None else None
    return {preset.evaluation_name: evaluation} if evaluation else {}


def _run(config: TrainConfig, world: World) -> RunResult:
    output = Path(config.output.dir).expanduser()
    comfyui, hub = _on_main(world, lambda: _check_outputs(config, output)) or (None, None)
    # The same seed on every rank while building: new T5 parameters start identical everywhere
    # (FSDP2, unlike DDP, does not broadcast rank 0's initial values).
    seed_everything(config.training.seed)
    checkpoints = CheckpointManager(output / "checkpoints", world, keep=config.checkpoint.keep)
    transfer_checkpoints = CheckpointManager(output / "checkpoints" / STAGE, world, keep=config.checkpoint.keep)
    resume = resume_path(config, checkpoints)
    weights_file = output / config.output.name
    transfer_resume = resume_transfer(config, transfer_checkpoints, weights_file) if resume is None else None
    if resume is None:
        check_transfer_mode(config.transfer, config.parallel, transfer_resume)
    _check_batch_split(config, world)
    whole_plan = _plan_whole_run(config, world)

    base = load_base(config.model)
    fingerprint = base_fingerprint(base, arch_of(base))
    source = _build_source(config, base, world, vae_batch=whole_plan.vae_batch if whole_plan else 0)
    validator = build_validator(config, world, base=base, source=source, output=output)
    held_out = validator.held_out if validator else ()
    plan = BatchPlan(
        source.buckets(), batch_size=config.training.batch_size, seed=config.training.seed, exclude=held_out
    )
    teacher = make_teacher(base, dtype=config.training.dtype) if config.loss.needs_teacher else None
    handle, split = build_model(base, config)
    record = record_base(config, handle, split, world, fingerprint=fingerprint)
    memory = plan_run(config, handle, split, source=source, plan=plan, world=world, teacher=teacher)
    _start_output(config, world, [checkpoints, transfer_checkpoints], output)
    parts = _train_parts(
        config, world, handle, split, teacher=teacher, source=source, plan=plan, checkpoints=checkpoints, output=output,
        validator=validator,
    )  # fmt: skip
    checkpoints.track(parts.model, parts.optimizer, parts.scheduler)
    if resume is None and config.transfer.steps:
        transfer = TransferParts(config, world, handle, parts.model, source, plan, transfer_checkpoints, parts.metrics)
        run_transfer(transfer, resume=transfer_resume)
    start = resume_from(resume, checkpoints)
    parts.metrics.resume_at(start.step)
    _log_built(config, handle, world, start.step)
    result = train_loop(parts, start=start)

    preset = get_preset(config.model.base)
    weights = None
    if preset is None or preset.exports:
        weights = export_run(config, handle, split, world, record=record, steps=result.step)
    evaluation = _evaluate(config, handle, world, output)
    if validator is not None:
        evaluation |= validator.report(parts.metrics.path, step=result.step)
    if weights is None:
        logger.info("the %s base is a baseline a T5 weights file cannot hold: no file written", config.model.base)
    else:
        report = run_report(
            config, result, weights=weights, world=world, handle=handle, split=split, memory=memory,
            evaluation=evaluation,
        )  # fmt: skip
        _on_main(world, lambda: publish(config, report, weights, comfyui=comfyui, hub=hub))
    # Leave together: a rank that tears down its process group while rank 0 still writes can abort gloo.
    world.barrier()
    return RunResult(
        result.step, result.stop_reason, result.last, result.seconds, output_dir=output, weights=weights, handle=handle
    )

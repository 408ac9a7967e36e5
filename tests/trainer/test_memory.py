"""The memory plan: how each setting moves the estimate, and refusing a run that cannot fit."""

from __future__ import annotations

import dataclasses

import pytest

from trainer.planning.memory import (
    ADAMW_SCRATCH_BYTES,
    GIB,
    TRAINED_BYTES,
    PlanSettings,
    plan_memory,
    suggest,
)
from trainer.planning.time_estimate import ParamCounts, RunShape

COUNTS = ParamCounts(trained=600_000_000, frozen=1_700_000_000, buffers=200_000_000, largest_block=90_000_000)
SHAPE = RunShape(batch_per_rank=4, image_tokens=4096, text_tokens=333, hidden=1536, depth=24)
BASE = PlanSettings(mode="ddp", world_size=4, precision="bf16", gradient_checkpointing=True)
NO_CKPT = dataclasses.replace(BASE, gradient_checkpointing=False)


def test_components_follow_the_settings():
    ddp = plan_memory(COUNTS, SHAPE, BASE)
    assert ddp.components["trained weights+grads+AdamW"] == pytest.approx(COUNTS.trained * TRAINED_BYTES / GIB)
    assert ddp.components["frozen weights"] == pytest.approx(COUNTS.frozen * 2 / GIB)
    fsdp = plan_memory(COUNTS, SHAPE, dataclasses.replace(BASE, mode="fsdp2"))
    assert fsdp.components["trained weights+grads+AdamW"] == pytest.approx(
        ddp.components["trained weights+grads+AdamW"] / 4
    )
    assert fsdp.components["FSDP2 gathered blocks"] > 0 == ddp.components["FSDP2 gathered blocks"]
    fp32 = plan_memory(COUNTS, SHAPE, dataclasses.replace(BASE, precision="fp32"))
    assert fp32.components["activations"] == pytest.approx(2 * ddp.components["activations"])
    no_ckpt = plan_memory(COUNTS, SHAPE, NO_CKPT)
    assert no_ckpt.components["activations"] > 5 * ddp.components["activations"]
    teacher = plan_memory(COUNTS, SHAPE, dataclasses.replace(BASE, teacher_params=2_000_000_000))
    assert teacher.total_gib - ddp.total_gib == pytest.approx(2_000_000_000 * 2 / GIB)
    # FSDP2 shards the teacher, held in the compute dtype as under DDP.
    fsdp_settings = dataclasses.replace(BASE, mode="fsdp2")
    fsdp_teacher = plan_memory(COUNTS, SHAPE, dataclasses.replace(fsdp_settings, teacher_params=2_000_000_000))
    assert fsdp_teacher.components["teacher"] == pytest.approx(2_000_000_000 * 2 / 4 / GIB)


def test_fits_and_suggestions():
    tight = plan_memory(COUNTS, SHAPE, NO_CKPT, budget_gib=20.0)
    assert not tight.fits
    fixes = suggest(COUNTS, SHAPE, NO_CKPT, budget_gib=20.0)
    assert fixes and all("GiB" in fix for fix in fixes)
    for fix in fixes:
        assert "--training.gradient_checkpointing true" in fix or "--parallel.mode fsdp2" in fix
    assert plan_memory(COUNTS, SHAPE, BASE, budget_gib=200.0).fits


@pytest.mark.parametrize(
    ("budget", "offered"),
    [
        pytest.param(30.0, "--training.accumulate 4 (the same global batch, 2 per GPU at a time; about 29.4", id="2"),
        pytest.param(25.0, "--training.accumulate 8 (the same global batch, 1 per GPU at a time; about 22.2", id="1"),
    ],
)
def test_more_micro_batches_are_offered_before_a_smaller_batch(budget, offered):
    """The largest micro-batch that fits, with the accumulation that keeps the global batch (4 GPUs x 2 micro-batches
    x 4 = 32); the smaller batch comes after it, split as the run's accumulation needs."""
    shape = dataclasses.replace(SHAPE, accumulate=2)
    assert not plan_memory(COUNTS, shape, NO_CKPT, budget_gib=budget).fits
    fixes = [fix for fix in suggest(COUNTS, shape, NO_CKPT, budget_gib=budget) if "--training.gradient" not in fix]
    assert fixes[0].startswith(offered)
    assert fixes[1].startswith("--training.batch_size 8 (1 per GPU; about 22.2 GiB)")


def test_loading_casts_or_shards_on_the_way_so_it_never_exceeds_training():
    ddp = plan_memory(COUNTS, SHAPE, BASE, runtime_margin_gib=0.0)
    assert ddp.load_gib == pytest.approx((COUNTS.trained * 4 + COUNTS.frozen * 2 + COUNTS.buffers * 4) / GIB)
    fsdp = plan_memory(COUNTS, SHAPE, dataclasses.replace(BASE, mode="fsdp2"), runtime_margin_gib=0.0)
    sharded = (COUNTS.trained + COUNTS.frozen) * 4 / 4 + COUNTS.largest_block * 4 + COUNTS.buffers * 4
    assert fsdp.load_gib == pytest.approx(sharded / GIB)
    tiny = RunShape(batch_per_rank=1, image_tokens=16, text_tokens=8, hidden=1536, depth=24)
    frozen_heavy = ParamCounts(trained=1_000_000, frozen=4_000_000_000, buffers=0, largest_block=200_000_000)
    for counts in (COUNTS, frozen_heavy):
        for mode in ("ddp", "fsdp2"):
            for precision in ("bf16", "fp32"):
                settings = dataclasses.replace(BASE, mode=mode, precision=precision, teacher_params=counts.frozen)
                plan = plan_memory(counts, tiny, settings)
                assert plan.load_gib <= sum(plan.components.values()), (counts, mode, precision)


def test_adamw_scratch_counts_only_beyond_the_activations():
    tiny = RunShape(batch_per_rank=1, image_tokens=16, text_tokens=8, hidden=1536, depth=24)
    plan = plan_memory(COUNTS, tiny, BASE)
    scratch = COUNTS.trained * ADAMW_SCRATCH_BYTES / GIB
    assert plan.components["AdamW step scratch beyond activations"] == pytest.approx(
        scratch - plan.components["activations"]
    )
    assert plan_memory(COUNTS, SHAPE, NO_CKPT).components["AdamW step scratch beyond activations"] == 0

"""The memory plan: how each setting moves the estimate, and refusing a run that cannot fit."""

from __future__ import annotations

import dataclasses

import pytest

from trainer.memory import (
    ADAMW_SCRATCH_BYTES,
    GIB,
    TRAINED_BYTES,
    ParamCounts,
    RunShape,
    estimate_time,
    find_gpu,
    plan_memory,
    step_flops,
    suggest,
)

COUNTS = ParamCounts(trained=600_000_000, frozen=1_700_000_000, buffers=200_000_000, largest_block=90_000_000)
SHAPE = RunShape(batch_per_rank=4, image_tokens=4096, text_tokens=333, hidden=1536, depth=24)
BASE = dict(mode="ddp", world_size=4, precision="bf16", gradient_checkpointing=True)


def test_components_follow_the_settings():
    ddp = plan_memory(COUNTS, SHAPE, **BASE)
    assert ddp.components["trained weights+grads+AdamW"] == pytest.approx(COUNTS.trained * TRAINED_BYTES / GIB)
    assert ddp.components["frozen weights"] == pytest.approx(COUNTS.frozen * 2 / GIB)
    fsdp = plan_memory(COUNTS, SHAPE, **{**BASE, "mode": "fsdp2"})
    assert fsdp.components["trained weights+grads+AdamW"] == pytest.approx(
        ddp.components["trained weights+grads+AdamW"] / 4
    )
    assert fsdp.components["FSDP2 gathered blocks"] > 0 == ddp.components["FSDP2 gathered blocks"]
    fp32 = plan_memory(COUNTS, SHAPE, **{**BASE, "precision": "fp32"})
    assert fp32.components["activations"] == pytest.approx(2 * ddp.components["activations"])
    no_ckpt = plan_memory(COUNTS, SHAPE, **{**BASE, "gradient_checkpointing": False})
    assert no_ckpt.components["activations"] > 5 * ddp.components["activations"]
    teacher = plan_memory(COUNTS, SHAPE, **BASE, teacher_params=2_000_000_000)
    assert teacher.total_gib - ddp.total_gib == pytest.approx(2_000_000_000 * 2 / GIB)


def test_fits_and_suggestions():
    tight = plan_memory(COUNTS, SHAPE, **{**BASE, "gradient_checkpointing": False}, budget_gib=20.0)
    assert not tight.fits
    fixes = suggest(COUNTS, SHAPE, **{**BASE, "gradient_checkpointing": False}, teacher_params=0, budget_gib=20.0)
    assert fixes and all("GiB" in fix for fix in fixes)
    for fix in fixes:
        assert "--training.gradient_checkpointing true" in fix or "--parallel.mode fsdp2" in fix
    assert plan_memory(COUNTS, SHAPE, **BASE, budget_gib=200.0).fits


def test_loading_the_fp32_model_is_a_peak_of_its_own():
    plan = plan_memory(COUNTS, SHAPE, **BASE, runtime_margin_gib=0.0)
    weights = (COUNTS.trained + COUNTS.frozen + COUNTS.buffers) * 4 / GIB
    assert plan.load_gib == pytest.approx(weights)
    tiny = RunShape(batch_per_rank=1, image_tokens=16, text_tokens=8, hidden=1536, depth=24)
    frozen_heavy = ParamCounts(trained=1_000_000, frozen=4_000_000_000, buffers=0, largest_block=1)
    small = plan_memory(frozen_heavy, tiny, **BASE, runtime_margin_gib=0.0)
    assert small.total_gib == small.load_gib > sum(small.components.values())


def test_adamw_scratch_counts_only_beyond_the_activations():
    tiny = RunShape(batch_per_rank=1, image_tokens=16, text_tokens=8, hidden=1536, depth=24)
    plan = plan_memory(COUNTS, tiny, **BASE)
    scratch = COUNTS.trained * ADAMW_SCRATCH_BYTES / GIB
    assert plan.components["AdamW step scratch beyond activations"] == pytest.approx(
        scratch - plan.components["activations"]
    )
    assert (
        plan_memory(COUNTS, SHAPE, **{**BASE, "gradient_checkpointing": False}).components[
            "AdamW step scratch beyond activations"
        ]
        == 0
    )


def test_step_flops_follow_the_settings():
    shape = RunShape(batch_per_rank=2, image_tokens=4096, text_tokens=333, hidden=1536, depth=24, image_only_blocks=13)
    plain = step_flops(shape, trained_fraction=0.0, gradient_checkpointing=False)
    assert step_flops(shape, trained_fraction=0.0, gradient_checkpointing=True) == pytest.approx(plain * 1.5)
    softmax = dataclasses.replace(shape, softmax_joint=19)
    assert step_flops(softmax, trained_fraction=0.0, gradient_checkpointing=False) - plain == pytest.approx(
        2 * 4 * 1536 * 19 * 4429**2 * 3
    )
    half = dataclasses.replace(shape, batch_per_rank=1)
    assert step_flops(half, trained_fraction=0.0, gradient_checkpointing=False) == pytest.approx(plain / 2)


def test_time_estimate_names_its_gpu_and_stops_at_max_minutes():
    gpu = find_gpu("NVIDIA H100 80GB HBM3", None)
    assert gpu.name == "H100 80GB"
    assert find_gpu("NVIDIA A100-SXM4-80GB", None).name == "A100 80GB"
    assert find_gpu(None, 24.0).name == "H100 80GB" and find_gpu(None, 23.6).name == "RTX 4090"
    assert find_gpu("Some Unknown GPU", 24.0) is None and find_gpu(None, 500.0) is None
    full = estimate_time(COUNTS, SHAPE, gpu=gpu, gradient_checkpointing=True, steps=1000, max_minutes=0.0)
    assert full.hours == pytest.approx(1000 * full.seconds_per_step / 3600) and not full.capped
    capped = estimate_time(COUNTS, SHAPE, gpu=gpu, gradient_checkpointing=True, steps=10**6, max_minutes=30.0)
    assert capped.capped and capped.hours == 0.5
    assert "an estimate" in capped.summary() and "max_minutes" in capped.summary()

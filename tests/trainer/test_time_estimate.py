"""The time estimate: which card a device name is, the FLOPs of a step, and the hours of a run."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from trainer.config import TrainConfig
from trainer.planning.memory import plan_training
from trainer.planning.time_estimate import (
    GPUS,
    GpuSpec,
    ParamCounts,
    RunShape,
    TimeEstimate,
    estimate_time,
    find_gpu,
    step_flops,
    transfer_step_flops,
)

COUNTS = ParamCounts(trained=600_000_000, frozen=1_700_000_000, buffers=200_000_000, largest_block=90_000_000)
SHAPE = RunShape(batch_per_rank=4, image_tokens=4096, text_tokens=333, hidden=1536, depth=24)

# What `torch.cuda.get_device_name` and nvidia-smi report, the card it is, and that card's dense
# bf16 peak: each "NVIDIA GeForce RTX ..." and "NVIDIA RTX ..." card is its own (not an RTX 4090),
# and the H20 and the H200 are told apart.
KNOWN = [
    pytest.param("NVIDIA GeForce RTX 3090", "RTX 3090", 71.0, id="rtx3090"),
    pytest.param("NVIDIA GeForce RTX 4090", "RTX 4090", 165.0, id="rtx4090"),
    pytest.param("NVIDIA GeForce RTX 5090", "RTX 5090", 209.5, id="rtx5090"),
    pytest.param("GeForce RTX 3090", "RTX 3090", 71.0, id="rtx3090-old-driver"),
    pytest.param("NVIDIA RTX A6000", "RTX A6000", 154.8, id="a6000"),
    pytest.param("NVIDIA L40S", "L40S", 362.0, id="l40s"),
    pytest.param("NVIDIA A100-SXM4-80GB", "A100 80GB", 312.0, id="a100-sxm-80"),
    pytest.param("NVIDIA A100 80GB PCIe", "A100 80GB", 312.0, id="a100-pcie-80"),
    pytest.param("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0, id="a100-sxm-40"),
    pytest.param("NVIDIA A100-PCIE-40GB", "A100 40GB", 312.0, id="a100-pcie-40"),
    pytest.param("NVIDIA H100 80GB HBM3", "H100 80GB", 989.0, id="h100-sxm"),
    pytest.param("NVIDIA H100 PCIe", "H100 PCIe", 756.0, id="h100-pcie"),
    pytest.param("NVIDIA H20", "H20", 148.0, id="h20"),
    pytest.param("NVIDIA H200", "H200", 989.0, id="h200"),
]
UNKNOWN = [
    "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 4090 Laptop GPU",
    "NVIDIA GeForce RTX 4080",
    "NVIDIA RTX 6000 Ada Generation",
    "NVIDIA L40",
    "NVIDIA H100 NVL",
    "NVIDIA H200 NVL",
    "Some Unknown GPU",
]


@pytest.mark.parametrize(("device_name", "card", "tflops"), KNOWN)
def test_a_device_name_finds_its_own_card(device_name, card, tflops):
    gpu = find_gpu(device_name, None)
    assert gpu is not None and (gpu.name, gpu.bf16_tflops) == (card, tflops)


@pytest.mark.parametrize("device_name", UNKNOWN)
def test_an_unknown_card_gets_no_card_not_a_neighbour(device_name):
    # Not even with a budget: a named card is never replaced by another of the same memory.
    assert find_gpu(device_name, 24.0) is None


def test_every_listed_device_name_finds_its_entry():
    names = [name for gpu in GPUS for name in gpu.device_names]
    assert len(names) == len(set(names)) and len({gpu.name for gpu in GPUS}) == len(GPUS)
    for gpu in GPUS:
        for name in gpu.device_names:
            assert find_gpu(name, None) is gpu, name


def test_without_a_device_name_the_budget_picks_a_card():
    assert find_gpu(None, 24.0).name == "H100 80GB" and find_gpu(None, 23.6).name == "RTX 4090"
    assert find_gpu(None, 94.0).name == "H20" and find_gpu(None, 139.8).name == "H200"
    assert find_gpu(None, 500.0) is None and find_gpu(None, None) is None


def test_an_unknown_card_plans_without_an_estimate_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="trainer.planning.memory"):
        plan, _ = plan_training(
            TrainConfig(), COUNTS, SHAPE, world_size=1, budget_gib=None, device_name="NVIDIA GeForce RTX 3090 Ti"
        )
    assert plan.time is None and "estimated time" not in plan.summary()
    assert "NVIDIA GeForce RTX 3090 Ti is not a GPU" in caplog.text and "RTX 3090, " in caplog.text


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
    # a step of two micro-batches of 1 computes the samples of one batch of 2, in the transfer too
    micro = dataclasses.replace(half, accumulate=2)
    assert step_flops(micro, trained_fraction=0.0, gradient_checkpointing=False) == pytest.approx(plain)
    assert transfer_step_flops(micro) == pytest.approx(transfer_step_flops(shape))


def test_hours_are_steps_at_the_assumed_share_of_the_peak_until_max_minutes():
    # 350 TFLOP a step on a 1000 TFLOPS card at the assumed 35%: one second a step.
    card = GpuSpec(name="X100", memory_gib=80.0, bf16_tflops=1000.0, device_names=())
    full = TimeEstimate(card, flops_per_step=350e12, steps=7200)
    assert full.seconds_per_step == pytest.approx(1.0) and full.hours == pytest.approx(2.0) and not full.capped
    capped = TimeEstimate(card, flops_per_step=350e12, steps=7200, max_minutes=30.0)
    assert capped.capped and capped.hours == 0.5
    assert "estimated time 0.5 h (stopped by --training.max_minutes): 7200 steps x 1.00 s" in capped.summary()
    assert "on an X100, 1000 TFLOPS bf16 at an assumed 35% utilisation; an estimate" in capped.summary()
    assert not TimeEstimate(card, flops_per_step=350e12, steps=1800, max_minutes=30.0).capped


def test_a_3090_run_takes_its_own_time_not_a_4090s():
    rtx3090, rtx4090 = find_gpu("NVIDIA GeForce RTX 3090", None), find_gpu("NVIDIA GeForce RTX 4090", None)
    slow, fast = (
        estimate_time(COUNTS, SHAPE, gpu=gpu, gradient_checkpointing=True, steps=1000, max_minutes=0.0)
        for gpu in (rtx3090, rtx4090)
    )
    assert slow.flops_per_step == fast.flops_per_step
    assert slow.hours / fast.hours == pytest.approx(165.0 / 71.0)


def test_the_transfer_adds_its_steps_forward_only():
    """A transfer step runs the model forward (every module softmax: the teacher) and each converted module's
    projections again: more than the converted model's forward, less than its training step; its hours add to
    the fine-tune's."""
    shape = dataclasses.replace(SHAPE, softmax_joint=0)
    forward = step_flops(shape, trained_fraction=0.0, gradient_checkpointing=False) / 2
    transfer = transfer_step_flops(shape)
    training = step_flops(shape, trained_fraction=0.26, gradient_checkpointing=True)
    assert forward < transfer < training
    gpu = find_gpu("NVIDIA H100 80GB HBM3", None)
    plain = estimate_time(COUNTS, shape, gpu=gpu, gradient_checkpointing=True, steps=3000, max_minutes=0)
    with_transfer = estimate_time(
        COUNTS, shape, gpu=gpu, gradient_checkpointing=True, steps=3000, max_minutes=0, transfer_steps=500
    )
    assert with_transfer.hours == pytest.approx(plain.hours + with_transfer.transfer_hours)
    assert with_transfer.transfer_hours == pytest.approx(500 * transfer / (gpu.bf16_tflops * 1e12 * 0.35) / 3600)
    assert "500 transfer steps" in with_transfer.summary()

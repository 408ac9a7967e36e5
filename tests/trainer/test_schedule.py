"""The learning-rate schedule: linear warm-up, then constant or cosine down to `min_lr_ratio`."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import OptimConfig
from trainer.optim import build_scheduler


def _lrs(config: OptimConfig, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = build_scheduler(optimizer, config, steps=steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_cosine_warms_up_then_decays_to_its_floor(floor):
    config = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=floor)
    lrs = _lrs(config, 14)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # After warm-up: floor + (1 - floor) * (1 + cos(pi * progress)) / 2, progress over the last 10 steps.
    expected = [floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * i / 10)) for i in range(10)]
    assert lrs[4:] == pytest.approx(expected)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False)) and min(lrs[4:]) > floor


def test_constant_ignores_the_floor():
    assert _lrs(OptimConfig(lr=1.0, warmup_steps=2, schedule="constant", min_lr_ratio=0.5), 6)[2:] == [1.0] * 4

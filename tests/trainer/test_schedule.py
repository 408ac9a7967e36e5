"""The learning-rate schedule: linear warm-up, then constant or cosine down to `min_lr_ratio`."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import OptimConfig
from trainer.optim import build_scheduler


def _lrs(config: OptimConfig, steps: int, *, past_the_end: int = 0) -> list[float]:
    """The learning rate of each of `steps` optimizer steps, then of `past_the_end` more."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = build_scheduler(optimizer, config, steps=steps)
    lrs = []
    for _ in range(steps + past_the_end):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


SQRT2 = math.sqrt(2)
# Warm-up over 2 steps, then a half cosine over the 4 steps left, sampled at a quarter turn each:
# cos(0), cos(pi/4), cos(pi/2), cos(3pi/4) -> (1 + cos) / 2 = 1, (2 + sqrt 2) / 4, 1/2, (2 - sqrt 2) / 4,
# then 0 at the end of the schedule and after it.
CASES = [
    pytest.param(0.0, [0.5, 1.0, 1.0, (2 + SQRT2) / 4, 0.5, (2 - SQRT2) / 4, 0.0, 0.0], id="floor0"),
    # the same half cosine squeezed into [0.5, 1]: 0.5 + 0.5 x above; warm-up ignores the floor
    pytest.param(0.5, [0.5, 1.0, 1.0, (6 + SQRT2) / 8, 0.75, (6 - SQRT2) / 8, 0.5, 0.5], id="floor0.5"),
]


@pytest.mark.parametrize(("floor", "factors"), CASES)
def test_cosine_warms_up_then_decays_to_its_floor_at_the_last_step(floor, factors):
    config = OptimConfig(lr=2.0, warmup_steps=2, schedule="cosine", min_lr_ratio=floor)
    assert _lrs(config, 6, past_the_end=2) == pytest.approx([2.0 * factor for factor in factors], abs=1e-12)


def test_constant_ignores_the_floor():
    config = OptimConfig(lr=1.0, warmup_steps=2, schedule="constant", min_lr_ratio=0.5)
    assert _lrs(config, 6, past_the_end=1) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]

"""Caption dropout (`--data.caption_dropout`): a dropped sample trains on the empty caption, its
context and pooled features together, at about the configured rate, and a step drops the same
samples however often and in whatever order it runs (so a resumed run trains as an unbroken one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from trainer.config import ParallelConfig, TrainConfig
from trainer.data import Batch, BatchPlan
from trainer.distributed import init_world
from trainer.loop import TrainParts, train_step

SAMPLES, BATCH = 8, 4


class _Captions:
    """Samples whose context and pooled features are filled with their index + 1; the empty caption is zeros."""

    def buckets(self) -> dict[tuple[int, int], list[int]]:
        return {(2, 2): list(range(SAMPLES))}

    def load(self, indices: list[int]) -> Batch:
        marks = torch.tensor(indices, dtype=torch.float32) + 1
        context = marks.view(-1, 1, 1).expand(-1, 3, 5).clone()
        return Batch(torch.zeros(len(indices), 4, 2, 2), context, marks.view(-1, 1).expand(-1, 6).clone())

    def uncond(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(3, 5), torch.zeros(6)


class _Recorder(nn.Module):
    """A velocity model that scales its input by one weight and records the text it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, *, hidden_states, encoder_hidden_states, pooled_projections, timestep, return_dict):
        self.seen.append((encoder_hidden_states.detach().clone(), pooled_projections.detach().clone()))
        return (hidden_states * self.weight,)


@pytest.fixture(scope="module")
def world():
    world = init_world(ParallelConfig(device="cpu"))
    yield world
    world.close()


def _dropped(world, rate: float, steps: list[int]) -> list[list[bool]]:
    """Per step run (in the order given), whether each sample of the global batch trained without its caption."""
    config = TrainConfig()
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, caption_dropout=rate))
    model = _Recorder()
    optimizer = torch.optim.SGD([{"params": list(model.parameters()), "name": "test"}], lr=0.0)
    source = _Captions()
    plan = BatchPlan(source.buckets(), batch_size=BATCH, seed=0)
    parts = TrainParts(
        config=config,
        world=world,
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        source=source,
        plan=plan,
        checkpoints=None,
        metrics=None,
    )
    dropped = []
    for step in steps:
        train_step(parts, step)
        context, pooled = model.seen[-1]
        own = source.load(plan.global_indices(step))
        row = []
        for i in range(BATCH):
            kept = torch.equal(context[i], own.context[i]) and torch.equal(pooled[i], own.pooled[i])
            empty = not context[i].any() and not pooled[i].any()
            assert kept != empty, f"step {step} sample {i}: its own caption or the empty one, both parts alike"
            row.append(empty)
        dropped.append(row)
    return dropped


def test_no_dropout_keeps_every_caption(world):
    assert not any(any(row) for row in _dropped(world, 0.0, list(range(16))))


def test_dropout_replaces_about_its_share_of_captions_with_the_empty_one(world):
    dropped = sum(sum(row) for row in _dropped(world, 0.5, list(range(64))))
    # 256 draws at 0.5: mean 128, standard deviation 8; the bounds are 4 deviations.
    assert 96 <= dropped <= 160, dropped
    assert sum(sum(row) for row in _dropped(world, 0.1, list(range(64)))) < dropped


def test_a_step_drops_the_same_samples_in_any_order(world):
    forward = _dropped(world, 0.5, [0, 1, 2, 3, 4, 5])
    resumed = _dropped(world, 0.5, [3, 4, 5, 0, 1, 2, 3])
    assert resumed == forward[3:] + forward[:3] + forward[3:4]
    assert any(any(row) for row in forward) and not all(all(row) for row in forward)

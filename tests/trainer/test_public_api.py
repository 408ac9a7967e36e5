"""The trainer's public names: exactly these, and the same objects as their sources."""

from __future__ import annotations

import trainer
from trainer import cli, config, train


def test_trainer_all():
    assert trainer.__all__ == ["RunResult", "TrainConfig", "parse_args", "run"]
    assert trainer.run is train.run and trainer.RunResult is train.RunResult
    assert trainer.TrainConfig is config.TrainConfig and trainer.parse_args is cli.parse_args

"""The trainer's public names: exactly these, and the same objects as their sources."""

from __future__ import annotations

import trainer
import trainer.run
from trainer import cli, config, train


def test_trainer_all():
    assert trainer.__all__ == ["RunResult", "TrainConfig", "parse_args"]
    assert trainer.RunResult is train.RunResult
    assert trainer.TrainConfig is config.TrainConfig and trainer.parse_args is cli.parse_args
    assert callable(train.run) and callable(trainer.run.main)

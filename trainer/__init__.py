"""The T5 conversion fine-tune: `python trainer/run.py` (CLI) or `trainer.run(config)` (Python)."""

from trainer.cli import parse_args
from trainer.config import TrainConfig
from trainer.train import RunResult, run

__all__ = ["RunResult", "TrainConfig", "parse_args", "run"]

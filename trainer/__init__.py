"""The T5 conversion fine-tune: `python trainer/run.py` (CLI) or `trainer.train.run(config)` (Python).

The Python entry lives in `trainer.train` (not re-exported here: the name `trainer.run` is the CLI
module `trainer/run.py`).
"""

from trainer.cli import parse_args
from trainer.config import TrainConfig
from trainer.train import RunResult

__all__ = ["RunResult", "TrainConfig", "parse_args"]

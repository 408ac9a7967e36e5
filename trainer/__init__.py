"""The T5 conversion fine-tune: `python trainer/run.py` (CLI) or `trainer.train.run(config)` (Python).

The Python entry lives in `trainer.train` (not re-exported here: the name `trainer.run` is the CLI
module `trainer/run.py`). The names below are imported on first use, so importing one module of the
package (`trainer.config`, say) loads no other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.cli import parse_args
    from trainer.config import TrainConfig
    from trainer.train import RunResult

__all__ = ["RunResult", "TrainConfig", "parse_args"]

_SOURCES = {"RunResult": "trainer.train", "TrainConfig": "trainer.config", "parse_args": "trainer.cli"}


def __getattr__(name: str) -> Any:
    if name in _SOURCES:
        return getattr(importlib.import_module(_SOURCES[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")

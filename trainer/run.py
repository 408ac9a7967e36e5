"""Command line of the trainer: parse, run, report; closes on every exit path.

    python trainer/run.py                                   # the built-in toy, one process
    python trainer/run.py --config trainer/configs/sd35_medium.toml --model.base /models/sd3.5-medium
    torchrun --nproc_per_node=4 trainer/run.py --config ... # DDP (or --parallel.mode fsdp2)

`python trainer/run.py --help` lists every setting.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the repository importable without installing it.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.cli import parse_args
from trainer.train import run

logger = logging.getLogger("trainer.run")


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train, print the result on rank 0. Returns the process exit code."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    config = parse_args(argv)
    try:
        result = run(config)
    except (FileNotFoundError, FileExistsError, PermissionError, ValueError, TypeError) as error:
        logger.error("%s", error)
        return 1
    if rank == 0:
        loss = result.last.get("loss/total", float("nan"))
        print(f"trained {result.step} steps ({result.stop_reason}), last loss {loss:.4f}; wrote {result.weights}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

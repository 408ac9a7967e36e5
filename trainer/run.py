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

from trainer.checkpoint import RunAlreadyFinished
from trainer.cli import parse_args
from trainer.planning.memory import PlanDoesNotFit
from trainer.train import RunResult, run

logger = logging.getLogger("trainer.run")


def _fail(message: object) -> int:
    """One line on stderr, no traceback: the messages name the problem and the fix."""
    print(f"trainer/run.py: error: {message}", file=sys.stderr)
    return 2


def _summary(result: RunResult) -> str:
    loss = result.last.get("loss/total")
    why = "--training.steps reached" if result.stop_reason == "steps" else "--training.max_minutes spent"
    loss_text = f", last loss {loss:.4f}" if loss is not None else ""
    done = f"trained to step {result.step} ({why}){loss_text}"
    if result.weights is None:
        return f"{done}; a baseline: no weights file written"
    return f"{done}; wrote {result.weights} and {result.output_dir / 'report.md'}"


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train, print the result on rank 0. Returns the process exit code."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        config = parse_args(argv)
    except (FileNotFoundError, ValueError, TypeError) as error:
        return _fail(error)
    try:
        result = run(config)
    except RunAlreadyFinished as finished:
        if rank == 0:
            print(finished)
        return 0
    except (OSError, ValueError, TypeError, PlanDoesNotFit) as error:  # files, permissions, the Hub, settings, memory
        return _fail(error)
    if rank == 0:
        print(_summary(result))
    return 0


if __name__ == "__main__":
    code = main()
    # End the process without finalizing the interpreter. gloo's worker threads outlive
    # destroy_process_group() (FSDP2's device mesh, kept by DTensor's caches, holds the group), and a
    # worker that drops a finished collective's tensors takes the GIL; if Python 3.11 starts finalizing
    # meanwhile it ends that thread inside a noexcept destructor, and the process aborts after a good run
    # ("terminate called without an active exception", pytorch/pytorch#190489). All output is written.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

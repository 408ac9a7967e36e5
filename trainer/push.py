"""Upload a run's weights file and model card to the Hugging Face Hub, without training: what
`--output.push_to_hub` does at the end of a run, on its own (to retry a failed upload, or share an earlier run).

    python trainer/push.py --output.dir runs/sd35m --output.push_to_hub your-name/sd35m-t5

The flags mean what they mean for `trainer/run.py`; the token and the Hub come from the same place
(`hf auth login` or HF_TOKEN, HF_ENDPOINT).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the repository importable without installing it.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.cli import add_flags
from trainer.config import OutputConfig
from trainer.publishing.hub import HubError, hub_target, push_to_hub
from trainer.publishing.model_card import RUN_CARD

PROG = "trainer/push.py"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Upload the weights file and model card (README.md) of a run folder to a Hub repo, in one commit.",
        allow_abbrev=False,
    )
    add_flags(
        parser,
        OutputConfig,
        section="output",
        only=("dir", "name", "push_to_hub", "hub_private"),
        required=("push_to_hub",),
    )
    return parser


def push_run(output: OutputConfig) -> str:
    """Check the target and the run folder, then upload (`trainer.publishing.hub.push_to_hub`).

    Returns:
        The commit's URL.

    Raises:
        FileNotFoundError: the folder lacks the weights file or its card.
        ValueError: no repo given, or as `hub_target`.
        PermissionError / trainer.publishing.hub.HubError: as `hub_target` and `push_to_hub`.
    """
    weights = Path(output.dir).expanduser() / output.name
    for path in (weights, weights.parent / RUN_CARD):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; give the --output.dir and --output.name of a finished trainer/run.py run."
            )
    target = hub_target(output)
    if target is None:
        raise ValueError("--output.push_to_hub: give the Hub repo to upload to (`namespace/name`).")
    return push_to_hub(target, weights)


def main(argv: list[str] | None = None) -> int:
    """Parse flags and upload. Returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    given = {flag.removeprefix("output."): value for flag, value in vars(_parser().parse_args(argv)).items()}
    try:
        url = push_run(OutputConfig(**given))
    except (FileNotFoundError, PermissionError, ValueError, HubError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(f"uploaded to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

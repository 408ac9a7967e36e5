"""The command line the ComfyUI acceptance checks in `tools/` share: which tree, where results go."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from benchmarks.timing import RESULTS_DIR
from testing import comfy_env


@dataclass(frozen=True)
class CheckArgs:
    """A check's ComfyUI tree and results folder."""

    tree: Path
    results_dir: Path


def parse_check_args(description: str, argv: list[str] | None = None) -> CheckArgs:
    """`--comfyui TREE` (default: the tree `testing/comfy_env.py` finds) and `--results-dir`; exits
    with the lookup's message when no tree is given or found."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--comfyui", type=Path, default=None, help="ComfyUI tree (default: as testing/comfy_env.py finds it)"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    tree = args.comfyui or comfy_env.locate()
    if tree is None:
        parser.error(f"pass --comfyui; {comfy_env.not_found_message()}")
    return CheckArgs(tree, args.results_dir)

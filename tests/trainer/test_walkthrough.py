"""docs/training.md's "Train your own T5 weights" runs as written, on the tiny ComfyUI layout.

The command is read from the section's code block, so the doc and this test cannot drift. Only two
things change: `~/ComfyUI` becomes the tiny install, and flags appended after the doc's own (later flags
win) shrink the recipe to one CPU step on the tiny model: its configs, 32 px, one bucket, one sampling
step, two prompts, fp32.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from testing.trainer_assets import write_comfyui
from trainer.cli import parse_args
from trainer.train import run

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
SECTION = "## Train your own T5 weights"
PROGRAM = ["python", "trainer/run.py"]


def tiny_flags(configs: Path, output: Path) -> list[str]:
    return [
        "--model.config", str(configs), "--data.resolution", "32", "--data.buckets", "1:1",
        "--data.generate_steps", "1", "--data.max_sequence_length", "8", "--data.prompt_limit", "2",
        "--data.shard_size", "2", "--training.batch_size", "2", "--training.accumulate", "2", "--training.steps", "1",
        "--training.precision",
        "fp32", "--training.gradient_checkpointing", "false", "--checkpoint.every", "0", "--output.dir", str(output),
        "--output.progress", "false", "--validation.holdout", "0", "--validation.samples_steps", "2",
    ]  # fmt: skip


def walkthrough_commands() -> list[list[str]]:
    """The `python trainer/run.py` commands of the section's code blocks, as argument lists."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = re.findall(r"^```bash\n(.*?)^```", text[start : end if end > 0 else None], re.MULTILINE | re.DOTALL)
    commands = [shlex.split(line) for line in "\n".join(blocks).replace("\\\n", " ").splitlines()]
    return [argv[len(PROGRAM) :] for argv in commands if argv[: len(PROGRAM)] == PROGRAM]


def test_the_section_has_one_command_from_a_comfyui_install_with_the_default_prompts():
    (argv,) = walkthrough_commands()
    assert argv[argv.index("--data.source") + 1] == "prompts" and "--data.path" not in argv
    assert argv[argv.index("--model.comfyui") + 1] == argv[argv.index("--output.comfyui") + 1] == "~/ComfyUI"


def test_walkthrough_runs_on_the_tiny_layout(tmp_path):
    install = write_comfyui(tmp_path, bundled=False)
    (argv,) = walkthrough_commands()
    argv = [str(install["comfyui"]) if arg == "~/ComfyUI" else arg for arg in argv]
    config = parse_args(argv + tiny_flags(install["configs"], tmp_path / "run"))
    result = run(config)
    landed = install["comfyui"] / "models" / "t5_linearize" / config.output.name
    assert result.step == 1 and landed.is_file()
    assert landed.read_bytes() == result.weights.read_bytes()
    assert (tmp_path / "run" / "data-cache" / "manifest.json").is_file()
    # The recipe validates: grids of the start and the end, to look at before the file reaches ComfyUI.
    assert {path.name for path in (tmp_path / "run" / "validation").glob("step_*.png")} == {
        "step_000000.png",
        "step_000001.png",
    }

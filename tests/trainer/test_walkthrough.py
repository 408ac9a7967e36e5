"""docs/training.md's "Train your own T5 weights" runs as written, on the tiny ComfyUI layout: the training
command, then the one that adapts its file to a fine-tune of the base.

The commands are read from the section's code blocks, so the doc and this test cannot drift. Only two
things change: `~/ComfyUI` becomes the tiny install, and flags appended after the doc's own (later flags
win) shrink the recipe to one CPU step on the tiny model: its configs, 32 px, one bucket, one sampling
step, two prompts, fp32.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from t5core.weights import load
from testing.trainer_assets import write_comfyui
from trainer.cli import parse_args
from trainer.train import run
from trainer.validation import GRID_LABEL_WIDTH, grid_name

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


def on_install(argv: list[str], comfyui: Path) -> list[str]:
    """`argv` with `~/ComfyUI` (alone or starting a path) pointing at the tiny install."""
    return [arg.replace("~/ComfyUI", str(comfyui), 1) if arg.startswith("~/ComfyUI") else arg for arg in argv]


def write_finetune(checkpoint: Path, name: str) -> Path:
    """A fine-tune of `checkpoint` beside it: every transformer weight moved a little, the rest as it is."""
    generator = torch.Generator().manual_seed(1)
    state = {
        key: tensor + 0.01 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        if key.startswith("model.diffusion_model.") and tensor.is_floating_point()
        else tensor
        for key, tensor in load_file(str(checkpoint)).items()
    }
    path = checkpoint.parent / name
    save_file(state, str(path))
    return path


def test_the_section_trains_from_a_comfyui_install_then_adapts_the_file_to_a_fine_tune():
    train, adapt = walkthrough_commands()
    for argv in (train, adapt):
        assert argv[argv.index("--data.source") + 1] == "prompts" and "--data.path" not in argv
        assert argv[argv.index("--model.comfyui") + 1] == argv[argv.index("--output.comfyui") + 1] == "~/ComfyUI"
    # the adaptation takes the training's recipe and starts from the file it installed
    assert "--model.start_from" not in train
    assert adapt[adapt.index("--config") + 1] == train[train.index("--config") + 1]


def test_walkthrough_runs_on_the_tiny_layout(tmp_path):
    install = write_comfyui(tmp_path, bundled=False)
    train, adapt = walkthrough_commands()
    config = parse_args(on_install(train, install["comfyui"]) + tiny_flags(install["configs"], tmp_path / "run"))
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

    # Step 4: the installed file adapted to a fine-tune of the base, installed beside it under its own name.
    installed = landed.read_bytes()
    write_finetune(install["checkpoint"], adapt[adapt.index("--model.base") + 1])
    adapted_config = parse_args(
        on_install(adapt, install["comfyui"]) + tiny_flags(install["configs"], tmp_path / "adapted")
    )
    assert Path(adapted_config.model.start_from) == landed
    adapted = run(adapted_config)
    adapted_landed = landed.parent / adapted_config.output.name
    assert adapted_landed != landed and adapted_landed.read_bytes() == adapted.weights.read_bytes()
    assert landed.read_bytes() == installed
    file, original = load(adapted_landed), load(landed)
    assert file.provenance["started_from"] == landed.name and file.fingerprint != original.fingerprint
    # Its validation has no softmax teacher (the file's deltas are in its weights from the start): T5 only.
    folder = tmp_path / "adapted" / "validation"
    assert not (folder / "teacher.safetensors").exists()
    with Image.open(folder / grid_name(0)) as start, Image.open(tmp_path / "run" / "validation" / grid_name(0)) as two:
        assert start.width - GRID_LABEL_WIDTH == (two.width - GRID_LABEL_WIDTH) // 2

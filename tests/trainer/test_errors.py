"""Bad inputs give clear errors before training, and never cost an earlier checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from testing.trainer_assets import write_base, write_cache
from trainer.checkpoint import CheckpointManager
from trainer.cli import parse_args
from trainer.config import ParallelConfig
from trainer.distributed import init_world
from trainer.optim import build_scheduler
from trainer.train import run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    not_sd3 = root / "unet"
    not_sd3.mkdir()
    (not_sd3 / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    save_file({"down_blocks.0.weight": torch.zeros(2)}, str(root / "unet.safetensors"))
    (root / "model.ckpt").write_bytes(b"pickle")
    (root / "model.gguf").write_bytes(b"GGUF")
    (root / "empty_images").mkdir()
    (root / "empty.txt").write_text("# only a comment\n\n")
    return dict(root=root, base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=4))


def flags(inputs, out, *extra, base=None, source="cache", path=None):
    return parse_args(
        [
            "--model.base", str(base or inputs["base"]),
            "--data.source", source,
            "--data.path", str(path or inputs["cache"]),
            "--training.batch_size", "4",
            "--training.steps", "2",
            "--output.dir", str(out),
            "--output.progress", "false",
            *extra,
        ]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("base", "error", "match"),
    [
        pytest.param("missing", FileNotFoundError, r"base model .*missing does not exist", id="missing-base"),
        pytest.param("unet", ValueError, r"describes a 'UNet2DConditionModel', not an SD3", id="folder-not-sd3"),
        pytest.param("unet.safetensors", ValueError, r"is not an SD3 / SD3.5 checkpoint", id="file-not-sd3"),
        pytest.param("model.ckpt", ValueError, r"only .safetensors checkpoints are read", id="pickle-checkpoint"),
        pytest.param("model.gguf", ValueError, r"GGUF checkpoint is quantized for inference", id="gguf-checkpoint"),
        pytest.param("empty_images", FileNotFoundError, r"is not a diffusers model folder", id="empty-folder-as-base"),
    ],
)
def test_bad_base(inputs, tmp_path, base, error, match):
    with pytest.raises(error, match=match):
        run(flags(inputs, tmp_path / "out", base=inputs["root"] / base))


@pytest.mark.parametrize(
    ("source", "path", "error", "match"),
    [
        pytest.param("images", "empty_images", ValueError, r"holds no images", id="empty-image-folder"),
        pytest.param(
            "images", "nowhere", FileNotFoundError, r"image folder .* does not exist", id="missing-image-folder"
        ),
        pytest.param("prompts", "empty.txt", ValueError, r"has no prompts", id="empty-prompts-file"),
        pytest.param("cache", "empty_images", FileNotFoundError, r"is not a prepared data cache", id="not-a-cache"),
    ],
)
def test_bad_data(inputs, tmp_path, source, path, error, match):
    # A pipeline folder is needed for images / prompts; the check on the data comes first.
    pipeline = inputs["root"] / "fake_pipeline"
    pipeline.mkdir(exist_ok=True)
    (pipeline / "model_index.json").write_text("{}")
    config = flags(
        inputs, tmp_path / "out", "--data.pipeline", str(pipeline), source=source, path=inputs["root"] / path
    )
    with pytest.raises(error, match=match):
        run(config)


def test_images_need_a_pipeline_folder(inputs, tmp_path):
    config = flags(inputs, tmp_path / "out", source="images", path=inputs["root"] / "empty_images")
    with pytest.raises(FileNotFoundError, match=r"is not a diffusers pipeline folder .* --data.pipeline"):
        run(config)


def test_unwritable_output_folder(inputs, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match=r"output folder .* is not writable .* --output.dir"):
        run(flags(inputs, blocker / "out"))


def test_batch_that_fits_no_bucket(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"no aspect bucket holds a full global batch of 8"):
        run(flags(inputs, tmp_path / "out", "--training.batch_size", "8"))


def test_memory_plan_refuses_a_run_that_cannot_fit(inputs, tmp_path):
    with pytest.raises(RuntimeError, match=r"needs about .* GiB per GPU but has 0.5 GiB"):
        run(flags(inputs, tmp_path / "out", "--parallel.gpu_memory_gib", "0.5"))


def test_failed_runs_keep_the_earlier_checkpoints(inputs, tmp_path):
    out = tmp_path / "out"
    run(flags(inputs, out, "--checkpoint.every", "1", "--checkpoint.keep", "2"))
    before = {p.relative_to(out): p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert {str(p.parent) for p in before} == {"checkpoints/step-1", "checkpoints/step-2"}
    with pytest.raises(FileExistsError, match=r"holds checkpoints of an earlier run .* --checkpoint.resume auto"):
        run(flags(inputs, out, "--checkpoint.resume", "never"))
    with pytest.raises(ValueError, match=r"trained with other settings: --training.seed 0 -> 1"):
        run(flags(inputs, out, "--training.seed", "1", "--training.steps", "3"))
    with pytest.raises(ValueError, match=r"trained with other settings: --model.joint_mode 'hybrid' -> 'ttt'"):
        run(flags(inputs, out, "--model.joint_mode", "ttt", "--training.steps", "3"))
    with pytest.raises(ValueError, match=r"trained with other settings: --model.neighborhood 0 -> 3"):
        run(flags(inputs, out, "--model.neighborhood", "3", "--training.steps", "3"))
    with pytest.raises(FileNotFoundError):
        run(
            flags(inputs, out, "--training.steps", "3", "--checkpoint.resume", "force", base=inputs["root"] / "missing")
        )
    after = {p.relative_to(out): p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert after == before


def test_a_project_readme_in_the_output_folder_is_refused_before_training(inputs, tmp_path):
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("# My project\n")
    with pytest.raises(FileExistsError, match=r"README.md exists and is not a model card .* folder of its own"):
        run(flags(inputs, out))
    assert (out / "README.md").read_text() == "# My project\n"
    assert sorted(path.name for path in out.iterdir()) == ["README.md"]
    run(flags(inputs, tmp_path / "run"))  # the run's own card is replaced when it trains again
    run(flags(inputs, tmp_path / "run", "--checkpoint.resume", "force"))


def test_checkpoint_write_failure_keeps_earlier_checkpoints(tmp_path):
    world = init_world(ParallelConfig(device="cpu"))
    try:
        model = nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = build_scheduler(optimizer, parse_args([]).optim, steps=10)
        manager = CheckpointManager(tmp_path / "checkpoints", world, keep=3)
        manager.track(model, optimizer, scheduler)
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        manager.save(1, state={"world_size": 1})
        (tmp_path / "checkpoints" / ".step-2.tmp").write_text("in the way")  # the temp folder cannot be made
        with pytest.raises(OSError, match=r"could not write checkpoint .*step-2 .* the earlier checkpoints are intact"):
            manager.save(2, state={"world_size": 1})
        assert manager.steps() == [1]
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        assert manager.load(manager.latest()).step == 1
        torch.testing.assert_close(model.weight.detach(), saved, rtol=0, atol=0)
    finally:
        world.close()


def test_cli_reports_a_bad_input_and_exits_2(inputs, tmp_path, capsys):
    from trainer.run import main

    code = main(["--model.base", str(inputs["root"] / "missing"), "--data.source", "cache", "--data.path", "x",
                 "--output.dir", str(tmp_path / "out")])  # fmt: skip
    assert code == 2
    assert "does not exist. Give --model.base" in capsys.readouterr().err

"""Attention transfer (`--transfer.*`): the stage before the fine-tune that trains each converted module's T5
parameters to reproduce its softmax output on the softmax model's own activations."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from t5core.config import T5Config
from t5core.hosts.diffusers import linearize
from testing.models import tiny_inputs
from testing.trainer_assets import cache_run_flags, write_base, write_cache
from trainer.checkpoint import CheckpointManager, RunAlreadyFinished
from trainer.cli import parse_args
from trainer.metrics import read_metrics
from trainer.model import load_base
from trainer.train import run
from trainer.transfer import STAGE, TransferCapture


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer")
    return dict(base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=4))


def config_for(inputs, out, *flags):
    return parse_args(cache_run_flags(inputs["base"], inputs["cache"], out, "--model.joint_mode", "hybrid", *flags))


def _module_errors(handle) -> dict[str, float]:
    """Each converted module's MSE to its softmax output on one fixed batch (no training)."""
    capture = TransferCapture(handle)
    inputs = tiny_inputs(latent_hw=(8, 12))
    params = list(handle.t5_parameters())
    try:
        with torch.no_grad(), handle.softmax(), capture.recording((4, 6)) as losses:
            handle.model(**inputs, return_dict=False)
    finally:
        capture.remove()
        for param in params:
            param.grad = None
    return {name: float(loss) for name, loss in losses.items()}


def test_softmax_context_is_the_base_model_exactly(inputs):
    base = load_base(config_for(inputs, "unused").model)
    expected = base(**tiny_inputs(latent_hw=(8, 12)), return_dict=False)[0]
    handle = linearize(base, layers="all")
    with torch.no_grad(), handle.softmax():
        inside = handle.model(**tiny_inputs(latent_hw=(8, 12)), return_dict=False)[0]
    converted = handle.model(**tiny_inputs(latent_hw=(8, 12)), return_dict=False)[0]
    assert torch.equal(inside, expected)
    assert not torch.equal(converted, expected)


def test_transfer_only_trains_the_t5_parameters_toward_softmax(inputs, tmp_path):
    config = config_for(
        inputs, tmp_path, "--transfer.steps", "6", "--transfer.lr", "3e-3", "--training.steps", "0",
        "--checkpoint.every", "0",
    )  # fmt: skip
    fresh = linearize(load_base(config.model), config=T5Config(joint_mode="hybrid"), layers="all")
    before = _module_errors(fresh)
    result = run(config)
    after = _module_errors(result.handle)
    assert before.keys() == after.keys() and len(after) == len(result.handle.modules)
    improved = [name for name in after if after[name] < before[name]]
    assert len(improved) == len(after), {name: (before[name], after[name]) for name in after}
    # inherited weights untouched: the file holds T5 parameters and no delta
    stored = load_file(str(result.weights))
    assert stored and not any(key.startswith(("delta.", "base.")) for key in stored)
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert all(line["stage"] == STAGE for line in lines)
    assert set(lines[0]) >= {"transfer/loss", "lr/transfer", *(f"transfer/{name}" for name in after)}
    assert result.step == 0


def test_a_finished_transfer_only_run_is_left_alone(inputs, tmp_path):
    flags = ("--transfer.steps", "2", "--training.steps", "0")
    run(config_for(inputs, tmp_path, *flags))
    written = (tmp_path / "t5.safetensors").stat().st_mtime_ns
    with pytest.raises(RunAlreadyFinished, match="finished transfer-only run"):
        run(config_for(inputs, tmp_path, *flags))
    assert (tmp_path / "t5.safetensors").stat().st_mtime_ns == written


class _Killed(Exception):
    pass


def test_an_interrupted_transfer_resumes_to_the_same_weights(inputs, tmp_path, monkeypatch):
    flags = ("--transfer.steps", "4", "--training.steps", "2", "--checkpoint.every", "2")
    whole = run(config_for(inputs, tmp_path / "whole", *flags))
    save = CheckpointManager.save

    def save_then_die(self, step, **kwargs):
        path = save(self, step, **kwargs)
        if self.folder.name == STAGE and step == 2:
            raise _Killed
        return path

    monkeypatch.setattr(CheckpointManager, "save", save_then_die)
    with pytest.raises(_Killed):
        run(config_for(inputs, tmp_path / "resumed", *flags))
    monkeypatch.undo()
    resumed = run(config_for(inputs, tmp_path / "resumed", *flags))
    lines = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [(line.get("stage"), line["step"]) for line in lines] == [
        (STAGE, 1), (STAGE, 2), (STAGE, 3), (STAGE, 4), (None, 1), (None, 2),
    ]  # fmt: skip
    reference, got = load_file(str(whole.weights)), load_file(str(resumed.weights))
    assert reference.keys() == got.keys()
    for key in reference:
        assert torch.equal(got[key], reference[key]), key


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--training.steps", "0"], "--training.steps: is 0 and so is --transfer.steps", id="nothing"),
        pytest.param(["--transfer.lr", "0"], "--transfer.lr: must be positive", id="lr"),
    ],
)
def test_bad_transfer_settings_name_the_flag(inputs, tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        config_for(inputs, tmp_path, *flags)


def test_a_transfer_left_to_run_under_fsdp2_is_refused_before_loading(inputs, tmp_path):
    config = config_for(inputs, tmp_path, "--transfer.steps", "2", "--parallel.mode", "fsdp2")
    with pytest.raises(ValueError, match="2 attention-transfer steps are left to run.*--parallel.mode ddp"):
        run(config)
    assert not (tmp_path / "config.toml").exists()

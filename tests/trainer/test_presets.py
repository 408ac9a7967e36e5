"""The model-preset registry: the toy is found by name, its card hashes the file it loads, files are not
presets, names are unique."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from sd3_testbed import preset, report
from trainer.cli import parse_args
from trainer.config import TrainingConfig
from trainer.presets import get_preset, preset_data_sources, register_preset


def test_the_toy_is_a_registered_preset_with_its_own_data():
    preset = get_preset("toy")
    assert preset is not None and preset.name == "toy" and preset.data_source == "toy"
    assert "toy" in preset_data_sources()


def test_the_toy_card_hashes_the_files_its_base_is_read_from(monkeypatch):
    read = []
    load_file = safetensors.torch.load_file

    def recording_load_file(path, *args, **kwargs):
        read.append(Path(path).resolve())
        return load_file(path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", recording_load_file)
    preset = get_preset("toy")
    preset.load_base()
    files = preset.weight_files()
    assert read and set(read) == {path.resolve() for path in files.values()}
    assert all(path.name == name and path.is_file() for name, path in files.items())


@pytest.mark.parametrize("base", ["/models/sd3.5_medium.safetensors", "stabilityai/stable-diffusion-3.5-medium"])
def test_files_folders_and_repo_ids_are_not_presets(base):
    assert get_preset(base) is None


def test_a_name_can_be_registered_once():
    toy = get_preset("toy")
    assert register_preset(toy) is toy  # the same object again is a no-op
    with pytest.raises(ValueError, match="a model preset named 'toy' is already registered"):
        register_preset(replace(toy, description="another toy"))
    assert get_preset("toy") is toy


def test_toy_evaluation_samples_an_fp32_copy_whenever_the_config_autocasts(monkeypatch, tmp_path):
    # The rule has one owner, `TrainingConfig.autocast_dtype`; the evaluation must follow it, not the flag.
    monkeypatch.setattr(TrainingConfig, "autocast_dtype", property(lambda self: torch.bfloat16))
    sampled = []

    def stop(teacher, student, **kwargs):
        sampled.append(student)
        raise InterruptedError

    monkeypatch.setattr(report, "compare", stop)
    student = torch.nn.Linear(2, 2).to(torch.bfloat16)
    world = SimpleNamespace(is_main=True, world_size=1, device=torch.device("cpu"))
    config = parse_args(["--output.toy_eval_samples", "2", "--output.dir", str(tmp_path)])
    with pytest.raises(InterruptedError):
        preset.evaluate_toy(student, config, tmp_path, world)
    assert sampled[0].weight.dtype == torch.float32 and student.weight.dtype == torch.bfloat16


def _built(base: str):
    """The toy converted and split by the trainer's model step for `--model.base base`, from seed 0."""
    from trainer.model import build_model, load_base
    from trainer.seeds import seed_everything

    config = parse_args(["--model.base", base])
    seed_everything(0)
    return build_model(load_base(config.model), config)


def test_toy_linear_runs_plain_linear_attention_in_place_of_every_t5_computation():
    from sd3_testbed.baselines import PlainLinearAttention

    handle, split = _built("toy-linear")
    modules = list(handle.modules.values())
    assert modules and all(isinstance(module.forward.__self__, PlainLinearAttention) for module in modules)
    q, k, v = torch.randn(3, 1, 8, 2, 4).unbind(0)
    assert torch.equal(modules[0](q, k, v, grid=(2, 4)), PlainLinearAttention()(q, k, v))
    t5 = {name for name, _ in handle.model.named_parameters() if ".processor.t5." in name}
    assert split.new == () and t5 <= set(split.frozen)  # the unused T5 parameters are frozen


def test_toy_no_inherit_reinitialises_the_converted_projections_which_train_as_new():
    handle, split = _built("toy-no-inherit")
    _, reference = _built("toy")
    moved = set(split.new) - set(reference.new)
    assert moved and all(".attn" in name for name in moved)
    assert moved == set(reference.inherited) - set(split.inherited)
    assert set(split.frozen) == set(reference.frozen)  # the dead text-query path stays frozen
    base = dict(get_preset("toy").load_base().named_parameters())
    params = dict(handle.model.named_parameters())
    weights = [name for name in moved if name.endswith("to_q.weight")]
    assert weights and not any(torch.equal(params[name], base[name]) for name in weights)


@pytest.mark.parametrize("base", ["toy-linear", "toy-no-inherit"])
def test_a_baseline_trains_and_writes_no_weights_file(tmp_path, base):
    """No T5 weights file holds a baseline's student (another attention, re-initialised base weights): its
    run trains it and writes no file, report or card that would pass it off as one."""
    from trainer.train import run

    config = parse_args(
        [
            "--model.base", base, "--training.steps", "1", "--training.batch_size", "2",
            "--output.dir", str(tmp_path), "--output.progress", "false", "--output.toy_eval_samples", "0",
        ]
    )  # fmt: skip
    result = run(config)
    assert result.step == 1 and result.weights is None
    assert not any((tmp_path / name).exists() for name in ("t5.safetensors", "report.json", "README.md"))


@pytest.mark.parametrize("flag", ["--output.comfyui", "--output.push_to_hub"])
def test_a_baseline_refuses_a_copy_or_upload(tmp_path, flag):
    with pytest.raises(ValueError, match=f"{flag}: the toy-linear base is a baseline"):
        parse_args(["--model.base", "toy-linear", flag, str(tmp_path)])


def test_a_toy_finetune_preset_loads_its_file_and_draws_its_palette(tmp_path):
    """`register_toy_finetune`: the base is the given checkpoint (hashed on the card) and every training
    sample is the toy's sample of the same seed with its colours in the given palette."""
    from sd3_testbed import data as toy_data
    from sd3_testbed.model import WEIGHTS_FILE
    from trainer.config import DataConfig

    weights = safetensors.torch.load_file(str(WEIGHTS_FILE))
    moved = {name: tensor + 0.01 if name.endswith("qkv.weight") else tensor for name, tensor in weights.items()}
    path = tmp_path / "finetune.safetensors"
    safetensors.torch.save_file(moved, str(path))
    finetune = preset.register_toy_finetune("toy-finetune-test", path, "rotated")
    assert get_preset("toy-finetune-test") is finetune and finetune.weight_files() == {path.name: path}
    state = finetune.load_base().state_dict()
    teacher = get_preset("toy").load_base().state_dict()
    changed = [name for name in state if not torch.equal(state[name], teacher[name])]
    assert changed and all(
        name.rsplit(".", 2)[-2] in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
        for name in changed
    )
    batch = finetune.build_source(DataConfig()).load([5, 6])
    rotated = [toy_data.make_batch(1, seed=seed, palette=toy_data.PALETTES["rotated"]) for seed in (5, 6)]
    assert torch.equal(batch.latents, torch.cat([part.latents for part in rotated]))
    assert not torch.equal(batch.latents, get_preset("toy").build_source(DataConfig()).load([5, 6]).latents)
    assert finetune.evaluate(None, None, tmp_path, None) is None


def test_a_toy_finetune_preset_names_the_palettes_it_knows(tmp_path):
    with pytest.raises(KeyError, match="give one of"):
        preset.register_toy_finetune("toy-finetune-bad", tmp_path / "finetune.safetensors", "sepia")

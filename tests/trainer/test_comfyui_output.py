"""`--output.comfyui` and the model card: the weights file and its card land in ComfyUI's
`models/t5_linearize/` atomically, a wrong folder or a different file of the same name is refused before
training, and the card says what the file was made from, how, and how to use it."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest

from sd3_testbed.model import WEIGHTS_FILE
from testing.trainer_assets import write_base, write_cache
from tests.trainer.test_run_cli import _argv as cli_argv
from trainer.cli import parse_args
from trainer.config import ModelConfig
from trainer.publishing.model_card import base_digests, card_name, model_card
from trainer.run import main


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfyui_output")
    return dict(base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=4))


def _argv(inputs, out, comfyui, *extra: str) -> list[str]:
    return cli_argv(inputs, out, "--output.comfyui", str(comfyui), *extra)


def _comfyui(tmp_path, marker: str = "models"):
    root = tmp_path / "ComfyUI"
    if marker == "models":
        (root / "models" / "checkpoints").mkdir(parents=True)
    else:
        root.mkdir()
        (root / "main.py").write_text("")
    return root


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _one_line_error(capsys) -> str:
    error = capsys.readouterr().err
    assert error.startswith("trainer/run.py: error: ") and error.count("\n") == 1, error
    return error


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("marker", ["models", "main.py"])
def test_the_weights_and_card_are_installed_in_comfyui(inputs, tmp_path, marker):
    comfyui, out = _comfyui(tmp_path, marker), tmp_path / "out"
    assert main(_argv(inputs, out, comfyui, "--output.name", "tiny_t5.safetensors")) == 0
    folder = comfyui / "models" / "t5_linearize"
    assert sorted(_files(folder)) == ["tiny_t5.md", "tiny_t5.safetensors"]  # no temp file left behind
    assert (folder / "tiny_t5.safetensors").read_bytes() == (out / "tiny_t5.safetensors").read_bytes()
    assert (folder / "tiny_t5.md").read_text() == (out / "README.md").read_text()
    # Written like a plain open(): readable by a ComfyUI running as another user, not mkstemp's 0600.
    mask = os.umask(0)
    os.umask(mask)
    assert (folder / "tiny_t5.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask


def test_the_same_run_trained_again_replaces_its_own_export(inputs, tmp_path, capsys):
    comfyui, out = _comfyui(tmp_path), tmp_path / "out"
    assert main(_argv(inputs, out, comfyui, "--training.steps", "1")) == 0
    first = (comfyui / "models" / "t5_linearize" / "t5.safetensors").read_bytes()
    assert main(_argv(inputs, out, comfyui, "--checkpoint.resume", "force")) == 0, capsys.readouterr().err
    installed = (comfyui / "models" / "t5_linearize" / "t5.safetensors").read_bytes()
    assert installed == (out / "t5.safetensors").read_bytes() != first


def test_a_folder_that_is_not_comfyui_is_refused_before_anything_is_written(inputs, tmp_path, capsys):
    elsewhere = tmp_path / "downloads"
    elsewhere.mkdir()
    out = tmp_path / "out"
    assert main(_argv(inputs, out, elsewhere)) == 2
    error = _one_line_error(capsys)
    assert f"--output.comfyui {elsewhere} is not a ComfyUI folder (no models/ or main.py)" in error
    assert "give the folder that holds ComfyUI's models/" in error
    assert not out.exists() and not list(elsewhere.iterdir())


@pytest.mark.parametrize("taken", ["t5.safetensors", "t5.md"])
def test_a_different_file_of_the_same_name_is_refused_before_training(inputs, tmp_path, capsys, taken):
    comfyui, out = _comfyui(tmp_path), tmp_path / "out"
    folder = comfyui / "models" / "t5_linearize"
    folder.mkdir()
    (folder / taken).write_bytes(b"someone else's file")
    assert main(_argv(inputs, out, comfyui)) == 2
    error = _one_line_error(capsys)
    assert f"{folder / taken} already exists and is not this run's export" in error
    assert "Choose another --output.name" in error
    assert not out.exists() and _files(folder) == {taken: b"someone else's file"}


def _report(**extra) -> dict:
    return {
        "step": 7,
        "stop_reason": "time",
        "processes": 2,
        "last_step": {"loss/total": 0.51234, "loss/flow": 0.5, "lr/new": 1e-3},
        "parameters": {"new": 10, "inherited": 4, "frozen": 3},
        "converted_layers": ["blocks.0.attn", "blocks.0.attn2"],
        "base_sha256": {"transformer/diffusion_pytorch_model.safetensors": "ab" * 32},
        **extra,
    }


def test_the_model_card_says_what_the_file_is_and_how_to_use_it():
    config = parse_args(
        ["--model.base", "/models/sd35m", "--data.source", "images", "--data.path", "/data", "--model.layers",
         "joint:0-1", "--model.trainable", "attention", "--optim.lr", "2e-4", "--training.steps", "9",
         "--training.precision", "bf16"]
    )  # fmt: skip
    card = model_card(config, _report(), weights_name="sd35m_t5.safetensors")
    assert card.startswith("# T5 attention weights: `sd35m_t5.safetensors`\n") and card.endswith("\n")
    assert (
        "`/models/sd35m`" in card and f"| `transformer/diffusion_pytorch_model.safetensors` | `{'ab' * 32}` |" in card
    )
    assert "| layer spec (`--model.layers`) | `joint:0-1` |" in card
    assert "Converted attention modules (2): `blocks.0.attn`, `blocks.0.attn2`." in card
    assert "| trainable | `attention` |" in card and "| lr of new T5 parameters | `0.004` |" in card
    assert "| lr of inherited parameters | `0.0002` |" in card
    frozen = dataclasses.replace(config, model=dataclasses.replace(config.model, trainable="t5"))
    assert "| lr of inherited parameters | `frozen` |" in model_card(frozen, _report(), weights_name="x.safetensors")
    assert "| precision | `bf16` |" in card and "| steps | `9` |" in card and "| processes | `2 (ddp)` |" in card
    assert "[training]\nbatch_size = 16\naccumulate = 1\nsteps = 9\n" in card  # the resolved config, whole
    assert "Trained to step 7; stopped: `--training.max_minutes` spent." in card
    assert "* `loss/total`: 0.5123" in card and "lr/new" not in card.split("## Training")[1].split("##")[0]
    assert "None ran in this run" in card
    assert "`ComfyUI/models/t5_linearize/`" in card and "**T5 Linearize**" in card and "`layers`" in card
    assert "both hosts add to the model they are given" in card and "(full deltas," in card
    assert "`t5xxl` text encoder" in card
    assert "| low-rank deltas (`--model.rank`, alpha) | `off (full)` |" in card and "attention transfer" not in card
    lora = parse_args(
        ["--model.base", "/models/sd35m", "--data.source", "images", "--data.path", "/data", "--model.rank", "16",
         "--model.trainable", "attention", "--transfer.steps", "500", "--transfer.lr", "3e-3"]
    )  # fmt: skip
    card = model_card(lora, _report(), weights_name="sd35m_t5.safetensors")
    assert "| low-rank deltas (`--model.rank`, alpha) | `16, 16` |" in card and "(rank-16 deltas," in card
    assert "| attention transfer | `500 steps, lr 0.003, uniform timesteps` |" in card


def test_the_toy_card_has_the_toyeval_table():
    score = dict(overall=0.8, color=0.9, shape=0.7, position=0.85, size=0.75)
    toy_eval = {
        "teacher": {"toyeval": score, "val_loss": 0.3, "background": 0.0003, "open_background": 0.00009},
        "student": {
            "toyeval": {**score, "overall": 0.6},
            "val_loss": 0.35,
            "background": 0.007,
            "open_background": 0.0026,
            "token_period_energy": 0.01,
        },
        "teacher_distance": 0.12,
        "paired": {"mean": -0.2, "low": -0.3, "high": -0.1, "samples": 180},
    }
    card = model_card(parse_args([]), _report(toy_eval=toy_eval), weights_name="t5.safetensors")
    assert "the built-in toy SD3.5-Medium-like model" in card
    assert (
        "| softmax teacher | 0.800 | 0.900 | 0.700 | 0.850 | 0.750 | 0.3000 | 0.0000 | 0.0003 | 0.00009 | - |" in card
    )
    assert "| T5 | 0.600 | 0.900 | 0.700 | 0.850 | 0.750 | 0.3500 | 0.1200 | 0.0070 | 0.00260 | 0.0100 |" in card
    assert "| model | bias |" not in card  # a report from before the measure renders without its table
    toy_eval["teacher"]["background_error"] = {"bias": -0.0117, "noise": 0.0062, "token_pattern": 0.0035, "lit": 0.03}
    toy_eval["student"]["background_error"] = {"bias": -0.0006, "noise": 0.0094, "token_pattern": 0.0055, "lit": 0.48}
    card = model_card(parse_args([]), _report(toy_eval=toy_eval), weights_name="t5.safetensors")
    assert "| softmax teacher | -0.0117 | 0.0062 | 0.0035 | 0.03 |" in card
    assert "| T5 | -0.0006 | 0.0094 | 0.0055 | 0.48 |" in card
    assert "-0.200 ToyEval, 95% interval [-0.300, -0.100]" in card
    assert "ModelSamplingSD3" in card


def test_base_digests_hash_the_files_the_base_is_loaded_from(inputs, tmp_path):
    assert base_digests(ModelConfig(base="toy")) == {WEIGHTS_FILE.name: _sha(WEIGHTS_FILE.read_bytes())}
    weights = inputs["base"] / "diffusion_pytorch_model.safetensors"
    assert base_digests(ModelConfig(base=str(inputs["base"]))) == {weights.name: _sha(weights.read_bytes())}
    pipeline = tmp_path / "pipeline"
    (pipeline / "transformer").mkdir(parents=True)
    for name in ("config.json", weights.name):
        (pipeline / "transformer" / name).write_bytes((inputs["base"] / name).read_bytes())
    assert base_digests(ModelConfig(base=str(pipeline))) == {f"transformer/{weights.name}": _sha(weights.read_bytes())}
    assert base_digests(ModelConfig(base=str(weights))) == {weights.name: _sha(weights.read_bytes())}


def test_card_names_do_not_collide_in_a_shared_folder():
    assert card_name("sd35_large_t5.safetensors") == "sd35_large_t5.md"
    assert card_name("sd35_medium_t5.safetensors") != card_name("sd35_large_t5.safetensors")


def test_a_toy_run_installed_in_comfyui_runs_in_the_node_as_it_ran_in_the_trainer(comfy, tmp_path):
    env = comfy  # `import comfy.sd` below rebinds the name to ComfyUI's package
    import comfy.sd
    import comfy.utils
    import folder_paths
    import torch

    from sd3_testbed.data import embed_captions
    from testing.comfy_tiny import predict
    from trainer.train import run

    name = "toy_installed_t5.safetensors"
    env.models_dir.mkdir(exist_ok=True)  # a ComfyUI install ships models/; the test base dir makes it lazily
    # A large lr from step 1 moves every weight by about 1e-3 a step (Adam): a file whose fine-tuned
    # base.* weights were not applied would miss the tolerance below by far. fp32 base.*, so that the
    # comparison is of two implementations, not of the default float16 rounding (docs/training.md).
    argv = [
        "--training.steps", "2", "--training.batch_size", "2", "--training.threads", "1",
        "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--output.dir", str(tmp_path / "out"), "--output.progress", "false", "--output.toy_eval_samples", "0",
        "--output.comfyui", str(env.base_dir), "--output.name", name, "--output.base_dtype", "fp32",
    ]  # fmt: skip
    result = run(parse_args(argv))
    assert name in folder_paths.get_filename_list("t5_linearize")
    assert (env.models_dir / "t5_linearize" / card_name(name)).is_file()
    node = env.nodes.NODE_CLASS_MAPPINGS["T5Linearize"]
    assert node.validate_inputs(weights=name, layers="", enabled=True) is True
    toy = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(str(WEIGHTS_FILE)))
    patched = node.execute(model=toy, weights=name, layers="", enabled=True).result[0]

    x = torch.randn(2, 16, 12, 20, generator=torch.Generator().manual_seed(0))
    context, pooled = embed_captions(["small red circle top left", "large blue square center"])
    theirs = predict(patched, x, 0.6, context, pooled)
    with torch.no_grad():
        ours = result.handle.model.eval()(
            hidden_states=x,
            encoder_hidden_states=context,
            pooled_projections=pooled,
            timestep=torch.full((2,), 600.0),
            return_dict=False,
        )[0]
    # The trained student (T5 modules and fine-tuned base.* weights) in fp32 by two implementations.
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

"""The trainer's config: flags and TOML generated from the sections, precedence, clear errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import build_parser, parse_args
from trainer.config import DataConfig, TrainConfig
from trainer.config_file import config_from_toml_text, config_to_toml, save_config
from trainer.train import run


def test_defaults_are_the_toy_preset():
    config = parse_args([])
    assert config == TrainConfig()
    assert (config.model.base, config.data.source) == ("toy", "toy")


def test_the_default_run_is_the_measured_full_linear_row():
    """`python trainer/run.py` trains the frontier row that ships (docs/toy.md): `all` hybrid, 150 steps."""
    from experiments.ablations import FRONTIER_ROWS

    row = next(row for row in FRONTIER_ROWS if row.name == "run-all-hybrid-1.25x")
    assert parse_args(list(row.trainer_flags(seed=0))) == parse_args([])


def test_flags_override_toml_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[training]\nsteps = 7\nbatch_size = 4\n[optim]\nlr = 3e-4\n[model]\nkey_norm_eps = "none"\n')
    config = parse_args(["--config", str(path), "--training.steps", "9", "--model.locality", "false"])
    assert config.training.steps == 9  # flag beats TOML
    assert config.training.batch_size == 4  # TOML beats default
    assert config.optim.lr == 3e-4
    assert config.model.key_norm_eps is None
    assert config.model.locality is False
    assert config.optim.new_lr_mult == TrainConfig().optim.new_lr_mult  # default kept


def test_help_lists_every_field_with_its_docstring(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for section in TrainConfig.sections():
        for item in dataclasses.fields(getattr(TrainConfig(), section)):
            assert f"--{section}.{item.name}" in text
    assert "Multiplier of `lr` for the new T5 parameters" in text
    assert "{swiglu,mlp}" in text


def test_resolved_config_round_trips(tmp_path):
    config = parse_args(["--training.steps", "3", "--model.key_norm_eps", "none", "--output.dir", str(tmp_path / "o")])
    path = save_config(config, tmp_path / "config.toml")
    assert config_from_toml_text(path.read_text()) == config
    assert parse_args(["--config", str(path)]) == config
    assert "steps = 3" in config_to_toml(config)


@pytest.mark.parametrize(
    ("toml", "error", "match"),
    [
        pytest.param(
            "[training]\nstep = 3\n", ValueError, r"\[training\] has unknown key\(s\) \['step'\]", id="unknown-key"
        ),
        pytest.param("[trainer]\nsteps = 3\n", ValueError, r"\[trainer\] is not a section", id="unknown-section"),
        pytest.param(
            '[model]\nvariant = "gelu"\n', ValueError, r"--model.variant: 'gelu' is not one of", id="bad-choice"
        ),
        pytest.param('[training]\nsteps = "many"\n', TypeError, r"--training.steps: expected int", id="bad-type"),
        pytest.param("[training\n", ValueError, r"is not valid TOML", id="not-toml"),
    ],
)
def test_bad_config_file_names_the_problem(tmp_path, toml, error, match):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(error, match=match):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        pytest.param(["--training.batch_size", "0"], r"--training.batch_size: must be at least 1", id="batch-0"),
        pytest.param(["--optim.lr", "-1"], r"--optim.lr: must be positive", id="negative-lr"),
        pytest.param(["--optim.beta2", "1.0"], r"--optim.beta2: must be in \[0, 1\)", id="beta2"),
        pytest.param(
            ["--model.merge", "learned", "--model.joint_mode", "ttt"],
            r"--model.merge: `learned` .* add --model.joint_mode hybrid",
            id="merge-ttt",
        ),
        pytest.param(["--loss.flow_weight", "0"], r"--loss.flow_weight: all loss weights are 0", id="no-loss"),
        pytest.param(["--data.resolution", "100"], r"--data.resolution: must be a multiple of 16", id="resolution"),
        pytest.param(["--data.resolution", "112"], r"--data.resolution: the toy draws 32 to 96 px", id="toy-large"),
        pytest.param(["--data.resolution", "16"], r"--data.resolution: the toy draws 32 to 96 px", id="toy-small"),
        pytest.param(["--data.source", "images"], r"--data.path: source 'images' needs a path", id="no-path"),
        pytest.param(
            ["--data.source", "cache", "--data.path", "x"], r"--data.source: the toy base trains", id="toy-mix"
        ),
        pytest.param(
            ["--model.base", "/models/sd35m", "--data.source", "toy"],
            r"--data.source: --data.source 'toy' belongs to a built-in model",
            id="toy-data-for-a-real-base",
        ),
        pytest.param(["--optim.min_lr_ratio", "1.5"], r"--optim.min_lr_ratio: must be in \[0, 1\]", id="lr-floor"),
        pytest.param(["--output.name", "t5.pt"], r"--output.name: must end in .safetensors", id="name"),
        pytest.param(
            ["--output.name", "../t5.safetensors"], r"--output.name: is a file name, not a path", id="name-path"
        ),
        pytest.param(["--model.neighborhood", "4"], r"--model.neighborhood: must be 0 \(off\) or an odd", id="even-na"),
    ],
)
def test_bad_values_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        parse_args(flags)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; check the --config path"):
        parse_args(["--config", str(tmp_path / "nope.toml")])


@pytest.mark.parametrize(
    ("name", "mode"), [pytest.param("sd35_medium", "ddp", id="medium"), pytest.param("sd35_large", "fsdp2", id="large")]
)
def test_shipped_recipes_parse(name, mode):
    from trainer.model import CONFIGS_DIR

    path = CONFIGS_DIR.parent / f"{name}.toml"
    config = parse_args(["--config", str(path), "--model.base", "/models/sd", "--data.path", "/data/images"])
    assert (config.parallel.mode, config.training.precision) == (mode, "bf16")
    assert (config.model.layers, config.model.joint_mode, config.training.steps) == ("all", "hybrid", 3750)
    assert config.optim.new_lr_mult == 10.0 and config.optim.inherited_lr_mult == 0.1


def test_the_toy_full_linear_recipe_is_the_measured_one():
    """trainer/configs/toy_all_hybrid.toml is the recipe of ablations_1800_480.json: the toy's defaults with
    every module converted, hybrid joint attention and 480 steps."""
    import json

    from trainer.model import CONFIGS_DIR

    config = parse_args(["--config", str(CONFIGS_DIR.parent / "toy_all_hybrid.toml")])
    assert (config.model.base, config.model.layers, config.model.joint_mode) == ("toy", "all", "hybrid")
    results = CONFIGS_DIR.parents[2] / "experiments" / "results" / "ablations_1800_480.json"
    budget = json.loads(results.read_text())["meta"]["budget"]
    assert config.training.steps == budget["steps"] and config.training.batch_size == budget["batch_size"]
    assert config.data.caption_dropout == budget["caption_dropout"]
    optim = {name: getattr(config.optim, name) for name in budget["optim"]}
    assert optim == budget["optim"]


def test_a_config_is_built_without_the_rest_of_the_trainer():
    code = (
        "import sys; from trainer.config import DataConfig, TrainConfig;"
        "TrainConfig(data=DataConfig(source='images'));"
        "print(sorted(m for m in sys.modules if m.startswith('trainer')))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "['trainer', 'trainer.config']"


def test_run_checks_a_config_it_was_handed_before_any_work(tmp_path):
    config = TrainConfig(data=DataConfig(source="cache", path=str(tmp_path / "cache")))
    config.output.dir = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"--data.source: the toy base trains on its own data"):
        run(config)
    assert not (tmp_path / "out").exists()


def test_the_model_section_carries_every_t5_setting_with_t5configs_default():
    """`T5Config` is the carrier: each of its settings is a `[model]` field of the same name and default, which
    the conversion, the resume check and the model card read by `T5_SETTINGS` (a new setting fails here first).
    One default differs on purpose: the library's is the paper's T5 over all tokens, the trainer's the hybrid
    joint attention of full linear time."""
    from t5core.config import T5_SETTINGS, T5Config
    from trainer.config import ModelConfig

    assert T5_SETTINGS == ("variant", "key_norm_eps", "locality", "joint_mode", "merge", "neighborhood")
    assert ModelConfig().t5_config() == T5Config(joint_mode="hybrid")
    changed = ModelConfig(joint_mode="hybrid", merge="learned", neighborhood=5, key_norm_eps=None)
    assert changed.t5_config().settings() == {name: getattr(changed, name) for name in T5_SETTINGS}

"""Runs that start from a T5 weights file (`--model.start_from`): a file adapted to another base."""

from __future__ import annotations

import pytest
import torch

from t5core.hosts.diffusers import arch_of, linearize
from t5core.weights import build_modules, load, save
from testing.models import tiny_inputs
from testing.trainer_assets import cache_run_flags, write_base, write_cache
from trainer.cli import parse_args
from trainer.distributed import World
from trainer.model import base_fingerprint, build_model, load_base
from trainer.publishing.export import export_run, record_base
from trainer.seeds import seed_everything
from trainer.train import run

FILES = {
    # the file's recipe differs from the test runs' defaults in joint mode and rank, which a start takes
    "low-rank": ("--model.joint_mode", "hybrid", "--model.rank", "4"),
    "full": ("--model.trainable", "all"),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("from_file")
    base, cache = write_base(root / "base"), write_cache(root / "cache", per_bucket=4)
    files = {}
    for name, flags in FILES.items():
        steps = ("--training.steps", "2", "--optim.lr", "3e-3")
        files[name] = run(parse_args(cache_run_flags(base, cache, root / name, *steps, *flags))).weights
    # the fine-tune of `base` that the files are adapted to: another seed, so every weight differs
    return dict(base=base, other=write_base(root / "other", seed=1), cache=cache, files=files)


def start_config(assets, out, file, *flags):
    return parse_args(cache_run_flags(assets["other"], assets["cache"], out, "--model.start_from", str(file), *flags))


def _outputs(model):
    with torch.no_grad():
        return model(**tiny_inputs(latent_hw=(8, 12)), return_dict=False)[0]


def _stored(weights):
    """The file's delta tensors by their names in it: `{key}.diff`, or `{key}.up` and `{key}.down`."""
    return {f"{key}.{form}": tensor for key, delta in weights.deltas.items() for form, tensor in delta.stored().items()}


def test_the_file_brings_its_recipe_where_the_run_gives_none(assets, tmp_path):
    file = load(assets["files"]["low-rank"])
    config = start_config(assets, tmp_path, assets["files"]["low-rank"])
    assert (config.model.joint_mode, config.model.rank, config.model.trainable) == ("hybrid", 4, "attention")
    # the test runs give --model.layers all, which resolves to the file's modules
    assert config.model.layers == "all"
    assert config.model.t5_config().settings() == file.config.settings()
    # a flag still wins over the file (and the build refuses it, below)
    assert start_config(assets, tmp_path, assets["files"]["low-rank"], "--model.rank", "8").model.rank == 8


@pytest.mark.parametrize("name", list(FILES))
def test_a_run_starts_where_the_file_is_and_exports_it_unchanged(assets, tmp_path, name):
    path = assets["files"][name]
    config = start_config(assets, tmp_path, path)
    base = load_base(config.model)
    fingerprint = base_fingerprint(base, arch_of(base))
    seed_everything(0)
    handle, split = build_model(base, config)
    applied = linearize(load_base(config.model), weights=path)
    torch.testing.assert_close(_outputs(handle.model), _outputs(applied.model), rtol=1e-5, atol=1e-5)
    world = World(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
    record = record_base(config, handle, split, world, fingerprint=fingerprint)
    exported = load(export_run(config, handle, split, world, record=record, steps=0))
    original = load(path)
    assert exported.fingerprint == fingerprint != original.fingerprint
    assert exported.provenance["started_from"] == path.name
    assert {k: d.low_rank for k, d in exported.deltas.items()} == {k: d.low_rank for k, d in original.deltas.items()}
    stored, reference = _stored(exported), _stored(original)
    assert stored.keys() == reference.keys()
    for key in reference:
        # factors and carried deltas come back as they were; a full delta is the trained value minus the base's,
        # both float32, rounded again to the float16 the file stores
        torch.testing.assert_close(stored[key], reference[key], rtol=1e-3, atol=1e-6, msg=key)
    for module, tensors in original.modules.items():
        for param, tensor in tensors.items():
            assert torch.equal(exported.modules[module][param], tensor), f"{module}.{param}"


@pytest.mark.parametrize("name", list(FILES))
def test_an_adapted_file_holds_deltas_against_its_new_base(assets, tmp_path, name):
    config = start_config(assets, tmp_path, assets["files"][name], "--training.steps", "2", "--optim.lr", "3e-3")
    result = run(config)
    adapted, original = load(result.weights), load(assets["files"][name])
    assert adapted.fingerprint == base_fingerprint(load_base(config.model), result.handle.arch)
    card = (tmp_path / "README.md").read_text()
    assert f"Adapted from the T5 weights file `{assets['files'][name].name}` (`--model.start_from`)" in card
    assert adapted.deltas.keys() == original.deltas.keys()
    ranks = {key: delta.rank for key, delta in adapted.deltas.items()}
    assert ranks == {key: delta.rank for key, delta in original.deltas.items()}
    assert any(not torch.equal(adapted.deltas[k].full(), original.deltas[k].full()) for k in adapted.deltas)
    applied = linearize(load_base(config.model), weights=result.weights)
    # the file's deltas are rounded to the base checkpoint's float16; the trained model is fp32
    torch.testing.assert_close(_outputs(applied.model), _outputs(result.handle.model.eval()), rtol=2e-3, atol=2e-3)


def test_weights_the_run_does_not_train_keep_the_files_deltas(assets, tmp_path):
    path = assets["files"]["full"]
    config = start_config(assets, tmp_path, path, "--model.trainable", "t5", "--training.steps", "2")
    adapted, original = load(run(config).weights), load(path)
    stored, reference = _stored(adapted), _stored(original)
    assert stored.keys() == reference.keys()
    assert all(torch.equal(stored[key], reference[key]) for key in reference)
    assert any(
        not torch.equal(adapted.modules[module][param], tensor)
        for module, tensors in original.modules.items()
        for param, tensor in tensors.items()
    )


@pytest.mark.parametrize(
    ("name", "flags", "message"),
    [
        pytest.param("low-rank", ["--model.rank", "8"], "has rank 4, the run's 8.*--model.rank 4", id="other-rank"),
        pytest.param("full", ["--model.rank", "4"], "by a full delta.*--model.rank 0", id="low-rank-on-full"),
        pytest.param(
            "low-rank", ["--model.joint_mode", "ttt"], "joint_mode 'hybrid' where the run asks for", id="settings"
        ),
        pytest.param("low-rank", ["--model.layers", "joint:0"], "layers .* where the run asks for", id="layers"),
    ],
)
def test_a_run_that_does_not_continue_the_files_recipe_is_refused(assets, tmp_path, name, flags, message):
    config = start_config(assets, tmp_path, assets["files"][name], *flags)
    with pytest.raises(ValueError, match=message):
        build_model(load_base(config.model), config)


def test_a_start_refuses_an_attention_transfer_naming_the_fix(assets, tmp_path):
    message = r"--transfer.steps: .*softmax attention on the base's weights.*Give --transfer.steps 0"
    with pytest.raises(ValueError, match=message):
        start_config(assets, tmp_path, assets["files"]["full"], "--transfer.steps", "2")


def test_a_missing_file_or_one_of_absolute_values_is_refused(assets, tmp_path):
    with pytest.raises(FileNotFoundError, match="T5 weights file not found"):
        start_config(assets, tmp_path, tmp_path / "missing.safetensors")
    weights = load(assets["files"]["full"])
    absolute = save(
        tmp_path / "absolute.safetensors",
        build_modules(weights, weights.config.layers, backend="torch"),
        config=weights.config,
        arch=weights.arch,
        base={key: delta.full() for key, delta in weights.deltas.items()},
    )
    with pytest.raises(ValueError, match="stores absolute base.* values"):
        start_config(assets, tmp_path, absolute)

"""Low-rank training of inherited weights (`--model.rank`) and the delta files it exports."""

from __future__ import annotations

import pytest
import torch

from t5core.hosts.diffusers import linearize
from t5core.weights import load
from testing.models import tiny_inputs
from testing.trainer_assets import cache_run_flags, write_base, write_cache
from trainer.cli import parse_args
from trainer.low_rank import ORIGINAL, add_low_rank
from trainer.model import base_fingerprint, build_model, load_base
from trainer.seeds import seed_everything
from trainer.train import run


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("low_rank")
    return dict(base=write_base(root / "base"), cache=write_cache(root / "cache", per_bucket=4))


def config_for(inputs, out, *flags):
    return parse_args(cache_run_flags(inputs["base"], inputs["cache"], out, *flags))


def _outputs(model):
    with torch.no_grad():
        return model(**tiny_inputs(latent_hw=(8, 12)), return_dict=False)[0]


def test_the_deltas_start_at_zero_so_the_model_is_the_base_exactly(inputs, tmp_path):
    config = config_for(inputs, tmp_path, "--model.rank", "4", "--model.trainable", "all")
    seed_everything(0)
    plain, _ = build_model(load_base(config.model), config_for(inputs, tmp_path))
    seed_everything(0)
    handle, split = build_model(load_base(config.model), config)
    assert torch.equal(_outputs(handle.model), _outputs(plain.model))
    params = dict(handle.model.named_parameters())
    assert split.low_rank and all(name.endswith(".weight") for name in split.low_rank)
    for weight in split.low_rank:
        original = weight.removesuffix(".weight") + ORIGINAL
        assert original in split.frozen and not params[original].requires_grad
    factors = [name for name in split.inherited if ".parametrizations." in name]
    assert len(factors) == 2 * len(split.low_rank)
    # vectors (biases, norm scales) still train in full
    assert any(name.endswith(".bias") for name in split.inherited)


def test_rank_is_capped_by_the_weight_and_alpha_sets_the_scale():
    layer = torch.nn.Linear(6, 3)
    (delta,) = add_low_rank(layer, ("weight",), rank=8, alpha=2.0).values()
    assert delta.up.shape == (3, 3) and delta.down.shape == (3, 6)
    assert delta.scale == pytest.approx(2.0 / 3)
    with torch.no_grad():
        delta.up.fill_(1.0)
    up, down = delta.factors()
    torch.testing.assert_close(layer.weight, layer.parametrizations.weight.original + up @ down)


def test_a_vector_cannot_take_a_low_rank_delta():
    with pytest.raises(ValueError, match="bias is not the 2-D weight"):
        add_low_rank(torch.nn.Linear(3, 3), ("bias",), rank=2, alpha=2.0)


def test_rank_needs_trained_inherited_weights(inputs, tmp_path):
    with pytest.raises(ValueError, match="--model.rank: .*--model.trainable t5 freezes them"):
        config_for(inputs, tmp_path, "--model.rank", "4", "--model.trainable", "t5")


@pytest.mark.parametrize(
    ("flags", "low_rank"),
    [
        pytest.param(["--model.rank", "4"], True, id="rank-4-attention"),
        pytest.param(["--model.rank", "0", "--model.trainable", "all"], False, id="full-rank-all"),
    ],
)
def test_the_file_holds_deltas_that_give_the_trained_model_on_its_base(inputs, tmp_path, flags, low_rank):
    config = config_for(inputs, tmp_path, "--training.steps", "3", "--optim.lr", "3e-3", *flags)
    result = run(config)
    weights = load(result.weights)
    assert not weights.base and weights.deltas
    assert weights.fingerprint == base_fingerprint(load_base(config.model), result.handle.arch)
    matrices = [delta for key, delta in weights.deltas.items() if key.endswith(".weight") and delta.shape[1:]]
    assert all(delta.low_rank == low_rank for delta in matrices)
    assert all(delta.parts == 3 for key, delta in weights.deltas.items() if low_rank and key.endswith("qkv.weight"))
    assert all(not delta.low_rank for key, delta in weights.deltas.items() if key.endswith(".bias"))
    applied = linearize(load_base(config.model), weights=result.weights)
    # the file's deltas are rounded to the base checkpoint's float16; the trained model is fp32
    torch.testing.assert_close(_outputs(applied.model), _outputs(result.handle.model.eval()), rtol=2e-3, atol=2e-3)

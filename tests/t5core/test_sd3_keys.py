"""The diffusers <-> SD3 checkpoint key map, checked against diffusers' own single-file converter."""

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

from t5core.hosts.diffusers import arch_of
from t5core.sd3_keys import diffusers_module, diffusers_to_sd3, layer_name, sd3_to_diffusers
from testing.models import tiny_transformer

PRESETS = ["sd35_medium_like", "sd35_large_like", "sd3_like"]


@pytest.mark.parametrize("preset", PRESETS)
def test_our_sd3_names_load_bit_exactly_through_diffusers_converter(preset):
    model = tiny_transformer(preset)
    state = model.state_dict()
    sd3 = diffusers_to_sd3(state, arch_of(model))
    back = convert_sd3_transformer_checkpoint_to_diffusers(
        {f"model.diffusion_model.{k}": v.clone() for k, v in sd3.items()}
    )
    assert set(back) == set(state)
    for key, tensor in state.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("preset", PRESETS)
def test_round_trip_is_the_identity(preset):
    model = tiny_transformer(preset)
    arch = arch_of(model)
    state = model.state_dict()
    back = sd3_to_diffusers(diffusers_to_sd3(state, arch), arch)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_a_partial_qkv_is_refused_and_unknown_names_are_named():
    model = tiny_transformer()
    arch = arch_of(model)
    with pytest.raises(ValueError, match="to_k.weight"):
        diffusers_to_sd3({"transformer_blocks.0.attn.to_q.weight": torch.zeros(1)}, arch)
    with pytest.raises(ValueError, match="joint_blocks.9.x_block.attn.qkv.weight"):
        sd3_to_diffusers({"joint_blocks.9.x_block.attn.qkv.weight": torch.zeros(3)}, arch)


def test_layer_names_are_the_diffusers_module_paths_without_their_prefix():
    model = tiny_transformer("sd35_medium_like")
    modules = dict(model.named_modules())
    for layer in ("blocks.0.attn", "blocks.0.attn2", "blocks.1.attn"):
        assert diffusers_module(layer) in modules and layer_name(diffusers_module(layer)) == layer
    assert layer_name("transformer_blocks.3.attn2") == "blocks.3.attn2"

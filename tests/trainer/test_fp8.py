"""Scaled-fp8 tensors become the weights they stand for; the format's own tensors are dropped."""

from __future__ import annotations

import pytest
import torch

from trainer.inputs.fp8 import dequantize_scaled_fp8, is_scaled_fp8


def _state(scale_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    scale = (weight.abs().max() / 448).reshape(scale_shape)
    return {
        "layer.weight": (weight / scale).to(torch.float8_e4m3fn),
        "layer.scale_weight": scale,
        "layer.scale_input": torch.tensor(0.5),
        "layer.bias": torch.randn(6, dtype=torch.float16),
        "norm.weight": torch.randn(4),
        "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn),
    }


@pytest.mark.parametrize("scale_shape", [pytest.param((), id="scalar"), pytest.param((1,), id="one-element")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_weight_is_its_fp8_value_times_its_scale(scale_shape, dtype):
    state = _state(scale_shape)
    weights = dequantize_scaled_fp8(state, dtype)
    assert weights.keys() == {"layer.weight", "layer.bias", "norm.weight"}
    expected = (state["layer.weight"].float() * state["layer.scale_weight"].reshape(())).to(dtype)
    assert weights["layer.weight"].shape == (6, 4) and torch.equal(weights["layer.weight"], expected)
    assert torch.equal(weights["layer.bias"], state["layer.bias"].to(dtype))
    assert torch.equal(weights["norm.weight"], state["norm.weight"].to(dtype))


def test_a_scale_per_channel_is_refused():
    state = _state(())
    state["layer.scale_weight"] = torch.full((6, 1), 0.01)
    with pytest.raises(ValueError, match=r"model\.safetensors: layer\.scale_weight has \(6, 1\) scales; .* one per"):
        dequantize_scaled_fp8(state, torch.float32, source="model.safetensors")


@pytest.mark.parametrize(
    "keys, scaled",
    [
        pytest.param(["a.weight", "scaled_fp8"], True, id="marker"),
        pytest.param(["text_encoders.t5xxl.transformer.scaled_fp8"], True, id="bundled-marker"),
        pytest.param(["a.weight", "a.scale_weight"], True, id="scale"),
        pytest.param(["a.weight", "a.bias", "logit_scale"], False, id="plain"),
    ],
)
def test_a_scaled_fp8_model_is_told_by_its_key_names(keys, scaled):
    assert is_scaled_fp8(keys) is scaled

"""The call contract: one check of a T5 attention call, the layout it hands to the backends, and
the variants with their fast weights, defined once."""

import dataclasses

import pytest
import torch

from t5core import T5Attention, T5Config
from t5core.contract import FAST_WEIGHTS, VARIANTS, T5Layout, check_call, fast_weight_names

H, D, GRID, TEXT = 2, 4, (3, 5), 4


def make_call(**overrides):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, GRID[0] * GRID[1] + TEXT, H, D, generator=g)
    conv = (torch.randn(H * D, 1, 3, 3, generator=g), torch.randn(H * D, generator=g))
    kwargs = dict(
        weights=tuple(torch.randn(H, D, D, generator=g) for _ in range(3)),
        q_conv=conv,
        k_conv=conv,
        grid=GRID,
        text_tokens=TEXT,
        text_first=False,
    )
    return q, {**kwargs, **overrides}


def test_check_call_describes_the_layout_and_passes_the_tensors_through():
    q, kwargs = make_call(grid=[3, 5])
    params, layout = check_call(q, q, q, **kwargs)
    assert layout == T5Layout(
        batch=2,
        tokens=19,
        heads=H,
        head_dim=D,
        grid=(3, 5),
        text_tokens=TEXT,
        text_first=False,
        variant="swiglu",
        key_norm_eps=1.0,
        locality=True,
    )
    assert layout.shape == q.shape and layout.n_image == 15 and layout.n_weights == 3
    assert params.weights == kwargs["weights"] and params.q_conv is kwargs["q_conv"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tokens = 3


def test_without_locality_the_grid_may_be_omitted():
    q, kwargs = make_call(q_conv=None, k_conv=None, grid=None)
    _, layout = check_call(q, q, q, **kwargs)
    assert layout.grid is None and not layout.locality


BAD_WEIGHTS = (torch.zeros(H, D, D), torch.zeros(H, D + 1, D), torch.zeros(H, D, D))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(weights=BAD_WEIGHTS), r"W2 must be \(H, D, D\) = \(2, 4, 4\); got \(2, 5, 4\)"),
        (dict(k_conv=(torch.zeros(H * D, 1, 5, 5), None)), r"k_conv weight must be \(H\*D, 1, 3, 3\)"),
        (dict(q_conv=(torch.zeros(H * D, 1, 3, 3), torch.zeros(D))), r"q_conv bias must be \(H\*D,\) = \(8,\)"),
        (dict(variant="gelu"), r"variant must be one of \('swiglu', 'mlp'\); got 'gelu'"),
        (dict(grid=(0, 15)), r"grid \(0, 15\) holds 0 image tokens"),
    ],
    ids=["weight-shape", "conv-shape", "bias-shape", "variant", "empty-grid"],
)
def test_bad_parameters_are_refused_naming_the_problem(change, match):
    q, kwargs = make_call(**change)
    with pytest.raises(ValueError, match=match):
        check_call(q, q, q, **kwargs)


def test_bad_activations_are_refused_naming_the_problem():
    q, kwargs = make_call()
    with pytest.raises(ValueError, match=r"q must be \(B, N, H, D\); got a tensor with shape \(19, 2, 4\)"):
        check_call(q[0], q[0], q[0], **kwargs)
    with pytest.raises(TypeError, match="q, k and v must be floating point"):
        check_call(q, q.long(), q, **kwargs)


def test_variants_and_their_fast_weights_are_defined_once():
    assert VARIANTS == ("swiglu", "mlp") and FAST_WEIGHTS == {"swiglu": 3, "mlp": 2}
    assert fast_weight_names("swiglu") == ("w1", "w2", "w3") and fast_weight_names("mlp") == ("w1", "w2")
    for variant in VARIANTS:
        module = T5Attention(H, D, variant)
        assert tuple(name for name, _ in module.fast.named_parameters()) == fast_weight_names(variant)
        assert len(module.fast_weights()) == FAST_WEIGHTS[variant]
    for make in (fast_weight_names, lambda variant: T5Attention(H, D, variant), T5Config):
        with pytest.raises(ValueError, match=r"variant must be one of \('swiglu', 'mlp'\); got 'gelu'"):
            make("gelu")

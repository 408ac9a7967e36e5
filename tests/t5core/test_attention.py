"""T5Attention: the parameter contract, dtypes, gradients and its errors."""

import pytest
import torch

from t5core import T5Attention
from t5core.ttt import t5_attention_ref


@pytest.mark.parametrize(
    "variant,locality,names",
    [
        ("swiglu", True, {"w1", "w2", "w3", "q_conv.weight", "q_conv.bias", "k_conv.weight", "k_conv.bias"}),
        ("mlp", True, {"w1", "w2", "q_conv.weight", "q_conv.bias", "k_conv.weight", "k_conv.bias"}),
        ("swiglu", False, {"w1", "w2", "w3"}),
    ],
    ids=["swiglu", "mlp", "no-locality"],
)
def test_parameter_names_and_shapes_follow_the_contract(variant, locality, names):
    module = T5Attention(3, 8, variant, locality=locality)
    state = module.state_dict()
    assert set(state) == names
    assert state["w1"].shape == (3, 8, 8)
    if locality:
        assert state["q_conv.weight"].shape == (24, 1, 3, 3) and state["k_conv.bias"].shape == (24,)


def test_fast_weights_start_as_normals_with_std_002():
    module = T5Attention(4, 32)
    for w in module.fast_weights():
        assert abs(w.mean()) < 0.002 and 0.018 < w.std() < 0.022


def test_forward_matches_the_reference_and_keeps_the_input_dtype():
    torch.manual_seed(0)
    module = T5Attention(2, 8, backend="torch")
    q, k, v = torch.randn(3, 2, 4 * 3 + 5, 2, 8, dtype=torch.bfloat16).unbind(0)
    out = module(q, k, v, grid=(4, 3), text_tokens=5, text_first=False)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = t5_attention_ref(
        q,
        k,
        v,
        weights=module.fast_weights(),
        q_conv=(module.q_conv.weight, module.q_conv.bias),
        k_conv=(module.k_conv.weight, module.k_conv.bias),
        grid=(4, 3),
        text_tokens=5,
        text_first=False,
    )
    assert torch.equal(out, ref)


def test_gradients_reach_every_parameter_and_the_inputs():
    torch.manual_seed(0)
    module = T5Attention(2, 8, backend="torch")
    q, k, v = (torch.randn(2, 12, 2, 8, requires_grad=True) for _ in range(3))
    module(q, k, v, grid=(3, 4)).square().mean().backward()
    for name, param in module.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    for x in (q, k, v):
        assert x.grad.abs().sum() > 0


def test_wrong_head_layout_is_refused():
    module = T5Attention(2, 8, backend="torch")
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="built for 2 heads x 8"):
        module(q, q, q, grid=(2, 2))


def test_unknown_backend_is_refused(monkeypatch):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        T5Attention(2, 8, backend="cuda")(q, q, q, grid=(2, 2))
    monkeypatch.setenv("T5_BACKEND", "fast")
    with pytest.raises(ValueError, match="T5_BACKEND='fast' is not a backend"):
        T5Attention(2, 8)(q, q, q, grid=(2, 2))

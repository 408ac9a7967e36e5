"""T5Attention: the parameter contract, dtypes, gradients and its errors."""

import pytest
import torch

from t5core import T5Attention
from t5core.attention import file_name, param_name
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
    state = module.file_state()
    assert set(state) == names
    assert state["w1"].shape == (3, 8, 8)
    if locality:
        assert state["q_conv.weight"].shape == (24, 1, 3, 3) and state["k_conv.bias"].shape == (24,)
    assert {name for name, _ in module.named_parameters()} == {param_name(name) for name in names}
    assert {file_name(name) for name, _ in module.named_parameters()} == names


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"variant": "mlp", "locality": False}, {"exact_text": True, "merge": "learned"}],
    ids=["swiglu", "mlp-no-locality", "hybrid-learned"],
)
def test_every_parameter_lives_in_a_leaf_module(kwargs):
    """ComfyUI's partial and Dynamic VRAM loads move leaf modules (no children) one by one: a parameter
    held beside child modules would stay on the offload device and be copied on every call."""
    module = T5Attention(2, 8, **kwargs)
    owners = {name.rpartition(".")[0] for name, _ in module.named_parameters()}
    assert "" not in owners
    for owner in owners:
        assert not list(module.get_submodule(owner).children()), owner
    assert module.fast_weights()[0] is module.fast.w1
    assert (module.merge_bias is not None) == ("merge" in kwargs) and module.merge_bias is module.fast.merge_bias


def test_file_state_round_trips_and_refuses_wrong_names():
    torch.manual_seed(0)
    source, target = (
        T5Attention(2, 8, exact_text=True, merge="learned"),
        T5Attention(2, 8, exact_text=True, merge="learned"),
    )
    target.load_file_state(source.file_state())
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(RuntimeError, match="merge_bias"):
        T5Attention(2, 8).load_file_state(source.file_state())


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


def test_module_outputs_and_gradients_are_the_references_bit_for_bit():
    """The module adds nothing to the math: the torch path with its tensors passed explicitly gives the
    same output and the same gradients, input and parameter, to the bit (guards the parameter layout)."""
    from t5core.backend import attend
    from t5core.contract import check_call

    torch.manual_seed(0)
    module = T5Attention(2, 8, backend="torch")
    q, k, v = (torch.randn(2, 4 * 3 + 5, 2, 8, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 4 * 3 + 5, 2, 8)
    out = module(q, k, v, grid=(4, 3), text_tokens=5)
    got = torch.autograd.grad(out, [q, k, v, *module.parameters()], grad_out)

    leaves = {name: p.detach().clone().requires_grad_() for name, p in module.file_state().items()}
    params, layout = check_call(
        q,
        k,
        v,
        weights=(leaves["w1"], leaves["w2"], leaves["w3"]),
        q_conv=(leaves["q_conv.weight"], leaves["q_conv.bias"]),
        k_conv=(leaves["k_conv.weight"], leaves["k_conv.bias"]),
        grid=(4, 3),
        text_tokens=5,
    )
    ref = attend("torch", q, k, v, params, layout)
    order = [file_name(name) for name, _ in module.named_parameters()]
    want = torch.autograd.grad(ref, [q, k, v, *(leaves[name] for name in order)], grad_out)
    assert torch.equal(out, ref)
    for name, a, b in zip(["q", "k", "v", *order], want, got, strict=True):
        assert torch.equal(a, b), name


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

"""The reference math: the inner model and loss against the formulas of docs/method.md ("Per converted
attention module") computed by hand, closed form vs autograd, key-norm shift invariance, locality vs
a direct convolution, token order, batch independence and low-precision inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from t5core.contract import FAST_WEIGHTS, VARIANTS
from t5core.ttt import (
    apply_locality,
    inner_apply,
    inner_loss,
    inner_step,
    key_instance_norm,
    t5_attention_ref,
)


def make_inputs(b=2, h=3, w=5, text=4, heads=2, dim=8, dtype=torch.float32, seed=0, variant="swiglu"):
    g = torch.Generator().manual_seed(seed)
    n = h * w + text
    q, k, v = (torch.randn(b, n, heads, dim, generator=g, dtype=dtype) for _ in range(3))
    weights = tuple(torch.randn(heads, dim, dim, generator=g, dtype=dtype) * 0.3 for _ in range(FAST_WEIGHTS[variant]))
    convs = tuple(
        (
            torch.randn(heads * dim, 1, 3, 3, generator=g, dtype=dtype) * 0.3,
            torch.randn(heads * dim, generator=g, dtype=dtype) * 0.1,
        )
        for _ in range(2)
    )
    return (
        q,
        k,
        v,
        dict(weights=weights, variant=variant, q_conv=convs[0], k_conv=convs[1], grid=(h, w), text_tokens=text),
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_closed_form_gradients_equal_autograd_float64(variant):
    g = torch.Generator().manual_seed(0)
    b, heads, n, d = 2, 3, 11, 6
    k = torch.randn(b, heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, heads, n, d, generator=g, dtype=torch.float64)
    weights = tuple(
        torch.randn(b, heads, d, d, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(FAST_WEIGHTS[variant])
    )
    grads = torch.autograd.grad(inner_loss(k, v, weights, variant), weights)
    updated = inner_step(k, v, weights, variant)
    for w, grad, new in zip(weights, grads, updated, strict=True):
        torch.testing.assert_close(w - new, grad, rtol=1e-10, atol=1e-12)


def test_key_instance_norm_is_per_sample_per_channel_instance_norm():
    k = torch.randn(3, 17, 2, 5, dtype=torch.float64) * 4 + 2
    expected = F.instance_norm(k.flatten(2).transpose(1, 2), eps=1.0).transpose(1, 2).unflatten(2, (2, 5))
    torch.testing.assert_close(key_instance_norm(k, eps=1.0), expected.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("locality", [True, False], ids=["locality", "no-locality"])
def test_adding_one_vector_to_every_key_leaves_the_output_unchanged(variant, locality):
    q, k, v, kw = make_inputs(variant=variant)
    if not locality:
        kw.update(q_conv=None, k_conv=None)
    shift = torch.randn(1, 1, k.shape[2], k.shape[3]) * 10
    out = t5_attention_ref(q, k, v, **kw)
    shifted = t5_attention_ref(q, k + shift, v, **kw)
    torch.testing.assert_close(shifted, out, rtol=1e-4, atol=1e-4)


def test_without_key_norm_a_key_shift_changes_the_output():
    q, k, v, kw = make_inputs()
    out = t5_attention_ref(q, k, v, **kw, key_norm_eps=None)
    shifted = t5_attention_ref(q, k + 3.0, v, **kw, key_norm_eps=None)
    assert (shifted - out).abs().max() > 1e-2


def direct_depthwise_conv(image, weight, bias, h, w):
    """3x3 depthwise conv with zero padding, written as an explicit loop over taps."""
    b, n, heads, dim = image.shape
    grid = image.reshape(b, h, w, heads * dim)
    padded = torch.zeros(b, h + 2, w + 2, heads * dim, dtype=image.dtype)
    padded[:, 1:-1, 1:-1] = grid
    out = bias.expand(b, h, w, -1).clone()
    for dy in range(3):
        for dx in range(3):
            out += padded[:, dy : dy + h, dx : dx + w] * weight[:, 0, dy, dx]
    return out.reshape(b, n, heads, dim)


GRIDS = [(1, 1), (1, 7), (7, 1), (2, 2), (3, 5), (5, 3), (4, 9), (6, 6)]


@pytest.mark.parametrize("h,w", GRIDS, ids=[f"g{h}x{w}" for h, w in GRIDS])
@pytest.mark.parametrize("text_first", [True, False], ids=["txt-first", "txt-last"])
def test_locality_equals_a_direct_convolution_and_leaves_text_untouched(h, w, text_first):
    g = torch.Generator().manual_seed(h * 10 + w)
    text, heads, dim = 3, 2, 4
    x = torch.randn(2, h * w + text, heads, dim, generator=g, dtype=torch.float64)
    weight = torch.randn(heads * dim, 1, 3, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(heads * dim, generator=g, dtype=torch.float64)
    out = apply_locality(x, weight, bias, grid=(h, w), text_tokens=text, text_first=text_first)
    image_slice = slice(text, None) if text_first else slice(0, h * w)
    text_slice = slice(0, text) if text_first else slice(h * w, None)
    torch.testing.assert_close(out[:, text_slice], x[:, text_slice].float())
    expected = x[:, image_slice] + direct_depthwise_conv(x[:, image_slice], weight, bias, h, w)
    torch.testing.assert_close(out[:, image_slice], expected.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_text_first_and_text_last_agree_up_to_the_permutation(variant):
    q, k, v, kw = make_inputs(variant=variant)
    text = kw["text_tokens"]

    def to_last(x):
        return torch.cat([x[:, text:], x[:, :text]], dim=1)

    first = t5_attention_ref(q, k, v, **kw, text_first=True)
    last = t5_attention_ref(to_last(q), to_last(k), to_last(v), **kw, text_first=False)
    torch.testing.assert_close(last, to_last(first), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_sample_is_independent_of_the_others(variant):
    q, k, v, kw = make_inputs(b=3, variant=variant)
    out = t5_attention_ref(q, k, v, **kw)
    alone = t5_attention_ref(q[1:2], k[1:2], v[1:2], **kw)
    torch.testing.assert_close(alone, out[1:2], rtol=1e-5, atol=1e-6)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[0] += torch.randn_like(x[0]) * 5
    changed = t5_attention_ref(q2, k2, v2, **kw)
    torch.testing.assert_close(changed[1:], out[1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_low_precision_inputs_give_finite_outputs_close_to_fp32(dtype, tol, variant):
    q, k, v, kw = make_inputs(variant=variant)
    ref = t5_attention_ref(q, k, v, **kw)
    low_kw = dict(kw, weights=tuple(w.to(dtype) for w in kw["weights"]))
    out = t5_attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), **low_kw)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # Inputs are rounded to 8 (bf16) or 11 (fp16) mantissa bits; the inner state stays fp32.
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < tol


def test_the_reference_never_writes_into_its_inputs():
    q, k, v, kw = make_inputs()
    copies = [x.clone() for x in (q, k, v)]
    t5_attention_ref(q, k, v, **kw)
    for x, c in zip((q, k, v), copies, strict=True):
        assert torch.equal(x, c)


def _silu(z: float) -> float:
    return z / (1.0 + math.exp(-z))


def _matvec(x: list[float], w: list[list[float]]) -> list[float]:
    """Row vector `x` times matrix `w`."""
    return [sum(x[i] * w[i][j] for i in range(len(x))) for j in range(len(w[0]))]


def inner_model_by_hand(x: list[float], weights: list[list[list[float]]], variant: str) -> list[float]:
    """f(x) of docs/method.md ("Per converted attention module") for one token of one head, in Python
    floats: swiglu (silu(x W1) * (x W2)) W3, mlp silu(x W1) W2."""
    if variant == "swiglu":
        w1, w2, w3 = weights
        return _matvec([_silu(a) * b for a, b in zip(_matvec(x, w1), _matvec(x, w2), strict=True)], w3)
    w1, w2 = weights
    return _matvec([_silu(a) for a in _matvec(x, w1)], w2)


def _fast_weights_and_tokens(variant: str, heads: int = 2, tokens: int = 3, dim: int = 4):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, heads, tokens, dim, generator=g, dtype=torch.float64)
    weights = tuple(
        torch.randn(heads, dim, dim, generator=g, dtype=torch.float64) for _ in range(FAST_WEIGHTS[variant])
    )
    return x, weights


@pytest.mark.parametrize("variant", VARIANTS)
def test_inner_apply_is_the_inner_model_token_by_token(variant):
    q, weights = _fast_weights_and_tokens(variant)
    out = inner_apply(q, weights, variant)
    for head in range(q.shape[1]):
        per_head = [w[head].tolist() for w in weights]
        for token in range(q.shape[2]):
            expected = inner_model_by_hand(q[0, head, token].tolist(), per_head, variant)
            assert out[0, head, token].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_inner_loss_is_the_design_loss_summed_over_heads(variant):
    k, weights = _fast_weights_and_tokens(variant)
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    heads, tokens, dim = k.shape[1:]
    scale = 1 / math.sqrt(dim)
    expected = 0.0
    for head in range(heads):
        per_head = [w[head].tolist() for w in weights]
        for token in range(tokens):
            f = inner_model_by_hand(k[0, head, token].tolist(), per_head, variant)
            target = v[0, head, token].tolist()
            if variant == "swiglu":  # L = -(scale / N) sum_i v_i . f(k_i)
                expected -= scale / tokens * sum(a * b for a, b in zip(target, f, strict=True))
            else:  # L = (scale / 2N) sum_i |f(k_i) - v_i|^2
                expected += scale / (2 * tokens) * sum((a - b) ** 2 for a, b in zip(f, target, strict=True))
    assert inner_loss(k, v, weights, variant).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(grid=(4, 5)), "grid \\(4, 5\\) holds 20 image tokens"),
        (dict(grid=None), "grid=\\(h, w\\) is required"),
        (dict(text_tokens=19), "text_tokens must be in"),
        (dict(variant="gelu"), "variant must be one of"),
        (dict(k_conv=None), "both q_conv and k_conv"),
    ],
    ids=["grid-mismatch", "grid-missing", "no-image-tokens", "bad-variant", "one-conv"],
)
def test_bad_arguments_are_refused_with_a_clear_error(change, match):
    q, k, v, kw = make_inputs()
    with pytest.raises(ValueError, match=match):
        t5_attention_ref(q, k, v, **{**kw, **change})


def test_mismatched_qkv_shapes_are_refused():
    q, k, v, kw = make_inputs()
    with pytest.raises(ValueError, match="same shape"):
        t5_attention_ref(q, k[:, :-1], v, **kw)

"""Neighbourhood attention against its definition, and the 50/50 blend inside `T5Attention`."""

import pytest
import torch
import torch.nn.functional as F

from t5core.attention import T5Attention
from t5core.neighborhood import neighborhood_attention


def windowed_softmax(q, k, v, grid, kernel):
    """The definition, query by query in float64: softmax(q.k / sqrt(D)) over the k x k window that
    starts at clamp(y - k // 2, 0, h - k) (rows) and likewise for columns."""
    _, _, _, dim = q.shape
    h, w = grid
    kh, kw = min(kernel, h), min(kernel, w)
    out = torch.empty(q.shape, dtype=torch.float64)
    for y in range(h):
        for x in range(w):
            y0, x0 = min(max(y - kh // 2, 0), h - kh), min(max(x - kw // 2, 0), w - kw)
            keys = [r * w + c for r in range(y0, y0 + kh) for c in range(x0, x0 + kw)]
            scores = torch.einsum("bhd,bjhd->bhj", q[:, y * w + x].double(), k[:, keys].double()) * dim**-0.5
            out[:, y * w + x] = torch.einsum("bhj,bjhd->bhd", scores.softmax(-1), v[:, keys].double())
    return out


def qkv(batch, tokens, heads=2, dim=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, tokens, heads, dim, generator=generator, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize(
    ("grid", "kernel"), [((12, 12), 5), ((7, 13), 5), ((17, 9), 3), ((3, 4), 5), ((1, 9), 5), ((9, 20), 7)]
)
def test_matches_the_definition_on_any_grid(grid, kernel):
    q, k, v = qkv(2, grid[0] * grid[1])
    out = neighborhood_attention(q, k, v, grid, kernel)
    torch.testing.assert_close(out.double(), windowed_softmax(q, k, v, grid, kernel), atol=2e-6, rtol=1e-5)


def test_kernel_1_returns_the_values_and_a_kernel_over_the_grid_is_full_softmax():
    grid = (6, 5)
    q, k, v = qkv(1, 30)
    torch.testing.assert_close(neighborhood_attention(q, k, v, grid, 1), v)
    full = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(neighborhood_attention(q, k, v, grid, 7), full, atol=1e-6, rtol=1e-5)


def test_each_sample_depends_only_on_itself():
    grid = (10, 11)
    q, k, v = qkv(3, 110)
    together = neighborhood_attention(q, k, v, grid)
    alone = neighborhood_attention(q[1:2], k[1:2], v[1:2], grid)
    torch.testing.assert_close(together[1:2], alone, atol=1e-6, rtol=1e-6)


def test_gradients_match_the_definition():
    grid = (9, 10)
    q, k, v = (x.double().requires_grad_() for x in qkv(1, 90))
    grad = torch.randn(1, 90, 2, 8, dtype=torch.float64)
    got = torch.autograd.grad((neighborhood_attention(q, k, v, grid) * grad).sum(), (q, k, v))
    want = torch.autograd.grad((windowed_softmax(q, k, v, grid, 5) * grad).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_bf16_stays_bf16_and_close_to_fp32():
    grid = (12, 12)
    q, k, v = qkv(1, 144)
    out = neighborhood_attention(*(x.bfloat16() for x in (q, k, v)), grid)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), neighborhood_attention(q, k, v, grid), atol=5e-2, rtol=5e-2)


def test_bad_calls_say_what_is_wrong():
    q, k, v = qkv(1, 12)
    with pytest.raises(ValueError, match="odd and positive; got 4"):
        neighborhood_attention(q, k, v, (3, 4), 4)
    with pytest.raises(ValueError, match=r"grid \(3, 5\) holds 15 tokens; the call has 12"):
        neighborhood_attention(q, k, v, (3, 5))


@pytest.mark.parametrize("text_first", [True, False])
def test_t5_attention_blends_image_rows_50_50_and_leaves_text_rows(text_first):
    grid, text = (6, 7), 5
    q, k, v = qkv(2, 42 + text, heads=2, dim=8)
    plain = T5Attention(2, 8, backend="torch")
    blended = T5Attention(2, 8, backend="torch", neighborhood=5)
    blended.load_state_dict(plain.state_dict())
    call = dict(grid=grid, text_tokens=text, text_first=text_first)
    with torch.no_grad():
        base, out = plain(q, k, v, **call), blended(q, k, v, **call)
    image = slice(text, None) if text_first else slice(0, 42)
    words = slice(0, text) if text_first else slice(42, None)
    local = windowed_softmax(q[:, image], k[:, image], v[:, image], grid, 5)
    want = 0.5 * base[:, image].double() + 0.5 * local
    torch.testing.assert_close(out[:, image].double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[:, words], base[:, words])


def test_hybrid_text_rows_stay_exact_softmax_with_the_blend():
    grid, text = (5, 6), 4
    q, k, v = qkv(1, 30 + text)
    module = T5Attention(2, 8, backend="torch", exact_text=True, neighborhood=5)
    with torch.no_grad():
        out = module(q, k, v, grid=grid, text_tokens=text)
    exact = F.scaled_dot_product_attention(q[:, :text].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    torch.testing.assert_close(out[:, :text], exact.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_the_blend_needs_the_grid():
    module = T5Attention(2, 8, backend="torch", locality=False, neighborhood=5)
    with pytest.raises(ValueError, match="needs grid"):
        module(*qkv(1, 12))

"""Hybrid joint attention (`t5core.hybrid`): exact softmax wherever text takes part, T5 between images.

The reference below is written from the formula in the module docstring, with explicit per-token
sums (not from the implementation): softmax over all keys for text queries; for image queries
alpha * softmax-over-text + (1 - alpha) * T5-over-images, alpha = Z_t / (Z_t + Z_i_hat), with
log Z_i_hat = log M + scale q.mu + scale^2/2 q^T S q (+ merge bias).
"""

from __future__ import annotations

import math

import pytest
import torch

import t5core.attention
import t5core.hybrid
import t5core.ttt_chunked
from t5core import T5Attention
from t5core.contract import check_call
from t5core.hybrid import image_log_partition
from t5core.ttt import t5_attention_ref
from testing.tolerances import assert_close


def _module(heads: int = 2, dim: int = 8, *, merge: str = "cumulant", seed: int = 0) -> T5Attention:
    torch.manual_seed(seed)
    module = T5Attention(heads, dim, backend="torch", exact_text=True, merge=merge)
    if module.merge_bias is not None:
        with torch.no_grad():
            module.merge_bias.copy_(torch.linspace(-0.5, 0.7, heads))
    return module


def _reference(module: T5Attention, q, k, v, *, grid, text_tokens, text_first):
    """The formula, token by token over keys, in float64 for the merge."""
    b, n, heads, dim = q.shape
    m = n - text_tokens
    text = slice(0, text_tokens) if text_first else slice(m, n)
    image = slice(text_tokens, n) if text_first else slice(0, m)
    ttt = t5_attention_ref(
        q[:, image],
        k[:, image],
        v[:, image],
        weights=module.fast_weights(),
        q_conv=(module.q_conv.weight, module.q_conv.bias),
        k_conv=(module.k_conv.weight, module.k_conv.bias),
        grid=grid,
    ).double()
    q64, k64, v64 = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(dim)
    out = torch.empty(b, n, heads, dim, dtype=torch.float64)
    # text queries: softmax over every key
    logits = torch.einsum("bnhd,bjhd->bhnj", q64[:, text], k64) * scale
    out[:, text] = torch.einsum("bhnj,bjhd->bnhd", logits.softmax(-1), v64)
    # image queries: the text part exactly, the image part estimated
    k_img = k64[:, image]
    mean = k_img.mean(1)  # (B, H, D)
    centred = k_img - mean[:, None]
    cov = torch.einsum("bjhd,bjhe->bhde", centred, centred) / m
    q_img = q64[:, image]
    log_z_image = (
        math.log(m)
        + scale * torch.einsum("bnhd,bhd->bhn", q_img, mean)
        + 0.5 * scale**2 * torch.einsum("bnhd,bhde,bnhe->bhn", q_img, cov, q_img)
    )
    if module.merge_bias is not None:
        log_z_image = log_z_image + module.merge_bias.double()[None, :, None]
    text_logits = torch.einsum("bnhd,bjhd->bhnj", q_img, k64[:, text]) * scale
    z_text = text_logits.exp().sum(-1)
    o_text = torch.einsum("bhnj,bjhd->bnhd", text_logits.exp() / z_text[..., None], v64[:, text])
    alpha = (z_text / (z_text + log_z_image.exp())).permute(0, 2, 1)[..., None]  # (B, M, H, 1)
    out[:, image] = alpha * o_text + (1 - alpha) * ttt
    return out


CASES = [
    pytest.param(1, (3, 5), 4, True, "cumulant", id="B1-g3x5-txt4first"),
    pytest.param(2, (3, 5), 4, False, "cumulant", id="B2-g3x5-txt4last"),
    pytest.param(2, (1, 7), 1, True, "learned", id="B2-g1x7-txt1first-learned"),
    pytest.param(1, (6, 1), 9, False, "learned", id="B1-g6x1-txt9last-learned"),
]


@pytest.mark.parametrize(("batch", "grid", "text", "first", "merge"), CASES)
@pytest.mark.parametrize("one_pass", [False, True], ids=["with-autograd", "one-pass"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-log-partition", "from-scores"])
def test_matches_the_formula(batch, grid, text, first, merge, one_pass, fused, monkeypatch):
    """With autograd the image part is a T5 call of its own; sampling merges it chunk by chunk. The
    text queries attend over runs of 5 keys, merged by their partition sums; without the fused CPU
    kernel (as on a GPU) the log-partitions come from the scores."""
    module = _module(merge=merge)
    n = grid[0] * grid[1] + text
    q, k, v = torch.randn(3, batch, n, 2, 8).unbind(0)
    monkeypatch.setattr(t5core.hybrid, "TEXT_ROW_KEYS", 5)
    if not fused:
        monkeypatch.setattr(t5core.hybrid, "_FLASH_CPU", None)
    if one_pass:
        monkeypatch.setattr(t5core.attention, "hybrid_attention", _must_not_run)
    with torch.set_grad_enabled(not one_pass):
        out = module(q, k, v, grid=grid, text_tokens=text, text_first=first)
    ref = _reference(module, q, k, v, grid=grid, text_tokens=text, text_first=first)
    assert_close("hybrid", ref.float(), out, 1e-5)


def _must_not_run(*args, **kwargs):
    raise AssertionError("the composed hybrid path ran where the one-pass path should")


@pytest.mark.parametrize("first", [True, False], ids=["text-first", "text-last"])
@pytest.mark.parametrize("key_norm", [True, False], ids=["key-norm", "no-key-norm"])
def test_one_pass_across_chunks_and_head_groups(first, key_norm, monkeypatch):
    """Bands of one image row and one head per group: the moments merge across chunks (Chan's update
    of the covariance) and every chunk and head merges with its own text part."""
    module = _module(heads=3, merge="learned")
    if not key_norm:
        module.key_norm_eps = None
    grid, text = (5, 4), 6
    q, k, v = (torch.randn(2, grid[0] * grid[1] + text, 3, 8) + 0.5 for _ in range(3))
    params, layout = check_call(
        q,
        k,
        v,
        weights=module.fast_weights(),
        q_conv=(module.q_conv.weight, module.q_conv.bias),
        k_conv=(module.k_conv.weight, module.k_conv.bias),
        grid=grid,
        text_tokens=text,
        text_first=first,
        key_norm_eps=module.key_norm_eps,
    )
    monkeypatch.setattr(t5core.ttt_chunked, "HEAD_GROUP_BYTES", 2 * 4 * 4 * 8)
    with torch.no_grad():
        chunked = t5core.ttt_chunked.chunked_hybrid_attention(
            q, k, v, params, layout, merge_bias=module.merge_bias, chunk_tokens=4
        )
    composed = module(q, k, v, grid=grid, text_tokens=text, text_first=first)  # with autograd: composed
    assert_close("one pass", composed.detach(), chunked, 1e-5)


def test_text_queries_get_the_original_softmax_attention():
    module = _module()
    q, k, v = torch.randn(3, 2, 4 * 3 + 6, 2, 8).unbind(0)
    out = module(q, k, v, grid=(4, 3), text_tokens=6, text_first=True)
    logits = torch.einsum("bnhd,bjhd->bhnj", q[:, :6], k) / math.sqrt(8)
    softmax = torch.einsum("bhnj,bjhd->bnhd", logits.softmax(-1), v)
    assert_close("text rows", softmax, out[:, :6], 1e-6)


def test_no_image_contribution_leaves_softmax_over_the_text():
    module = _module(merge="learned")
    with torch.no_grad():
        module.merge_bias.fill_(-1e4)
    q, k, v = torch.randn(3, 1, 3 * 3 + 5, 2, 8).unbind(0)
    out = module(q, k, v, grid=(3, 3), text_tokens=5, text_first=False)
    logits = torch.einsum("bnhd,bjhd->bhnj", q[:, :9], k[:, 9:]) / math.sqrt(8)
    over_text = torch.einsum("bhnj,bjhd->bnhd", logits.softmax(-1), v[:, 9:])
    assert_close("image rows", over_text, out[:, :9], 1e-6)


def test_without_text_it_is_t5_attention():
    module = _module()
    q, k, v = torch.randn(3, 2, 12, 2, 8).unbind(0)
    plain = T5Attention(2, 8, backend="torch")
    plain.load_state_dict(module.state_dict())
    assert torch.equal(module(q, k, v, grid=(3, 4)), plain(q, k, v, grid=(3, 4)))


def test_each_sample_depends_only_on_itself():
    module = _module()
    q, k, v = torch.randn(3, 3, 3 * 4 + 5, 2, 8).unbind(0)
    together = module(q, k, v, grid=(3, 4), text_tokens=5)
    for i in range(3):
        alone = module(q[i : i + 1], k[i : i + 1], v[i : i + 1], grid=(3, 4), text_tokens=5)
        assert_close(f"sample {i}", alone, together[i : i + 1], 1e-6)


@pytest.mark.parametrize("one_pass", [False, True], ids=["with-autograd", "one-pass"])
def test_bf16_in_bf16_out_close_to_fp32(one_pass):
    module = _module()
    q, k, v = torch.randn(3, 2, 3 * 5 + 4, 2, 8).unbind(0)
    with torch.set_grad_enabled(not one_pass):
        out = module(*(x.bfloat16() for x in (q, k, v)), grid=(3, 5), text_tokens=4)
        ref = module(q, k, v, grid=(3, 5), text_tokens=4)
    assert out.dtype == torch.bfloat16
    # bf16 inputs carry 8 bits of mantissa; everything after them is fp32
    assert_close("bf16", ref, out.float(), 2e-2)


@pytest.mark.parametrize("one_pass", [False, True], ids=["with-autograd", "one-pass"])
@pytest.mark.parametrize("neighborhood", [0, 5], ids=["plain", "blend"])
def test_mixed_dtypes_meet_in_the_widest(one_pass, neighborhood):
    """Under bf16 autocast, fp32 q/k norms give fp32 queries and keys beside bf16 values."""
    torch.manual_seed(0)
    module = T5Attention(2, 8, backend="torch", exact_text=True, neighborhood=neighborhood)
    q, k, v = torch.randn(3, 2, 3 * 5 + 4, 2, 8).unbind(0)
    v = v.bfloat16()
    with torch.set_grad_enabled(not one_pass):
        out = module(q, k, v, grid=(3, 5), text_tokens=4)
        ref = module(q, k, v.float(), grid=(3, 5), text_tokens=4)
    assert out.dtype == torch.float32
    assert_close("mixed dtypes", ref, out, 1e-6)


@pytest.mark.parametrize("first", [True, False], ids=["text-first", "text-last"])
def test_gradients_match_the_formula(first):
    module = _module(merge="learned")
    leaves = [torch.randn(2, 3 * 4 + 5, 2, 8, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(2, 3 * 4 + 5, 2, 8)
    out = module(*leaves, grid=(3, 4), text_tokens=5, text_first=first)
    got = torch.autograd.grad(out, [*leaves, *module.parameters()], grad_out)
    ref = _reference(module, *leaves, grid=(3, 4), text_tokens=5, text_first=first).float()
    want = torch.autograd.grad(ref, [*leaves, *module.parameters()], grad_out)
    names = ["q", "k", "v", *(name for name, _ in module.named_parameters())]
    for name, a, b in zip(names, want, got, strict=True):
        # the T5 part runs in fp32 on both sides (chunked backward vs autograd of the reference)
        assert_close(f"grad {name}", a, b, 1e-5)
    assert "fast.merge_bias" in names


def test_the_cumulant_is_exact_for_gaussian_keys():
    """For Gaussian keys log E[exp(s q.k)] is exactly the second-order cumulant: with many keys the
    estimate meets the true log-partition."""
    torch.manual_seed(0)
    dim, m = 8, 200_000
    k = torch.randn(1, 1, m, dim) * 0.7 + 0.3
    q = torch.randn(1, 1, 5, dim)
    exact = torch.logsumexp((q @ k.transpose(-1, -2)) / math.sqrt(dim), dim=-1)
    assert_close("log Z", exact, image_log_partition(q, k), 1e-3)


def test_merge_must_be_known():
    with pytest.raises(ValueError, match="merge must be one of"):
        T5Attention(2, 8, exact_text=True, merge="gate")


@pytest.mark.parametrize("chunk_tokens", [0, -4, 2.5, True])
def test_one_pass_refuses_a_bad_chunk_size(chunk_tokens):
    module = _module()
    q, k, v = torch.randn(3, 1, 3 * 4 + 5, 2, 8).unbind(0)
    params, layout = check_call(q, k, v, weights=module.fast_weights(), grid=(3, 4), text_tokens=5)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        t5core.ttt_chunked.chunked_hybrid_attention(q, k, v, params, layout, chunk_tokens=chunk_tokens)


def test_text_rows_in_float16_stay_one_call(monkeypatch):
    """Older torch's fused CPU kernel has no float16: such text rows are one SDPA call at any length."""
    monkeypatch.setattr(t5core.hybrid, "TEXT_ROW_KEYS", 5)
    monkeypatch.setattr(t5core.hybrid, "_FLASH_CPU", _must_not_run)
    q, k, v = torch.randn(3, 1, 12, 2, 8).half().unbind(0)
    out = t5core.hybrid.text_rows(q[:, :4], k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q[:, :4], k, v)))
    assert out.dtype == torch.float32
    assert_close("float16 text rows", expected.float(), out, 1e-3)

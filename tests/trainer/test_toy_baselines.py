"""Ablation baselines: plain linear attention matches its quadratic definition; re-init touches only
the inherited attention weights of converted modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sd3_testbed.baselines import PlainLinearAttention, reinit_inherited
from testing.models import tiny_transformer


def _quadratic_linear_attention(q, k, v):
    phi_q, phi_k = F.elu(q.double()) + 1, F.elu(k.double()) + 1
    scores = torch.einsum("bnhd,bmhd->bhnm", phi_q, phi_k)
    weights = scores / scores.sum(-1, keepdim=True)
    return torch.einsum("bhnm,bmhd->bnhd", weights, v.double())


@pytest.mark.parametrize(
    "shape, dtype, atol",
    [
        pytest.param((2, 37, 3, 16), torch.float32, 1e-5, id="B2-N37-H3-D16-fp32"),
        pytest.param((1, 64, 2, 64), torch.bfloat16, 3e-2, id="B1-N64-H2-D64-bf16"),
    ],
)
def test_plain_linear_attention_matches_quadratic_form(shape, dtype, atol):
    gen = torch.Generator().manual_seed(42)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    out = PlainLinearAttention()(q, k, v, grid=None, text_tokens=0)
    assert out.dtype == dtype
    # bf16 tolerance: the inputs and output are rounded to bf16 (8 bits of mantissa).
    torch.testing.assert_close(out.double(), _quadratic_linear_attention(q, k, v), rtol=0, atol=atol)


def test_plain_linear_attention_samples_are_independent():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 20, 2, 8, generator=gen) for _ in range(3))
    whole = PlainLinearAttention()(q, k, v)
    torch.testing.assert_close(whole[1:2], PlainLinearAttention()(q[1:2], k[1:2], v[1:2]), rtol=1e-6, atol=1e-6)


def test_plain_linear_attention_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="share one"):
        PlainLinearAttention()(torch.randn(1, 4, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 4, 2, 8))


def test_reinit_inherited_changes_only_converted_attention():
    model = tiny_transformer("sd35_medium_like")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = reinit_inherited(model, ("blocks.0.attn2", "blocks.2.attn"), seed=0)
    fresh_ids = {id(p) for p in fresh}
    for name, param in model.named_parameters():
        converted = name.startswith(("transformer_blocks.0.attn2.", "transformer_blocks.2.attn."))
        assert (id(param) in fresh_ids) == converted, name
        if not converted:
            assert torch.equal(param, before[name]), name
        elif ".norm_" in name:
            assert bool((param == 1).all()), name
        elif name.endswith("weight"):
            assert not torch.equal(param, before[name]), name

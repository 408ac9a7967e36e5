"""The fused kernels against the reference `t5core.ttt.t5_attention_ref`: output and every
gradient, over grids (non-square, odd, 1 x n, n x 1), text first / last / none, both inner models,
batch > 1, fp32 / fp16 (bf16 on CUDA only), and bitwise reproducibility."""

from __future__ import annotations

import functools

import pytest
import torch

from t5core.contract import check_call, fast_weight_names
from t5core.ttt import t5_attention_ref
from t5kernels import t5_attention
from t5kernels.launch import LaunchSettings, make_plan
from testing.tolerances import KERNEL_RATIO, assert_close
from tests.t5kernels.testing import Case, make_leaves, run

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (SD3.5 shapes, bf16 MMA)")


SMALL = [
    Case(2, 2, 16, (5, 7), 11, True, "swiglu", f32),
    Case(1, 2, 16, (3, 4), 5, False, "mlp", f32),
    Case(2, 1, 16, (1, 9), 0, True, "swiglu", f16),
    Case(1, 2, 16, (9, 1), 4, False, "swiglu", f32),
    Case(2, 2, 16, (4, 6), 3, True, "mlp", f16),
    Case(1, 1, 32, (7, 5), 13, False, "swiglu", f32),
    Case(1, 2, 16, (8, 8), 16, True, "swiglu", f16),
    Case(2, 1, 16, (6, 6), 0, True, "mlp", f32, locality=False),
    Case(1, 1, 16, (2, 3), 1, True, "swiglu", f32, key_norm_eps=None),
    Case(1, 2, 16, (5, 5), 2, False, "mlp", f32, locality=False, key_norm_eps=None),
    Case(2, 2, 16, (3, 5), 7, False, "swiglu", bf16),
]
SD35 = [
    Case(2, 24, 64, (64, 64), 333, True, "swiglu", bf16),
    Case(2, 24, 64, (64, 64), 333, False, "swiglu", f16),
    Case(2, 24, 64, (64, 64), 0, True, "mlp", bf16),
    Case(2, 24, 64, (48, 80), 333, False, "mlp", f32),
]
SD35_2K = [Case(2, 24, 64, (128, 128), 333, False, "swiglu", bf16)]


def _skip_unsupported(case: Case, device: torch.device) -> None:
    if case.dtype == bf16 and device.type != "cuda":
        pytest.skip("bf16 tl.dot is wrong under the Triton interpreter (triton-lang/triton#11584)")


def _compare(case: Case, device: torch.device) -> None:
    _skip_unsupported(case, device)
    leaves = make_leaves(case, device)
    ref = run(t5_attention_ref, case, leaves)
    out = run(t5_attention, case, leaves)
    assert ref.keys() == out.keys()
    for name in ref:
        assert_close(name, ref[name], out[name], KERNEL_RATIO[case.dtype])


@pytest.mark.parametrize("case", [c.param() for c in SMALL])
def test_matches_reference_forward_and_backward(case: Case, device: torch.device):
    _compare(case, device)


@pytest.mark.parametrize(
    "case",
    [
        Case(2, 2, 16, (3, 5), 6, True, "swiglu", f32).param(),
        Case(2, 1, 16, (4, 3), 5, False, "mlp", f16).param(),
    ],
)
def test_two_runs_give_identical_bits(case: Case, device: torch.device):
    leaves = make_leaves(case, device)
    first, second = run(t5_attention, case, leaves), run(t5_attention, case, leaves)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize(
    "settings, splits",
    [
        (LaunchSettings(block_n=32, map_block_n=16, num_warps=4, num_stages=1, programs_per_sm=1), 1),
        (LaunchSettings(block_n=16, map_block_n=64, num_warps=2, num_stages=2, programs_per_sm=12), 3),
    ],
    ids=["bigger-tiles-one-split", "smaller-tiles-three-splits"],
)
def test_explicit_launch_settings_match_reference(settings: LaunchSettings, splits: int, device: torch.device):
    """Other tiles and token splits (what `benchmarks/sweep_kernels.py` times) give the same math."""
    case = Case(2, 2, 16, (5, 7), 6, False, "swiglu", f32)
    leaves = make_leaves(case, device)
    weights = tuple(leaves[name] for name in fast_weight_names(case.variant))
    qkv = (leaves["q"], leaves["k"], leaves["v"])
    _, layout = check_call(*qkv, weights=weights, grid=case.grid, text_tokens=case.text, text_first=case.text_first)
    plan = make_plan(leaves["q"], layout, phase="fwd", settings=settings)
    assert (plan.block_n, plan.map_block_n) == (settings.block_n, settings.map_block_n)
    if device.type == "cpu":  # the interpreter counts one SM; a GPU has its own count
        assert plan.splits == splits
    ref = run(t5_attention_ref, case, leaves)
    out = run(functools.partial(t5_attention, launch=settings), case, leaves)
    for name in ref:
        assert_close(name, ref[name], out[name], KERNEL_RATIO[case.dtype])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(block_n=8), "block_n must be a power of two >= 16"),
        (dict(map_block_n=48), "map_block_n must be a power of two >= 16"),
        (dict(num_warps=3), "num_warps must be 1, 2, 4, 8 or 16"),
        (dict(num_stages=0), "num_stages and programs_per_sm must be >= 1"),
        (dict(programs_per_sm=0), "num_stages and programs_per_sm must be >= 1"),
    ],
)
def test_bad_launch_settings_name_the_field(overrides: dict, match: str):
    with pytest.raises(ValueError, match=match):
        LaunchSettings(**{**dict(block_n=32, map_block_n=32, num_warps=8, num_stages=1), **overrides})


def test_empty_allocations_are_poisoned_during_kernel_tests():
    assert torch.empty(4).isnan().all() and torch.empty_like(torch.zeros(2, 2)).isnan().all()


def test_inputs_are_not_modified(device: torch.device):
    case = Case(1, 1, 16, (3, 3), 2, True, "swiglu", f32)
    leaves = make_leaves(case, device)
    copies = {name: t.clone() for name, t in leaves.items()}
    run(t5_attention, case, leaves)
    for name, tensor in leaves.items():
        assert torch.equal(tensor, copies[name]), name


def test_non_contiguous_inputs_match_contiguous(device: torch.device):
    case = Case(1, 2, 16, (3, 4), 2, False, "mlp", f32)
    leaves = make_leaves(case, device)
    qkv = torch.stack([leaves["q"], leaves["k"], leaves["v"]], dim=3)  # (B, N, H, 3, D): strided views
    q, k, v = qkv.unbind(dim=3)
    assert not q.is_contiguous()
    weights = (leaves["w1"], leaves["w2"])
    conv = {n: (leaves[f"{n}.weight"], leaves[f"{n}.bias"]) for n in ("q_conv", "k_conv")}
    kwargs = dict(weights=weights, variant="mlp", grid=case.grid, text_tokens=2, text_first=False, **conv)
    assert torch.equal(
        t5_attention(q, k, v, **kwargs), t5_attention(q.contiguous(), k.contiguous(), v.contiguous(), **kwargs)
    )


@needs_cuda
@pytest.mark.parametrize("case", [c.param() for c in SD35])
def test_matches_reference_at_sd35_1k_shapes(case: Case):
    _compare(case, torch.device("cuda"))


@needs_cuda
@pytest.mark.parametrize("case", [c.param() for c in SD35_2K])
def test_matches_reference_at_sd35_2k_shape(case: Case):
    _compare(case, torch.device("cuda"))


@needs_cuda
def test_sd35_shape_two_runs_give_identical_bits():
    case = SD35[0]
    leaves = make_leaves(case, torch.device("cuda"))
    first, second = run(t5_attention, case, leaves), run(t5_attention, case, leaves)
    for name in first:
        assert torch.equal(first[name], second[name]), name

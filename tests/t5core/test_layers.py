"""Layer specs resolved against model architectures."""

import pytest

from t5core import resolve_layers
from t5core.config import BaseArch
from t5core.layers import paper_joint_tail
from testing.models import shipped_arch

SD35_MEDIUM = shipped_arch("sd3.5_medium")
SD35_LARGE = shipped_arch("sd3.5_large")


def test_paper_spec_on_sd35_medium_is_every_attn2_and_the_last_five_joint_blocks():
    names = resolve_layers("paper", SD35_MEDIUM)
    assert [n for n in names if n.endswith("attn2")] == [f"blocks.{i}.attn2" for i in range(13)]
    assert [n for n in names if n.endswith(".attn")] == [f"blocks.{i}.attn" for i in range(19, 24)]
    assert len(names) == 18


def test_all_spec_is_every_attention_module_in_block_order():
    names = resolve_layers("all", SD35_MEDIUM)
    assert len(names) == 37 and names[:3] == ("blocks.0.attn", "blocks.0.attn2", "blocks.1.attn")
    assert len(resolve_layers("all", SD35_LARGE)) == 38


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("joint:18-19,attn2:0", ("blocks.0.attn2", "blocks.18.attn", "blocks.19.attn")),
        (["blocks.3.attn", "joint:3"], ("blocks.3.attn",)),
        ("attn2:*", tuple(f"blocks.{i}.attn2" for i in range(13))),
        ("none", ()),
        ("", ()),
        ([], ()),
    ],
    ids=["items", "names-dedup", "attn2-star", "none", "empty", "empty-list"],
)
def test_explicit_specs(spec, expected):
    assert resolve_layers(spec, SD35_MEDIUM) == expected


@pytest.mark.parametrize(
    "spec,match",
    [
        ("joint:30", "blocks.30.attn, which the model does not have"),
        ("attn2:13", "blocks.13.attn2"),
        ("attn3:1", "not understood"),
        ("joint:5-2", "is empty"),
    ],
    ids=["past-depth", "no-attn2-there", "bad-kind", "reversed-range"],
)
def test_bad_specs_name_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_layers(spec, SD35_MEDIUM)


def test_paper_spec_on_a_model_without_attn2_is_the_joint_tail_in_the_papers_proportion():
    # 5 of 24 blocks in the paper; 38 * 5 / 24 = 7.9 -> the last 8 of SD3.5 Large.
    assert resolve_layers("paper", SD35_LARGE) == tuple(f"blocks.{i}.attn" for i in range(30, 38))


@pytest.mark.parametrize("depth,tail", [(1, 1), (3, 1), (4, 1), (12, 3), (24, 5), (38, 8)])
def test_paper_joint_tail_keeps_the_papers_fraction_and_at_least_one_block(depth, tail):
    assert paper_joint_tail(depth) == tail


def test_paper_spec_converts_about_half_of_the_toy_as_of_sd35_medium():
    toy = BaseArch(depth=4, heads=4, head_dim=64, dual_attention_layers=(0, 1))
    names = resolve_layers("paper", toy)
    assert names == ("blocks.0.attn2", "blocks.1.attn2", "blocks.3.attn")
    assert len(names) / len(toy.attention_modules()) == 0.5

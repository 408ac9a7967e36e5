"""t5core.deltas: the forms of a `Delta`, diffusers-named deltas to SD3 ones and back, and the base fingerprint."""

import pytest
import torch

from t5core import BaseArch
from t5core.deltas import (
    FINGERPRINT_SAMPLES,
    Delta,
    TensorsOnRead,
    diffusers_deltas,
    diffusers_factors,
    fingerprint,
    fingerprint_keys,
    sd3_deltas,
)

# 2 blocks of 2 heads x 8 (hidden 16); block 1 is the last, whose text adaLN halves are swapped
ARCH = BaseArch(depth=2, heads=2, head_dim=8, dual_attention_layers=(0,))
HIDDEN = 16
QKV = tuple(f"transformer_blocks.0.attn.to_{p}.weight" for p in "qkv")
SWAPPED = "transformer_blocks.1.norm1_context.linear"


def _factors(rows: int, cols: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=generator), torch.randn(rank, cols, generator=generator)


def test_a_low_rank_delta_is_its_parts_stacked_by_rows():
    up, down = torch.randn(3, 5, 2), torch.randn(3, 2, 7)
    delta = Delta(up=up, down=down)
    assert (delta.low_rank, delta.parts, delta.rank, delta.shape) == (True, 3, 2, (15, 7))
    expected = torch.zeros(15, 7)
    for part in range(3):
        for r in range(2):
            expected[part * 5 : (part + 1) * 5] += torch.outer(up[part, :, r], down[part, r])
    torch.testing.assert_close(delta.full(), expected, rtol=1e-6, atol=1e-6)
    assert delta.stored().keys() == {"up", "down"}


def test_a_full_delta_is_its_diff_in_float32():
    diff = torch.randn(4, 6, dtype=torch.bfloat16)
    delta = Delta(diff=diff)
    assert (delta.low_rank, delta.parts, delta.rank, delta.shape) == (False, 1, None, (4, 6))
    assert delta.full().dtype == torch.float32 and torch.equal(delta.full(), diff.float())
    assert delta.stored() == {"diff": diff}


@pytest.mark.parametrize(
    "forms, match",
    [
        pytest.param({}, "give exactly one form", id="none"),
        pytest.param(
            {"diff": torch.zeros(3, 2), "up": torch.zeros(1, 3, 1), "down": torch.zeros(1, 1, 2)},
            "give exactly one form",
            id="both",
        ),
        pytest.param({"up": torch.zeros(1, 3, 1)}, "has up but no down", id="up-only"),
        pytest.param({"down": torch.zeros(1, 1, 2)}, "has down but no up", id="down-only"),
        pytest.param({"up": torch.zeros(3, 1), "down": torch.zeros(1, 2)}, r"must be 3-D", id="2d"),
        pytest.param(
            {"up": torch.zeros(3, 4, 2), "down": torch.zeros(1, 2, 5)}, "need the same parts and rank", id="parts"
        ),
        pytest.param(
            {"up": torch.zeros(3, 4, 2), "down": torch.zeros(3, 1, 5)}, "need the same parts and rank", id="rank"
        ),
    ],
)
def test_a_delta_of_no_known_form_is_refused(forms, match):
    with pytest.raises(ValueError, match=match):
        Delta(**forms)


def test_a_fused_qkv_with_low_rank_q_k_v_of_one_rank_stays_low_rank_in_three_parts():
    low_rank = {name: _factors(HIDDEN, HIDDEN, 2, seed) for seed, name in enumerate(QKV)}
    delta = sd3_deltas({}, low_rank, ARCH)["joint_blocks.0.x_block.attn.qkv.weight"]
    assert (delta.low_rank, delta.parts, delta.rank, delta.shape) == (True, 3, 2, (3 * HIDDEN, HIDDEN))
    for part, name in enumerate(QKV):
        assert torch.equal(delta.up[part], low_rank[name][0]) and torch.equal(delta.down[part], low_rank[name][1])


@pytest.mark.parametrize(
    "full, low_rank",
    [
        pytest.param({}, {QKV[0]: (2, 0), QKV[1]: (2, 1), QKV[2]: (3, 2)}, id="ranks-differ"),
        pytest.param({QKV[1]: 1}, {QKV[0]: (2, 0), QKV[2]: (2, 2)}, id="one-part-full"),
    ],
)
def test_a_fused_qkv_whose_parts_are_not_all_low_rank_of_one_rank_is_a_full_diff(full, low_rank):
    full = {name: torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(s)) for name, s in full.items()}
    low_rank = {name: _factors(HIDDEN, HIDDEN, rank, seed) for name, (rank, seed) in low_rank.items()}
    dense = {**full, **{name: up @ down for name, (up, down) in low_rank.items()}}
    delta = sd3_deltas(full, low_rank, ARCH)["joint_blocks.0.x_block.attn.qkv.weight"]
    assert not delta.low_rank
    expected = torch.cat([dense[name] for name in QKV])
    torch.testing.assert_close(delta.diff, expected, rtol=0, atol=0)


def test_the_swapped_adaln_halves_swap_in_up_and_in_a_diff():
    up, down = _factors(2 * HIDDEN, HIDDEN, 3, 7)
    bias = torch.randn(2 * HIDDEN)
    deltas = sd3_deltas({f"{SWAPPED}.bias": bias}, {f"{SWAPPED}.weight": (up, down)}, ARCH)
    weight = deltas["joint_blocks.1.context_block.adaLN_modulation.1.weight"]
    # diffusers' rows are (scale, shift), SD3's (shift, scale)
    assert weight.parts == 1 and torch.equal(weight.up[0], torch.cat([up[HIDDEN:], up[:HIDDEN]]))
    assert torch.equal(weight.down[0], down)
    assert torch.equal(deltas["joint_blocks.1.context_block.adaLN_modulation.1.bias"].diff, bias.roll(HIDDEN))


def test_renamed_tensors_keep_their_form_and_come_back_dense_under_their_diffusers_names():
    up, down = _factors(HIDDEN, HIDDEN, 2, 3)
    full = {"transformer_blocks.0.attn2.to_out.0.bias": torch.randn(HIDDEN)}
    low_rank = {"transformer_blocks.0.attn2.to_out.0.weight": (up, down), SWAPPED + ".weight": _factors(32, 16, 2, 4)}
    low_rank |= {name: _factors(HIDDEN, HIDDEN, 2, seed) for seed, name in enumerate(QKV, start=10)}
    deltas = sd3_deltas(full, low_rank, ARCH)
    proj = deltas["joint_blocks.0.x_block.attn2.proj.weight"]
    assert proj.parts == 1 and torch.equal(proj.up[0], up) and torch.equal(proj.down[0], down)
    back = diffusers_deltas(deltas, ARCH)
    expected = {**full, **{name: up @ down for name, (up, down) in low_rank.items()}}
    assert back.keys() == expected.keys()
    for name, tensor in expected.items():
        assert back[name].dtype == torch.float32
        torch.testing.assert_close(back[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


def test_low_rank_deltas_give_back_the_diffusers_factors_they_were_made_of():
    low_rank = {"transformer_blocks.0.attn2.to_out.0.weight": _factors(HIDDEN, HIDDEN, 2, 3)}
    low_rank |= {SWAPPED + ".weight": _factors(32, 16, 2, 4)}
    low_rank |= {name: _factors(HIDDEN, HIDDEN, 2, seed) for seed, name in enumerate(QKV, start=10)}
    full = {"transformer_blocks.0.attn2.to_out.0.bias": torch.randn(HIDDEN)}
    deltas = sd3_deltas(full, low_rank, ARCH)
    back = diffusers_factors(deltas, ARCH)
    # the full delta is left out; the fused qkv's parts and the swapped halves come back as they were given
    assert back.keys() == low_rank.keys()
    for name, (up, down) in low_rank.items():
        assert torch.equal(back[name][0], up) and torch.equal(back[name][1], down), name


def test_a_delta_changes_dtype_in_every_form():
    for delta in (Delta(diff=torch.randn(3, 4)), Delta(up=torch.randn(3, 5, 2), down=torch.randn(3, 2, 7))):
        half = delta.to(torch.float16)
        assert half.stored().keys() == delta.stored().keys()
        assert all(t.dtype == torch.float16 for t in half.stored().values())
        torch.testing.assert_close(half.full(), delta.full(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "full, low_rank, match",
    [
        pytest.param(
            {}, {QKV[0]: 1, QKV[1]: 1}, r"qkv\.weight is fused from .*to_v\.weight'\] are missing", id="partial"
        ),
        pytest.param({QKV[0]: 1}, {QKV[0]: 1}, r"to_q\.weight'\] have both a full and a low-rank delta", id="both"),
        pytest.param({"transformer_blocks.0.attn.processor.t5.w1": 1}, {}, "are not inherited SD3 weights", id="t5"),
        pytest.param({}, {"transformer_blocks.0.attn2.to_out.0.bias": 1}, r"give up \(out, rank\)", id="vector"),
    ],
)
def test_deltas_that_cannot_become_sd3_deltas_are_refused(full, low_rank, match):
    full = {name: torch.zeros(HIDDEN, HIDDEN) for name in full}
    low_rank = {
        name: (torch.zeros(HIDDEN), torch.zeros(HIDDEN)) if name.endswith("bias") else _factors(HIDDEN, HIDDEN, 2, 0)
        for name in low_rank
    }
    with pytest.raises(ValueError, match=match):
        sd3_deltas(full, low_rank, ARCH)


def _qkv(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        key: (0.02 * torch.randn(3 * HIDDEN, HIDDEN, generator=generator)).to(dtype) for key in fingerprint_keys(ARCH)
    }


def test_the_fingerprint_is_pinned():
    """The trainer writes it and the hosts compare it: a change of the rule breaks every file written.
    The value was checked, when pinned, against the rule computed in numpy."""
    assert fingerprint_keys(ARCH) == (
        "joint_blocks.0.x_block.attn.qkv.weight",
        "joint_blocks.1.x_block.attn.qkv.weight",
    )
    assert fingerprint(_qkv(), ARCH) == "3c4d905ff67c1150"


def test_copies_of_a_base_in_any_float_dtype_have_one_fingerprint():
    """Each dtype rounds the weights differently (a float16 copy rounded to bfloat16 is not the float32
    weight rounded to bfloat16 in about 6% of elements); their fingerprint is one."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    fingerprints = {fingerprint(_qkv(dtype=dtype), ARCH) for dtype in dtypes}
    fp8 = {key: t.to(torch.float8_e4m3fn).to(torch.float32) for key, t in _qkv().items()}
    assert fingerprints == {fingerprint(fp8, ARCH)}


def test_the_fingerprint_reads_only_each_blocks_image_qkv_and_tells_a_fine_tune_apart():
    tensors = _qkv()
    other = {**tensors, "joint_blocks.0.x_block.attn.proj.weight": torch.ones(HIDDEN, HIDDEN)}
    assert fingerprint(other, ARCH) == fingerprint(tensors, ARCH)
    assert fingerprint(_qkv(seed=1), ARCH) != fingerprint(tensors, ARCH)
    generator = torch.Generator().manual_seed(2)
    fine_tune = {key: t + 0.002 * torch.randn(t.shape, generator=generator) for key, t in tensors.items()}
    assert fingerprint(fine_tune, ARCH) != fingerprint(tensors, ARCH)
    # the last element is always sampled
    last = fingerprint_keys(ARCH)[1]
    flipped = {**tensors, last: tensors[last].clone()}
    flipped[last][-1, -1] *= -1
    assert fingerprint(flipped, ARCH) != fingerprint(tensors, ARCH)
    assert FINGERPRINT_SAMPLES == 64 and len(fingerprint(tensors, ARCH)) == 16


def test_the_fingerprint_names_a_missing_qkv():
    tensors = _qkv()
    del tensors["joint_blocks.1.x_block.attn.qkv.weight"]
    with pytest.raises(ValueError, match=r"reads joint_blocks\.1\.x_block\.attn\.qkv\.weight"):
        fingerprint(tensors, ARCH)


def test_tensors_on_read_make_each_tensor_when_read_and_keep_none():
    tensors, reads = _qkv(), []

    def read(key):
        reads.append(key)
        return tensors[key]

    lazy = TensorsOnRead(fingerprint_keys(ARCH), read)
    assert len(lazy) == 2 and "joint_blocks.0.x_block.attn.qkv.weight" in lazy and "other" not in lazy
    assert reads == []
    assert fingerprint(lazy, ARCH) == fingerprint(tensors, ARCH)
    assert reads == list(fingerprint_keys(ARCH))
    with pytest.raises(KeyError):
        lazy["other"]

"""The toy's paired statistics and artifact measures, against values computed independently."""

from __future__ import annotations

import itertools

import pytest
import torch

from sd3_testbed.artifacts import (
    background_error,
    background_level,
    open_background_level,
    token_period_energy,
)
from sd3_testbed.stats import paired_difference, paired_runs


def test_paired_difference_mean_is_the_mean_of_hit_differences():
    teacher = [1, 0, 1, 1, 0, 0, 1, 0]
    model = [[1, 1, 0, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 1, 1, 0]]
    diff = paired_difference(model, teacher)
    # seed 0: +1 -1 = 0; seed 1: -1 +1 +1 = +1 -> (0 + 1) / 16
    assert diff.mean == pytest.approx(1 / 16)
    assert diff.low <= diff.mean <= diff.high and (diff.seeds, diff.samples) == (2, 8)


def test_identical_models_have_a_zero_width_interval():
    hits = [1, 0, 1, 1, 0]
    diff = paired_difference([hits, hits], hits)
    assert (diff.mean, diff.low, diff.high) == (0.0, 0.0, 0.0)


def test_the_interval_covers_the_exact_sampling_spread():
    """One seed, n samples, each differing with probability p: the 95% interval is about
    +-1.96 sqrt(var / n) with var the per-sample variance of the differences."""
    generator = torch.Generator().manual_seed(0)
    n = 2000
    teacher = torch.randint(2, (n,), generator=generator)
    flips = torch.rand(n, generator=generator) < 0.3
    model = torch.where(flips, 1 - teacher, teacher)
    diffs = (model - teacher).double()
    expected = 1.96 * (diffs.var(correction=0) / n).sqrt().item()
    diff = paired_difference([model.tolist()], teacher.tolist())
    assert (diff.high - diff.low) / 2 == pytest.approx(expected, rel=0.1)


def test_misaligned_hits_are_refused():
    with pytest.raises(ValueError, match="cover the teacher's 3 samples"):
        paired_difference([[1, 0]], [1, 0, 1])
    with pytest.raises(ValueError, match="at least one seed"):
        paired_difference([], [1])


def test_background_level_reads_only_the_teachers_black_pixels():
    teacher = torch.zeros(2, 3, 8, 8)
    teacher[:, :, :4] = 0.9  # the top half is an object
    images = teacher.clone()
    images[:, :, 4:] = 0.02  # a lifted background
    images[:, :, :4] = 0.5  # object pixels do not count
    assert background_level(images, teacher) == pytest.approx(0.02)
    assert background_level(teacher, teacher) == 0.0


def test_open_background_ignores_an_object_drawn_larger_but_reads_a_lift():
    teacher = torch.zeros(1, 3, 24, 24)
    teacher[:, :, 8:12, 8:12] = 0.8
    larger = teacher.clone()
    larger[:, :, 12:14, 8:12] = 0.8  # the object two rows taller: background pixels of the teacher
    assert background_level(larger, teacher) > 0.005
    assert open_background_level(larger, teacher) == 0.0
    lifted = larger.clone()
    lifted[:, :, 20:, :] += 0.03  # a band far from both objects
    # open pixels: 24 x 24 minus the 9 x 9 block around both objects (rows 6..15, margin 2)
    open_pixels = 24 * 24 - (16 - 6) * (14 - 6)
    assert open_background_level(lifted, teacher) == pytest.approx(0.03 * 4 * 24 / open_pixels, rel=1e-5)


def test_a_per_token_pattern_is_all_token_period_energy_and_noise_is_not():
    teacher = torch.rand(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    tile = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(2))
    patterned = teacher + tile.repeat(1, 12, 12)
    assert token_period_energy(patterned, teacher) == pytest.approx(1.0, abs=1e-6)
    noisy = teacher + 0.1 * torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(3))
    lattice = [(y, x) for y, x in itertools.product(range(0, 48, 12), repeat=2) if (y, x) != (0, 0)]
    assert token_period_energy(noisy, teacher) == pytest.approx(len(lattice) / (48 * 48), rel=0.5)


def _black_teacher_with_an_object() -> torch.Tensor:
    teacher = torch.zeros(2, 3, 24, 24)
    teacher[:, :, 8:12, 8:12] = 0.8
    return teacher


def _open_pixels(teacher: torch.Tensor) -> torch.Tensor:
    """The open background written out: more than 2 px from the object (rows and columns 6..13)."""
    keep = torch.ones(24, 24, dtype=torch.bool)
    keep[6:14, 6:14] = False
    return keep


def test_background_error_reads_a_level_below_black_that_the_clamp_hides():
    teacher = _black_teacher_with_an_object()
    raw = teacher.clone()
    raw[:, :, 16:, :] = -0.02  # below black: invisible after the clamp
    error = background_error(raw, teacher)
    share = (8 * 24) / _open_pixels(teacher).sum().item()
    assert open_background_level(raw.clamp(0, 1), teacher) == 0.0
    assert error.bias == pytest.approx(-0.02 * share, rel=1e-5)
    assert error.noise == pytest.approx(0.02 * (share * (1 - share)) ** 0.5, rel=1e-4)
    assert error.lit == 0.0


def test_background_error_splits_a_token_pattern_from_noise():
    teacher = _black_teacher_with_an_object()
    tile = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(4)) * 0.01
    tile -= tile.mean(dim=(1, 2), keepdim=True)  # zero mean per channel: the pattern leaves the bias alone
    raw = teacher + 0.003 + tile.repeat(1, 6, 6)
    raw[:, :, 8:12, 8:12] = 0.8
    error = background_error(raw, teacher)
    # the closed 8 x 8 block around the object covers every position within a token twice per axis, so every
    # position is open equally often and the count-weighted RMS is the tile's own
    assert error.bias == pytest.approx(0.003, abs=1e-6)
    assert error.token_pattern == pytest.approx(tile.square().mean().sqrt().item(), rel=1e-4)
    assert error.noise == pytest.approx(error.token_pattern, rel=1e-4)
    noisy = raw + 0.01 * torch.randn(raw.shape, generator=torch.Generator().manual_seed(5))
    noisy[:, :, 8:12, 8:12] = 0.8
    mixed = background_error(noisy, teacher)
    # independent noise adds in quadrature; in the pattern it is averaged over the 2 x 36 - 2 x 4 = 64 open
    # pixels behind each position's mean
    assert mixed.noise == pytest.approx((0.01**2 + error.token_pattern**2) ** 0.5, rel=0.05)
    assert mixed.token_pattern == pytest.approx((error.token_pattern**2 + (0.01 / 8) ** 2) ** 0.5, rel=0.15)


def test_background_error_without_open_background_is_zero():
    teacher = torch.full((1, 3, 8, 8), 0.9)
    assert background_error(teacher - 0.5, teacher) == background_error(teacher, teacher)
    assert background_error(teacher, teacher).bias == 0.0


def test_artifact_measures_refuse_mismatched_sets():
    with pytest.raises(ValueError, match="of one shape"):
        background_level(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 4))
    with pytest.raises(ValueError, match="not a multiple of the token size"):
        token_period_energy(torch.zeros(1, 3, 10, 10), torch.zeros(1, 3, 10, 10))
    with pytest.raises(ValueError, match="not a multiple of the token size"):
        background_error(torch.zeros(1, 3, 10, 10), torch.zeros(1, 3, 10, 10))


def test_two_trained_models_pair_on_seed_and_sample():
    model, reference = [[1, 1, 0, 1], [0, 1, 1, 1]], [[1, 0, 0, 1], [0, 1, 1, 0]]
    diff = paired_runs(model, reference)
    assert diff.mean == pytest.approx(2 / 8) and diff.seeds == 2 and diff.samples == 4
    # against a reference whose hits are the teacher's on every seed, it is paired_difference
    teacher = [1, 0, 1, 1]
    assert paired_runs(model, [teacher, teacher]) == paired_difference(model, teacher)
    with pytest.raises(ValueError, match="the same seeds"):
        paired_runs(model, reference[:1])
    with pytest.raises(ValueError, match="same samples"):
        paired_runs([[1, 0]], [[1, 0, 1]])

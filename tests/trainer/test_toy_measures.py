"""The toy's paired statistics and artifact measures, against values computed independently."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer.toy.artifacts import background_level, open_background_level, token_period_energy
from trainer.toy.stats import paired_difference


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


def test_artifact_measures_refuse_mismatched_sets():
    with pytest.raises(ValueError, match="of one shape"):
        background_level(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 4))
    with pytest.raises(ValueError, match="not a multiple of the token size"):
        token_period_energy(torch.zeros(1, 3, 10, 10), torch.zeros(1, 3, 10, 10))

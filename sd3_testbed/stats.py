"""Paired comparisons of ToyEval runs: a model against its teacher on the same captions and noise.

Each ToyEval sample is a hit (1) or a miss (0). A model-vs-teacher difference is the mean over seeds
and samples of `hit(model, seed, sample) - hit(teacher, sample)`; pairing on the sample removes the
spread that comes from which captions and noise were drawn. Its 95% interval is a percentile
bootstrap that resamples seeds and samples independently (two-stage), so both the seed-to-seed
spread and the sample-to-sample spread are in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PairedDifference", "paired_difference", "paired_runs"]

RESAMPLES = 4000
"""Bootstrap resamples: the interval's ends move by well under 0.001 between bootstrap seeds."""


@dataclass(frozen=True, slots=True)
class PairedDifference:
    """Model minus teacher (or minus another trained model), in ToyEval units, with a 95% bootstrap interval."""

    mean: float
    low: float
    high: float
    seeds: int
    samples: int

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def paired_difference(
    model_hits: Sequence[Sequence[int]], teacher_hits: Sequence[int], *, resamples: int = RESAMPLES, seed: int = 0
) -> PairedDifference:
    """The paired model-minus-teacher difference and its 95% interval.

    Args:
        model_hits: per seed, the model's hits (0 / 1) on the evaluation samples, in order.
        teacher_hits: the teacher's hits on the same samples.
        resamples: bootstrap resamples.
        seed: the bootstrap's random seed (the interval is reproducible).

    Raises:
        ValueError: no seeds, or a seed's hits that do not line up with the teacher's.
    """
    if not model_hits:
        raise ValueError("paired_difference needs the hits of at least one seed.")
    lengths = {len(hits) for hits in model_hits}
    if lengths != {len(teacher_hits)}:
        raise ValueError(
            f"every seed's hits must cover the teacher's {len(teacher_hits)} samples; got lengths {sorted(lengths)}."
        )
    return paired_runs(model_hits, [teacher_hits] * len(model_hits), resamples=resamples, seed=seed)


def paired_runs(
    model_hits: Sequence[Sequence[int]],
    reference_hits: Sequence[Sequence[int]],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> PairedDifference:
    """The paired difference of two trained models (model minus reference) and its 95% interval: both hits
    per seed, paired on the seed (the same training seed) and on the sample (the same caption and noise).

    Args:
        model_hits, reference_hits: per seed, in the same order of seeds, the hits (0 / 1) on the evaluation
            samples, in order.
        resamples, seed: as for `paired_difference`.

    Raises:
        ValueError: no seeds, unequal numbers of seeds, or hits that do not line up.
    """
    if not model_hits or len(model_hits) != len(reference_hits):
        raise ValueError(
            f"paired_runs needs the hits of the same seeds, at least one; got {len(model_hits)} and "
            f"{len(reference_hits)}."
        )
    lengths = {len(hits) for hits in (*model_hits, *reference_hits)}
    if len(lengths) != 1:
        raise ValueError(
            f"every seed's hits must cover the same samples as the reference's; got lengths {sorted(lengths)}."
        )
    diffs = torch.tensor([list(hits) for hits in model_hits], dtype=torch.float64) - torch.tensor(
        [list(hits) for hits in reference_hits], dtype=torch.float64
    )  # (S, N)
    seeds, samples = diffs.shape
    generator = torch.Generator().manual_seed(seed)
    seed_pick = torch.randint(seeds, (resamples, seeds), generator=generator)
    sample_pick = torch.randint(samples, (resamples, samples), generator=generator)
    # mean over the resampled seeds of the mean over the resampled samples
    per_seed = diffs[seed_pick.unsqueeze(-1), sample_pick.unsqueeze(1)].mean(-1)  # (R, S)
    means = per_seed.mean(-1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return PairedDifference(diffs.mean().item(), low, high, seeds, samples)

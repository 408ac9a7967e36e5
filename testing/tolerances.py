"""How tests and benchmarks compare a fast path with the reference: relative RMS error, one rule.

The error is ||out - ref|| / ||ref|| over all elements, in float64, so it does not depend on the
tensor's size or scale; the max abs error is logged beside it. `KERNEL_RATIO` is the one table of
what the Triton kernels may differ from `t5core.ttt` per input dtype, `CHUNKED_RATIO` the same for the
chunked torch path, and `FP8_RATIO` what a model loaded from scaled-fp8 weights may differ from its source.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

KERNEL_RATIO: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
"""Relative RMS error the kernels may show against the fp32 reference, by input dtype: the MMA
operands are rounded to the input dtype, so half precision gets a looser bound."""


CHUNKED_RATIO: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
"""Relative RMS error the chunked torch path may show against the reference, by input dtype: both
compute in fp32, so only the order of the sums over tokens differs (fp32: ~1e-7 seen); in half
precision a reordered sum can land on the other side of a rounding boundary in a few elements."""


FP8_RATIO = 0.15
"""Relative RMS error a model whose weights are stored as scaled fp8 (float8_e4m3fn over a per-tensor
scale) may show against the model it was quantized from: e4m3 keeps 3 mantissa bits, so each weight moves
by up to 6.25%, and the errors add up layer by layer (tiny models seen: transformer 2.7%, T5 6.6%, CLIP
9.8%). Weights left unscaled would be off by a factor of hundreds."""


def relative_rms(ref: Tensor, out: Tensor) -> float:
    """Relative RMS error of `out` against `ref`.

    Args:
        ref (`Tensor`):
            The reference values.
        out (`Tensor`):
            The values to check, any shape with as many elements as `ref`.

    Returns:
        ||out - ref|| / ||ref||, computed in float64 (a zero `ref` counts as 1e-30).
    """
    diff = (out.double() - ref.double()).norm()
    return (diff / ref.double().norm().clamp_min(1e-30)).item()


def assert_close(name: str, ref: Tensor, out: Tensor, ratio: float) -> None:
    """Assert that `out` has `ref`'s shape and dtype, is finite, and its relative RMS error is at most
    `ratio`; the error and the max abs error are logged under `name`."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{name}: {out.shape}/{out.dtype} vs {ref.shape}/{ref.dtype}"
    )
    diff = (out.double() - ref.double()).flatten()
    assert torch.isfinite(diff).all(), f"{name}: non-finite values (an unwritten tile?)"
    rel = relative_rms(ref, out)
    logger.info("%s: relative RMS error %.2e, max abs error %.2e", name, rel, diff.abs().max().item())
    assert rel <= ratio, f"{name}: relative RMS error {rel:.2e} > {ratio:.0e} (max abs {diff.abs().max().item():.2e})"

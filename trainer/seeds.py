"""The run's random streams: one seed, derived per named stream (data order, noise, ranks).

Data, noise and timesteps use global streams (`derived_seed(seed, "noise", step)`), so N processes
draw what one would; rank-local randomness (dropout and the like) uses `rank_seed`.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

__all__ = ["derived_seed", "rank_seed", "seed_everything"]


def derived_seed(seed: int, *stream: int | str) -> int:
    """A 63-bit seed for one named random stream of a run (`derived_seed(seed, "noise", step)`).

    Stable across processes, machines and Python versions (a hash of the text, not `hash()`), and
    independent streams for different names, steps or ranks.
    """
    text = ":".join(str(part) for part in (seed, *stream))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank-local randomness (dropout and the like); data and noise use global streams."""
    return derived_seed(seed, "rank", rank)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

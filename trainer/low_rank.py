"""Low-rank training of inherited weights: each trained inherited weight matrix learns a rank-r delta.

`--model.rank r` keeps every inherited 2-D weight that would train in full at its base value and
trains `scale * up @ down` beside it instead (`scale = alpha / r`, LoRA's convention), through a
torch parametrization: the module still reads `.weight`, now computed as `original + scale * up @ down`.
`down` starts random and `up` at zero, so the model starts as the base, exactly. Vectors (biases,
norm scales) keep training in full; `trainer.publishing.export` writes their change as a full delta.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = ["ORIGINAL", "LowRankDelta", "add_low_rank", "factor_names", "low_rank_names"]

logger = logging.getLogger(__name__)

ORIGINAL = ".parametrizations.weight.original"
"""What parametrization appends to a weight's name for its frozen base value."""
_FACTORS = ".parametrizations.weight.0."


class LowRankDelta(nn.Module):
    """The parametrization `W -> W + scale * up @ down` of one weight matrix `[out, in]`.

    Args:
        weight: the base weight `[out, in]` (for shape, device and init scale).
        rank: r, the delta's rank.
        alpha: the delta's scale is `alpha / rank`.
    """

    def __init__(self, weight: Tensor, *, rank: int, alpha: float) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.scale = alpha / rank
        self.down = nn.Parameter(torch.empty(rank, in_features, device=weight.device, dtype=torch.float32))
        self.up = nn.Parameter(torch.zeros(out_features, rank, device=weight.device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))

    def forward(self, original: Tensor) -> Tensor:
        return original + (self.scale * self.up) @ self.down

    def factors(self) -> tuple[Tensor, Tensor]:
        """(up `[out, r]` with the scale folded in, down `[r, in]`): the delta is their product."""
        return self.scale * self.up.detach(), self.down.detach()


def add_low_rank(model: nn.Module, names: tuple[str, ...], *, rank: int, alpha: float) -> dict[str, LowRankDelta]:
    """Parametrize the named 2-D weights (`transformer_blocks.3.attn.to_q.weight`) of `model` with a
    `LowRankDelta` each, and freeze their base values.

    Returns:
        The parametrization of each weight, by the weight's name.

    Raises:
        ValueError: a name that is not a 2-D `weight` of a module of `model`.
    """
    modules = dict(model.named_modules())
    deltas: dict[str, LowRankDelta] = {}
    for name in names:
        owner_name, _, attribute = name.rpartition(".")
        owner = modules.get(owner_name)
        weight = getattr(owner, attribute, None)
        if attribute != "weight" or not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"{name} is not the 2-D weight of a module; only weight matrices take a low-rank delta.")
        delta = LowRankDelta(weight, rank=min(rank, *weight.shape), alpha=alpha)
        parametrize.register_parametrization(owner, "weight", delta)
        owner.parametrizations.weight.original.requires_grad_(False)
        deltas[name] = delta
    logger.info(
        "Model: rank-%d deltas on %d inherited weight matrices (%.2fM trained parameters, scale %.3g)",
        rank,
        len(deltas),
        sum(d.up.numel() + d.down.numel() for d in deltas.values()) / 1e6,
        alpha / rank,
    )
    return deltas


def low_rank_names(model: nn.Module, inherited: tuple[str, ...]) -> tuple[str, ...]:
    """The trained inherited parameters that take a low-rank delta: every 2-D `weight` of a module."""
    params = dict(model.named_parameters())
    return tuple(name for name in inherited if name.endswith(".weight") and params[name].dim() == 2)


def factor_names(weight: str) -> tuple[str, str]:
    """The parameter names of a parametrized weight's (up, down) factors."""
    owner = weight.removesuffix(".weight")
    return owner + _FACTORS + "up", owner + _FACTORS + "down"

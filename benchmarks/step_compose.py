"""A sampling step composed from per-block times: which kind of block each joint block is, per path.

A joint block's cost depends on two things only: its structure (whether the image stream has MMDiT-X
`attn2`, whether the text stream is pre-only, as in the last block) and what each of its attentions
runs (softmax, T5 over all tokens `ttt`, or the `hybrid` joint mode; `attn2` is softmax or T5). Two
blocks with the same `BlockKind` run the same code on tensors of the same shapes, so one measured
block of each kind stands for all of them, and a step is

    step = rest + sum over the model's blocks of the time of its kind

where `rest` is everything but the joint blocks (embedders, final layer, sampler, CFG batching),
measured as a whole step whose blocks do nothing. `benchmarks/bench_comfy_step.py` measures the
parts; this module only counts and adds, so it imports no ComfyUI.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["BlockKind", "BlockShape", "compose", "kinds_of"]

JointRun = Literal["softmax", "ttt", "hybrid"]
Attn2Run = Literal["softmax", "t5"]


@dataclass(frozen=True, order=True)
class BlockShape:
    """The structure of one joint block."""

    attn2: bool
    """The image stream has MMDiT-X image-only attention (`attn2`)."""
    pre_only: bool
    """The text stream stops after its projections (the last block: no text output)."""


@dataclass(frozen=True, order=True)
class BlockKind:
    """A block's structure (`shape`) and what its attentions run; blocks of one kind cost the same."""

    shape: BlockShape
    joint: JointRun
    """What the joint attention over [text, image] runs."""
    attn2: Attn2Run | None
    """What `attn2` runs; None for a block without it."""

    def label(self) -> str:
        """Short text for tables and JSON: `attn2 block: joint softmax, attn2 T5`."""
        where = "last block" if self.shape.pre_only else "attn2 block" if self.shape.attn2 else "block"
        attn2 = f", attn2 {'T5' if self.attn2 == 't5' else 'softmax'}" if self.attn2 else ""
        joint = {"softmax": "softmax", "ttt": "T5", "hybrid": "hybrid"}[self.joint]
        return f"{where}: joint {joint}{attn2}"


def kinds_of(
    shapes: Sequence[BlockShape], layers: Iterable[str], joint_mode: Literal["ttt", "hybrid"]
) -> list[BlockKind]:
    """The kind of every joint block of a model converted on `layers`.

    Args:
        shapes (`Sequence[BlockShape]`): block `i`'s structure at index `i`.
        layers (`Iterable[str]`): the converted modules (`blocks.{i}.attn`, `blocks.{i}.attn2`); empty
            for softmax.
        joint_mode (`"ttt" | "hybrid"`): what a converted joint attention runs (`T5Config.joint_mode`).

    Returns:
        `list[BlockKind]`, one per block, in block order.

    Raises:
        ValueError: `layers` names an `attn2` on a block without one, or a block the model lacks.
    """
    converted = set(layers)
    kinds = []
    for index, shape in enumerate(shapes):
        joint = joint_mode if f"blocks.{index}.attn" in converted else "softmax"
        attn2 = f"blocks.{index}.attn2"
        if attn2 in converted and not shape.attn2:
            raise ValueError(f"{attn2} is converted, but block {index} has no attn2.")
        kinds.append(BlockKind(shape, joint, ("t5" if attn2 in converted else "softmax") if shape.attn2 else None))
    known = {f"blocks.{i}.{kind}" for i in range(len(shapes)) for kind in ("attn", "attn2")}
    if converted - known:
        raise ValueError(f"{sorted(converted - known)} name blocks beyond the model's {len(shapes)}.")
    return kinds


def compose(rest: float, per_kind: Mapping[BlockKind, float], kinds: Sequence[BlockKind]) -> float:
    """`rest` plus the sum over `kinds` (one entry per block) of `per_kind[kind]`.

    Works for any additive quantity measured per block kind: step time, time inside attention.

    Raises:
        KeyError: a kind of `kinds` was not measured (the message names it).
    """
    counts = Counter(kinds)
    missing = [kind.label() for kind in counts if kind not in per_kind]
    if missing:
        raise KeyError(f"no measurement for {missing}; measure every kind the path's blocks have.")
    return rest + sum(per_kind[kind] * count for kind, count in counts.items())

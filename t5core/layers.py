"""Layer specs: which attention modules of an SD3-family model are converted to T5 attention.

A spec is `"paper"` (every image-only `attn2`, plus the joint attention of the last 5/24 of the
blocks: SD3.5-T5 converts `attn2` 0-12 and joint 19-23 of SD3.5 Medium's 24 blocks), `"all"`
(every attention module), `"none"` / `""` (nothing), a comma list of `joint:<blocks>` /
`attn2:<blocks>` items with blocks as `i`, `i-j` or `*` (`"joint:18-23,attn2:0-12"`), module names
(`"blocks.3.attn"`), or a sequence of those strings.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from t5core.config import BaseArch

__all__ = ["LayerSpec", "paper_joint_tail", "resolve_layers"]

LayerSpec = str | Sequence[str]


def paper_joint_tail(depth: int) -> int:
    """How many final blocks' joint attention `paper` converts: 5 of 24 (SD3.5 Medium, the paper's
    model), the same fraction rounded for other depths, at least 1.

    SD3.5 Large (38 blocks) gets 8 and the 4-block toy 1; the paper reports neither, so those are
    this project's extrapolation of the paper's choice.
    """
    return max(1, (depth * 5 + 12) // 24)


_KINDS = {"joint": "attn", "attn": "attn", "attn2": "attn2"}
_NAME = re.compile(r"^blocks\.(\d+)\.(attn2?)$")
_ITEM = re.compile(r"^(joint|attn2?):(\*|\d+(?:-\d+)?)$")


def _blocks(text: str, depth: int, item: str) -> range:
    if text == "*":
        return range(depth)
    first, _, last = text.partition("-")
    lo, hi = int(first), int(last or first)
    if lo > hi:
        raise ValueError(f"layer spec item {item!r}: the range {lo}-{hi} is empty; write it low-high.")
    return range(lo, hi + 1)


def _parse_item(item: str, arch: BaseArch) -> list[str]:
    if item == "paper":
        tail = range(arch.depth - paper_joint_tail(arch.depth), arch.depth)
        return [f"blocks.{i}.attn2" for i in arch.dual_attention_layers] + [f"blocks.{i}.attn" for i in tail]
    if item == "all":
        return list(arch.attention_modules())
    if item in ("none", ""):
        return []
    if _NAME.match(item):
        return [item]
    match = _ITEM.match(item)
    if match is None:
        raise ValueError(
            f"layer spec item {item!r} is not understood. Use 'paper', 'all', 'none', "
            "'joint:<blocks>' or 'attn2:<blocks>' with blocks as i, i-j or *, or module names "
            "like 'blocks.3.attn'."
        )
    kind = _KINDS[match.group(1)]
    if kind == "attn2" and match.group(2) == "*":
        return [f"blocks.{i}.attn2" for i in arch.dual_attention_layers]
    return [f"blocks.{i}.{kind}" for i in _blocks(match.group(2), arch.depth, item)]


def resolve_layers(spec: LayerSpec, arch: BaseArch) -> tuple[str, ...]:
    """Resolve a layer spec against a model into module names, in the model's order.

    Args:
        spec (`str | Sequence[str]`): see the module docstring.
        arch (`BaseArch`): the model the names must exist in.

    Returns:
        `tuple[str, ...]` of names like `blocks.12.attn2`, without repeats, in block order.

    Raises:
        ValueError: the spec is malformed or names modules the model does not have.
    """
    items = [spec] if isinstance(spec, str) else list(spec)
    wanted: list[str] = []
    for entry in items:
        if not isinstance(entry, str):
            raise TypeError(f"layer spec entries must be strings; got {type(entry).__name__}.")
        for item in (part.strip() for part in entry.split(",")):
            wanted.extend(_parse_item(item, arch))
    available = arch.attention_modules()
    missing = sorted(set(wanted) - set(available), key=_sort_key)
    if missing:
        dual = arch.dual_attention_layers
        attn2 = f"attn2 on blocks {list(dual)}" if dual else "no attn2 modules"
        raise ValueError(
            f"layer spec {spec!r} names {', '.join(missing)}, which the model does not have: it is "
            f"a {arch.describe()} with joint attention on blocks 0-{arch.depth - 1} and {attn2}. "
            "Restrict the spec to those modules."
        )
    chosen = set(wanted)
    return tuple(name for name in available if name in chosen)


def _sort_key(name: str) -> tuple[int, str]:
    match = _NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else (-1, name)

"""Changes to a base model's inherited weights (format 4 of the T5 weights file), and the fingerprint of a base.

A `Delta` is what a run added to one inherited tensor, in SD3 checkpoint naming: the full difference, or
low-rank factors. A host adds it to whatever base it is given, so a file trained on SD3.5 Medium also
serves a fine-tune of SD3.5 Medium, the way a LoRA does. A low-rank delta of a fused qkv keeps q, k and
v apart as three parts (rows [q; k; v]), each with its own factors, as training them separately gives.

`sd3_deltas` turns a trainer's diffusers-named deltas into `Delta`s and `diffusers_deltas` goes back
to dense diffusers-named tensors. `fingerprint` names a base model by a few of its weights, so that a
host can say when a file meets a base other than the one it was trained on.

The fingerprint reads only the sign bits of its samples. Rounding keeps a sign bit (a value too small
for the dtype becomes a zero of its sign), so float32, float16, bfloat16 and fp8 copies of one
checkpoint, which round each weight differently, have one fingerprint. Any finer reading does not: a
float16 copy rounded again to bfloat16 differs from the float32 weight rounded to bfloat16 in about 6%
of the elements (double rounding), so almost every block would differ. A fine-tune moves the weights
near zero across it, which changes the fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from t5core.config import BaseArch
from t5core.sd3_keys import KeyRule, diffusers_to_sd3, key_rules, sd3_to_diffusers

__all__ = [
    "FINGERPRINT_SAMPLES",
    "Delta",
    "TensorsOnRead",
    "diffusers_deltas",
    "diffusers_factors",
    "fingerprint",
    "fingerprint_keys",
    "sd3_deltas",
]


# eq=False: the fields are tensors, which compare elementwise; two Deltas are equal only as one object
@dataclass(frozen=True, eq=False)
class Delta:
    """A change to one inherited tensor (SD3 checkpoint naming): a full delta, or low rank.

    Exactly one form: `diff`, or `up` and `down` (2-D weights only). A low-rank delta has `parts`
    row blocks, 1 for a plain tensor and 3 for a fused qkv (rows [q; k; v]): part p covers rows
    p * rows // parts to (p + 1) * rows // parts and is `up[p] @ down[p]`.

    Attributes:
        diff: the full delta, the shape of the tensor.
        up: (parts, rows // parts, rank).
        down: (parts, rank, cols).

    Raises:
        ValueError: no form or both, only one of `up` and `down`, factors that are not 3-D, or
            factors whose parts or ranks differ.
    """

    diff: Tensor | None = None
    up: Tensor | None = None
    down: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.diff is None) == (self.up is None and self.down is None):
            raise ValueError("a delta is either a full diff or low-rank up and down factors; give exactly one form.")
        if self.diff is not None:
            return
        if self.up is None or self.down is None:
            given, missing = ("up", "down") if self.down is None else ("down", "up")
            raise ValueError(f"a low-rank delta has {given} but no {missing}; it needs both factors.")
        up, down = tuple(self.up.shape), tuple(self.down.shape)
        if len(up) != 3 or len(down) != 3:
            raise ValueError(
                f"low-rank factors are up {up} and down {down}; they must be 3-D: up (parts, rows, rank) "
                "and down (parts, rank, cols)."
            )
        if up[0] != down[0] or up[2] != down[1]:
            raise ValueError(
                f"low-rank factors up {up} and down {down} do not fit: up (parts, rows, rank) and down "
                "(parts, rank, cols) need the same parts and rank."
            )

    @property
    def low_rank(self) -> bool:
        return self.diff is None

    @property
    def parts(self) -> int:
        """The row blocks of a low-rank delta; 1 for a full diff."""
        return 1 if self.up is None else self.up.shape[0]

    @property
    def rank(self) -> int | None:
        """The rank of each part of a low-rank delta; None for a full diff."""
        return None if self.up is None else self.up.shape[2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the tensor it changes."""
        if self.diff is not None:
            return tuple(self.diff.shape)
        return (self.parts * self.up.shape[1], self.down.shape[2])

    def stored(self) -> dict[str, Tensor]:
        """The tensors it is stored as, by form: `diff`, or `up` and `down`."""
        return {"diff": self.diff} if self.diff is not None else {"up": self.up, "down": self.down}

    def to(self, dtype: torch.dtype) -> Delta:
        """The same delta with its tensors in `dtype`."""
        return Delta(**{form: tensor.to(dtype) for form, tensor in self.stored().items()})

    def full(self) -> Tensor:
        """The dense delta in float32, of the tensor's shape: `diff`, or the parts' `up[p] @ down[p]`
        stacked by rows. Do not write into it: a float32 `diff` is returned as it is."""
        if self.diff is not None:
            return self.diff.to(torch.float32)
        return torch.bmm(self.up.to(torch.float32), self.down.to(torch.float32)).flatten(0, 1)


def _check_factors(name: str, up: Tensor, down: Tensor) -> None:
    if up.dim() != 2 or down.dim() != 2 or up.shape[1] != down.shape[0]:
        raise ValueError(
            f"low-rank delta of {name}: up is {tuple(up.shape)} and down {tuple(down.shape)}; give up "
            "(out, rank) and down (rank, in) of a 2-D weight, with one rank."
        )


def _factored(rule: KeyRule, low_rank: Mapping[str, tuple[Tensor, Tensor]]) -> bool:
    """Whether every part of the rule's tensor has a low-rank delta, all of one rank."""
    if not all(name in low_rank for name in rule.diffusers):
        return False
    return len({low_rank[name][1].shape[0] for name in rule.diffusers}) == 1


def sd3_deltas(
    full: Mapping[str, Tensor], low_rank: Mapping[str, tuple[Tensor, Tensor]], arch: BaseArch
) -> dict[str, Delta]:
    """Diffusers-named deltas as SD3-named `Delta`s.

    Renamed tensors keep their form; the swapped halves of the last adaLN rows swap in `up` (or the
    diff); a fused qkv whose q, k and v all have low-rank deltas of one rank is low rank with 3 parts,
    and otherwise a full diff made from each part's dense delta.

    Args:
        full: diffusers tensor name -> dense delta (`transformer_blocks.3.attn.to_out.0.bias`).
        low_rank: diffusers weight name -> (up (out, rank), down (rank, in)), the scale already
            folded into up.
        arch: the model's architecture.

    Returns:
        SD3 name -> `Delta`, in the order of `t5core.sd3_keys.key_rules`.

    Raises:
        ValueError: a name in both mappings, a name that is not an inherited SD3 weight, factors that
            do not fit, or only some of a fused qkv's q, k and v (names the missing ones).
    """
    both = sorted(full.keys() & low_rank.keys())
    if both:
        raise ValueError(f"{both[:5]} have both a full and a low-rank delta; give each tensor one delta.")
    rules = key_rules(arch)
    unknown = sorted((full.keys() | low_rank.keys()) - {name for rule in rules for name in rule.diffusers})
    if unknown:
        raise ValueError(
            f"{unknown[:5]} are not inherited SD3 weights of a {arch.describe()}; "
            "give deltas by the parameter names of the diffusers transformer."
        )
    for name, (up, down) in low_rank.items():
        _check_factors(name, up, down)
    factored = [rule for rule in rules if _factored(rule, low_rank)]
    in_factored = {name for rule in factored for name in rule.diffusers}
    dense = dict(full) | {
        name: up.to(torch.float32) @ down.to(torch.float32)
        for name, (up, down) in low_rank.items()
        if name not in in_factored
    }
    out = {key: Delta(diff=diff) for key, diff in diffusers_to_sd3(dense, arch).items()}
    # up's rows are the weight's rows, so the weight's renaming, swap and fusion (by rows) apply to it
    ups = diffusers_to_sd3({name: low_rank[name][0] for name in in_factored}, arch)
    for rule in factored:
        parts = len(rule.diffusers)
        downs = torch.stack([low_rank[name][1] for name in rule.diffusers])
        out[rule.sd3] = Delta(up=ups[rule.sd3].unflatten(0, (parts, -1)), down=downs)
    return {rule.sd3: out[rule.sd3] for rule in rules if rule.sd3 in out}


def diffusers_deltas(deltas: Mapping[str, Delta], arch: BaseArch) -> dict[str, Tensor]:
    """SD3-named `Delta`s as dense float32 diffusers-named deltas (for the diffusers host).

    Raises:
        ValueError: a name that is not a weight of this architecture.
    """
    return sd3_to_diffusers({key: delta.full() for key, delta in deltas.items()}, arch)


def diffusers_factors(deltas: Mapping[str, Delta], arch: BaseArch) -> dict[str, tuple[Tensor, Tensor]]:
    """The low-rank ones among SD3-named `deltas` as diffusers-named factors, as `sd3_deltas` takes them: a
    fused qkv's parts give q, k and v their own; full diffs are left out.

    Returns:
        Diffusers weight name -> (up (out, rank), down (rank, in)), the scale folded into up.

    Raises:
        ValueError: a name that is not a weight of this architecture.
    """
    rules = {rule.sd3: rule for rule in key_rules(arch)}
    factors: dict[str, tuple[Tensor, Tensor]] = {}
    for key, delta in deltas.items():
        if not delta.low_rank:
            continue
        # up's rows are the weight's rows: the weight's renaming, swap and split (by rows) apply to it
        ups = sd3_to_diffusers({key: delta.up.flatten(0, 1)}, arch)
        for part, name in enumerate(rules[key].diffusers):
            factors[name] = (ups[name], delta.down[part])
    return factors


FINGERPRINT_SAMPLES = 64
"""The elements of each block's image qkv weight whose signs `fingerprint` reads."""


def fingerprint_keys(arch: BaseArch) -> tuple[str, ...]:
    """The SD3 tensors `fingerprint` reads, in block order: each block's image-stream qkv weight."""
    return tuple(f"joint_blocks.{i}.x_block.attn.qkv.weight" for i in range(arch.depth))


def fingerprint(tensors: Mapping[str, Tensor], arch: BaseArch) -> str:
    """A short id of a base model's weights.

    For every block, `FINGERPRINT_SAMPLES` evenly spaced elements of its flattened
    `joint_blocks.{i}.x_block.attn.qkv.weight` (indices `linspace(0, n - 1, S)` rounded, computed in
    float64 so they are exact at any size), their sign bits as one byte each (1 for negative, -0.0
    included), hashed with sha256 in block order. Signs survive any rounding, so copies of one
    checkpoint in any float dtype agree (module docstring).

    Args:
        tensors: SD3-named tensors of any float dtype and device; only `fingerprint_keys(arch)` are
            read, one at a time in block order (a `TensorsOnRead` holds one in memory).
        arch: the model's architecture.

    Returns:
        The first 16 hex digits of the hash.

    Raises:
        ValueError: a qkv weight is missing from `tensors`.
    """
    digest = hashlib.sha256()
    for key in fingerprint_keys(arch):
        if key not in tensors:
            raise ValueError(f"fingerprint reads {key}, which the tensors given lack; give the model's SD3 tensors.")
        values = tensors[key].detach().flatten()
        index = torch.linspace(0, values.numel() - 1, FINGERPRINT_SAMPLES, dtype=torch.float64).round().long()
        signs = torch.signbit(values[index.to(values.device)].to(torch.float32)).to(torch.uint8).cpu()
        digest.update(signs.numpy().tobytes())
    return digest.hexdigest()[:16]


class TensorsOnRead(Mapping[str, Tensor]):
    """Named tensors made when read and not kept: `read(key)` on every access, for the `keys` given.

    A host hands `fingerprint` its model's tensors this way, fused or dequantized one block at a time
    instead of all at once.
    """

    def __init__(self, keys: Iterable[str], read: Callable[[str], Tensor]) -> None:
        self._keys = tuple(keys)
        self._read = read

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

"""Typed settings shared by every part: the base architecture and the T5 conversion config.

Both are frozen dataclasses. The weights file writes them into its metadata (`to_metadata`) and
the loader reads them back (`from_metadata`); no untyped dicts travel between modules.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from t5core.contract import Variant, check_variant
from t5core.hybrid import JOINT_MODES, MERGES, JointMode, Merge
from t5core.neighborhood import check_neighborhood

__all__ = ["T5_SETTINGS", "BaseArch", "T5Config"]


@dataclass(frozen=True, slots=True)
class BaseArch:
    """The shape of an SD3-family MMDiT, enough to check that a weights file fits a model.

    Parameters:
        depth (`int`): number of joint blocks.
        heads (`int`): attention heads per module.
        head_dim (`int`): channels per head.
        dual_attention_layers (`tuple[int, ...]`): blocks that carry an image-only `attn2`.
        qk_norm (`bool`): whether q and k get a per-head RMSNorm (SD3.5) or not (SD3).
    """

    depth: int
    heads: int
    head_dim: int
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: bool = True

    def __post_init__(self) -> None:
        if min(self.depth, self.heads, self.head_dim) < 1:
            raise ValueError(f"depth, heads and head_dim must be positive; got {self}.")
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"dual_attention_layers {bad} are outside blocks 0-{self.depth - 1}.")
        object.__setattr__(self, "dual_attention_layers", tuple(sorted(set(self.dual_attention_layers))))

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def attention_modules(self) -> tuple[str, ...]:
        """Every attention module's name, `blocks.{i}.attn` and `blocks.{i}.attn2`, in block order."""
        names: list[str] = []
        for i in range(self.depth):
            names.append(f"blocks.{i}.attn")
            if i in self.dual_attention_layers:
                names.append(f"blocks.{i}.attn2")
        return tuple(names)

    def describe(self) -> str:
        """A short human name for errors: `SD3.5-Medium-like (24 blocks, 24 heads x 64, attn2 on 0-12)`."""
        family = "SD3.5" if self.qk_norm else "SD3"
        dual = self.dual_attention_layers
        attn2 = f", attn2 on {dual[0]}-{dual[-1]}" if dual else ""
        return f"{family}-family MMDiT ({self.depth} blocks, {self.heads} heads x {self.head_dim}{attn2})"

    def to_metadata(self) -> str:
        return json.dumps({**asdict(self), "hidden": self.hidden}, sort_keys=True)

    @classmethod
    def from_metadata(cls, text: str) -> BaseArch:
        data = json.loads(text)
        data.pop("hidden", None)
        data["dual_attention_layers"] = tuple(data.get("dual_attention_layers", ()))
        return cls(**data)


@dataclass(frozen=True, slots=True)
class T5Config:
    """What defines a converted model besides its weights.

    Parameters:
        variant (`"swiglu" | "mlp"`, *optional*, defaults to `"swiglu"`): the inner model.
        key_norm_eps (`float`, *optional*, defaults to 1.0): key instance-norm eps; None turns the
            key norm off (an ablation).
        locality (`bool`, *optional*, defaults to True): depthwise 3x3 convs on image q and k.
        layers (`tuple[str, ...]`): the resolved layer spec, module names like `blocks.3.attn`.
        joint_mode (`"ttt" | "hybrid"`, *optional*, defaults to `"ttt"`): how converted joint modules
            attend: T5 over all tokens (the paper), or exact softmax wherever text takes part and T5
            between image tokens (`t5core.hybrid`). Image-only `attn2` modules are T5 either way.
        merge (`"cumulant" | "learned"`, *optional*, defaults to `"cumulant"`): with `hybrid`, the
            image log-partition estimate that weighs text against image: the cumulant estimate, or
            it plus a learned per-head correction (`merge_bias`).
        neighborhood (`int`, *optional*, defaults to 0): 0, or the odd window side k of exact
            softmax over each image query's k x k neighbourhood, blended 50/50 with the T5 output on
            image rows (`t5core.neighborhood`; the paper's DiT code uses 5).
    """

    variant: Variant = "swiglu"
    key_norm_eps: float | None = 1.0
    locality: bool = True
    layers: tuple[str, ...] = field(default_factory=tuple)
    joint_mode: JointMode = "ttt"
    merge: Merge = "cumulant"
    neighborhood: int = 0

    def __post_init__(self) -> None:
        check_variant(self.variant)
        if self.key_norm_eps is not None and not self.key_norm_eps > 0:
            raise ValueError(f"key_norm_eps must be positive or None; got {self.key_norm_eps}.")
        if self.joint_mode not in JOINT_MODES:
            raise ValueError(f"joint_mode must be one of {JOINT_MODES}; got {self.joint_mode!r}.")
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}; got {self.merge!r}.")
        check_neighborhood(self.neighborhood)
        object.__setattr__(self, "layers", tuple(self.layers))

    def settings(self) -> dict[str, Any]:
        """The settings beside the layers, by name (`T5_SETTINGS`): what a fresh conversion is asked for."""
        return {name: getattr(self, name) for name in T5_SETTINGS}

    def exact_text(self, layer: str) -> bool:
        """Whether the converted module `layer` (`blocks.3.attn`) keeps exact softmax for text."""
        return self.joint_mode == "hybrid" and layer.endswith(".attn")

    def to_metadata(self) -> dict[str, str]:
        metadata = {
            "t5.variant": self.variant,
            "t5.key_norm_eps": "none" if self.key_norm_eps is None else repr(float(self.key_norm_eps)),
            "t5.locality": "true" if self.locality else "false",
            "t5.layers": ",".join(self.layers),
        }
        if self.joint_mode != "ttt":
            metadata.update({"t5.joint_mode": self.joint_mode, "t5.merge": self.merge})
        if self.neighborhood:
            metadata["t5.neighborhood"] = str(self.neighborhood)
        return metadata

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> T5Config:
        eps = metadata["t5.key_norm_eps"]
        locality = metadata["t5.locality"]
        if locality not in ("true", "false"):
            raise ValueError(f"t5.locality must be 'true' or 'false'; got {locality!r}.")
        layers = tuple(name for name in metadata["t5.layers"].split(",") if name)
        return cls(
            variant=metadata["t5.variant"],
            key_norm_eps=None if eps == "none" else float(eps),
            locality=locality == "true",
            layers=layers,
            # absent in files written before the hybrid mode existed: T5 over all tokens
            joint_mode=metadata.get("t5.joint_mode", "ttt"),
            merge=metadata.get("t5.merge", "cumulant"),
            # absent in files written before the neighbourhood blend existed: none
            neighborhood=int(metadata.get("t5.neighborhood", "0")),
        )


T5_SETTINGS: tuple[str, ...] = tuple(item.name for item in fields(T5Config) if item.name != "layers")
"""The names of `T5Config`'s settings beside its layers (variant, key norm, locality, joint mode, merge,
neighbourhood): hosts, the trainer's model section and what it records derive theirs from this."""

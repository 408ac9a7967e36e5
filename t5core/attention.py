"""`T5Attention`: the T5 layer that replaces softmax attention inside a host's attention module.

The host computes q, k, v with its inherited projections and q/k norms, calls this module, and
applies its inherited output projection to the result (docs/method.md, "Per converted attention
module"; the module's contract: docs/api.md, "Library API").

Every parameter lives in a leaf module (no children): the fast weights and the learned merge bias in
`fast` (`FastWeights`), the locality convs in `q_conv` / `k_conv`. ComfyUI's partial (low-VRAM) and
Dynamic VRAM loads move and account for leaf modules only; a parameter held beside child modules
would be left on the offload device and copied on every call. The weights file keeps its own names
(`w1`, not `fast.w1`): `file_name` / `param_name` translate, `T5Attention.file_state` and
`load_file_state` read and write in the file's names.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from t5core.backend import attend, resolve_backend
from t5core.config import T5Config
from t5core.contract import T5Layout, Variant, check_call, fast_weight_names
from t5core.hybrid import MERGES, Merge, hybrid_attention
from t5core.neighborhood import NEIGHBORHOOD_BLEND, check_neighborhood, neighborhood_attention
from t5core.ttt import split_image
from t5core.ttt_chunked import chunked_hybrid_attention, records_autograd

__all__ = ["FastWeights", "T5Attention", "file_name", "param_name"]

FAST_WEIGHT_INIT_STD = 0.02
FAST = "fast"
"""The attribute of `T5Attention` holding its `FastWeights`."""


def file_name(name: str) -> str:
    """The weights-file name of a `T5Attention` parameter: `fast.w1` -> `w1`; `q_conv.weight` stays."""
    return name.removeprefix(FAST + ".")


def param_name(name: str) -> str:
    """The `T5Attention` parameter of a weights-file name: `w1` -> `fast.w1`; `q_conv.weight` stays.

    The file's names without a dot (`w1`, `w2`, `w3`, `merge_bias`) are the `FastWeights` ones."""
    return name if "." in name else f"{FAST}.{name}"


class FastWeights(nn.Module):
    """The parameters of a `T5Attention` outside its convs, in a leaf module so that hosts that load
    module by module (ComfyUI) move them: the initial fast weights `w1`, `w2` (, `w3`), each (H, D, D),
    and with the learned merge `merge_bias` (H,). Created empty; `T5Attention.reset_parameters` fills them.
    """

    def __init__(self, heads: int, head_dim: int, names: tuple[str, ...], *, merge_bias: bool = False) -> None:
        super().__init__()
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.empty(heads, head_dim, head_dim)))
        self.merge_bias = nn.Parameter(torch.empty(heads)) if merge_bias else None


class T5Attention(nn.Module):
    """Linear-time test-time-training attention with learnable initial fast weights.

    Parameters:
        heads (`int`): attention heads H.
        head_dim (`int`): channels per head D.
        variant (`"swiglu" | "mlp"`, *optional*, defaults to `"swiglu"`): the inner model.
        key_norm_eps (`float`, *optional*, defaults to 1.0): key instance-norm eps; None disables it.
        locality (`bool`, *optional*, defaults to True): residual depthwise 3x3 convs on image q, k.
        backend (`"auto" | "torch" | "triton"`, *optional*, defaults to `"auto"`): see `t5core.backend`.
        exact_text (`bool`, *optional*, defaults to False): joint attention with exact softmax
            wherever text takes part and T5 between image tokens (`t5core.hybrid`); calls without
            text tokens are T5 attention either way.
        merge (`"cumulant" | "learned"`, *optional*, defaults to `"cumulant"`): with `exact_text`,
            the image log-partition estimate; `"learned"` adds the parameter `merge_bias`.
        neighborhood (`int`, *optional*, defaults to 0): 0, or the odd window side k: image rows
            become 0.5 T5 + 0.5 softmax over each image query's k x k neighbourhood of image keys
            (`t5core.neighborhood`, on the call's q, k, v; with `exact_text`, the image part of the
            merge). No parameter; every backend runs it as torch attention.

    Parameters, by their weights-file names: `w1`, `w2`, `w3` (swiglu only), each (H, D, D);
    `q_conv.weight`, `k_conv.weight` (H*D, 1, 3, 3) and their biases (H*D,); `merge_bias` (H,)
    with `exact_text` and `merge="learned"`. The module holds the first and the last in its leaf
    `fast` (`fast.w1`, `fast.merge_bias`: see the module docstring); `file_state` uses the file's names.
    """

    def __init__(
        self,
        heads: int,
        head_dim: int,
        variant: Variant = "swiglu",
        key_norm_eps: float | None = 1.0,
        locality: bool = True,
        *,
        backend: str = "auto",
        exact_text: bool = False,
        merge: Merge = "cumulant",
        neighborhood: int = 0,
    ) -> None:
        super().__init__()
        names = fast_weight_names(variant)
        if heads < 1 or head_dim < 1:
            raise ValueError(f"heads and head_dim must be positive; got heads={heads}, head_dim={head_dim}.")
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}; got {merge!r}.")
        check_neighborhood(neighborhood)
        self.heads, self.head_dim = heads, head_dim
        self.variant, self.key_norm_eps, self.locality, self.backend = variant, key_norm_eps, locality, backend
        self.exact_text, self.merge, self.neighborhood = exact_text, merge, neighborhood
        self.fast = FastWeights(heads, head_dim, names, merge_bias=exact_text and merge == "learned")
        channels = heads * head_dim
        if locality:
            self.q_conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
            self.k_conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.reset_parameters()

    @classmethod
    def from_config(
        cls, config: T5Config, heads: int, head_dim: int, *, layer: str, backend: str = "auto"
    ) -> T5Attention:
        """The module `config` describes for the converted module `layer` (`blocks.3.attn`)."""
        return cls(
            heads,
            head_dim,
            config.variant,
            config.key_norm_eps,
            config.locality,
            backend=backend,
            exact_text=config.exact_text(layer),
            merge=config.merge,
            neighborhood=config.neighborhood,
        )

    def reset_parameters(self) -> None:
        """Fast weights ~ trunc-normal(std 0.02, cut at +-2 like the paper's code, so in effect a
        normal); the convs keep PyTorch's default Conv2d init (not zero, as in the paper's code)."""
        for weight in self.fast_weights():
            nn.init.trunc_normal_(weight, std=FAST_WEIGHT_INIT_STD)
        if self.locality:
            self.q_conv.reset_parameters()
            self.k_conv.reset_parameters()
        if self.merge_bias is not None:
            nn.init.zeros_(self.merge_bias)

    def fast_weights(self) -> tuple[Tensor, ...]:
        """`(w1, w2, w3)` (swiglu) or `(w1, w2)` (mlp)."""
        return tuple(getattr(self.fast, name) for name in fast_weight_names(self.variant))

    @property
    def merge_bias(self) -> nn.Parameter | None:
        """The learned merge's per-head bias (H,), or None (no `exact_text`, or the cumulant merge)."""
        return self.fast.merge_bias

    def file_state(self) -> dict[str, Tensor]:
        """The module's tensors by weights-file name (`w1`, `q_conv.weight`, ...): `state_dict` renamed."""
        return {file_name(name): tensor for name, tensor in self.state_dict().items()}

    def load_file_state(self, state: Mapping[str, Tensor]) -> None:
        """Copy tensors named as in a weights file (`w1`, `q_conv.weight`, ...) into the module.

        Raises:
            RuntimeError: a name missing or unexpected, or a shape that differs (`load_state_dict`, strict).
        """
        self.load_state_dict({param_name(name): tensor for name, tensor in state.items()}, strict=True)

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, head_dim={self.head_dim}, variant={self.variant!r}, "
            f"key_norm_eps={self.key_norm_eps}, locality={self.locality}, backend={self.backend!r}"
            + (f", exact_text=True, merge={self.merge!r}" if self.exact_text else "")
            + (f", neighborhood={self.neighborhood}" if self.neighborhood else "")
        )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        grid: tuple[int, int] | None = None,
        text_tokens: int = 0,
        text_first: bool = True,
    ) -> Tensor:
        """Attend.

        Args:
            q, k, v (`Tensor`): `(B, N, H, D)` in any float dtype; N = h*w image tokens + text. Mixed
                dtypes (bf16 autocast with fp32 q/k norms gives fp32 queries and keys beside bf16
                values) attend in the widest of them.
            grid (`tuple[int, int]`, *optional*): image token grid `(h, w)`; required with locality.
            text_tokens (`int`, *optional*, defaults to 0): text tokens in the sequence.
            text_first (`bool`, *optional*, defaults to True): text before (ComfyUI) or after
                (diffusers) the image tokens.

        Returns:
            `(B, N, H, D)` in the dtype of `q`. Each sample depends only on itself. With
            `exact_text`, the text rows are softmax attention over all tokens; with `neighborhood`,
            the image rows' T5 output is blended with neighbourhood softmax.
        """
        if q.shape[-2:] != (self.heads, self.head_dim):
            raise ValueError(
                f"T5Attention was built for {self.heads} heads x {self.head_dim}; got q with "
                f"(H, D) = {tuple(q.shape[-2:])}."
            )
        out_dtype = q.dtype
        common = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = (x.to(common) for x in (q, k, v))
        params, layout = check_call(
            q,
            k,
            v,
            weights=self.fast_weights(),
            variant=self.variant,
            q_conv=(self.q_conv.weight, self.q_conv.bias) if self.locality else None,
            k_conv=(self.k_conv.weight, self.k_conv.bias) if self.locality else None,
            grid=grid,
            text_tokens=text_tokens,
            text_first=text_first,
            key_norm_eps=self.key_norm_eps,
        )

        def t5_attention(q: Tensor, k: Tensor, v: Tensor, layout: T5Layout) -> Tensor:
            out = attend(self.backend, q, k, v, params, layout)
            return out if not self.neighborhood else self._blend_neighborhood(out, q, k, v, layout)

        if not self.exact_text:
            out = t5_attention(q, k, v, layout)
        elif layout.text_tokens and self._merges_in_chunks(q, k, v):
            out = chunked_hybrid_attention(q, k, v, params, layout, merge_bias=self.merge_bias)
        else:
            out = hybrid_attention(q, k, v, layout, t5_attention, merge_bias=self.merge_bias)
        return out.to(out_dtype)

    def _merges_in_chunks(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether a hybrid call runs as one chunked pass (`t5core.ttt_chunked.chunked_hybrid_attention`):
        the torch path with nothing to differentiate and no neighbourhood blend. Otherwise its image
        part is a T5 call of its own (autograd, the kernels, the blend) and the merge follows it."""
        if self.neighborhood:
            return False
        if records_autograd(q, k, v, *self.parameters()):
            return False
        return resolve_backend(self.backend, q, variant=self.variant) == "torch"

    def _blend_neighborhood(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, layout: T5Layout) -> Tensor:
        """`out` with its image rows replaced, in place, by (1 - b) out + b neighbourhood softmax (b = 0.5);
        `out` is this call's own output, so the blend needs no copy of the sequence."""
        if layout.grid is None:
            raise ValueError("neighborhood attention needs grid=(h, w) for the image tokens.")
        text, first = layout.text_tokens, layout.text_first
        (q_img, _), (k_img, _), (v_img, _) = (split_image(x, text, first) for x in (q, k, v))
        local = neighborhood_attention(q_img, k_img, v_img, layout.grid, self.neighborhood)
        split_image(out, text, first)[0].lerp_(local, NEIGHBORHOOD_BLEND)
        return out

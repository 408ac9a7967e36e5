"""What runs inside a converted ComfyUI MMDiT on each call.

`Schedule` (the `APPLY_MODEL` wrapper) puts the latent token grid, the blocks of the model actually
running and whether this call runs T5 (its place in the sampling schedule) into
`transformer_options[KEY]`; `JointForward` (the object patch of a
`JointBlock.forward`) runs the block's own pre- and post-attention around T5 attention, looking its
block up there per call. `T5Modules` holds the T5 modules in the file's layout for the patcher that
ComfyUI loads and offloads. `t5core.hosts.comfy` installs them.

ComfyUI puts the text tokens first: the joint attention sees [text (T), image (h x w, row-major)].
`pre_attention` returns q and k as (B, N, H*D) and v as (B, N, H, D).

ComfyUI is imported inside the functions that need it, so importing this module works without it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from t5core.attention import T5Attention

__all__ = ["COPY_LOG", "KEY", "CallContext", "JointForward", "Schedule", "T5Modules"]

logger = logging.getLogger(__name__)

KEY = "t5_linearize"
"""The one key the ComfyUI host uses: APPLY_MODEL wrapper, additional model and `transformer_options` entry."""


class T5Modules(nn.Module):
    """The converted modules, laid out as `blocks.{i}.attn` / `blocks.{i}.attn2` (the file's names), and
    the conversion's summary (`t5core.hosts.comfy.summary`)."""

    def __init__(self, modules: Mapping[str, T5Attention], summary: str = "") -> None:
        super().__init__()
        self.summary = summary
        self.blocks = nn.ModuleDict()
        for name, module in modules.items():
            _, index, kind = name.split(".")
            if index not in self.blocks:
                self.blocks[index] = nn.ModuleDict()
            self.blocks[index][kind] = module

    def get(self, index: int, kind: str) -> T5Attention | None:
        block = self.blocks[str(index)] if str(index) in self.blocks else None
        return block[kind] if block is not None and kind in block else None

    def layers(self) -> tuple[str, ...]:
        return tuple(f"blocks.{index}.{kind}" for index, block in self.blocks.items() for kind in block)


COPY_LOG = "copying them to"
"""The phrase of the log lines that report T5 parameters copied per call (checked by benchmarks)."""


@functools.cache
def _log_copy(layer: str, names: str, away: str, device: str) -> None:
    """Logged once per layer, parameters and pair of devices (`functools.cache`)."""
    logger.info(
        "T5 Linearize: ComfyUI left %s of %s on %s (low-VRAM load); %s %s per call",
        names,
        layer,
        away,
        COPY_LOG,
        device,
    )


def _run_t5(
    module: T5Attention, q: Tensor, k: Tensor, v: Tensor, *, layer: str, grid: tuple[int, int], text_tokens: int
) -> Tensor:
    """Call a T5 module on q's device. ComfyUI's partial (low-VRAM, `--novram`) load moves the leaf
    modules that fit its budget and leaves the rest on the offload device; those parameters are copied
    for this call, as ComfyUI casts its own layers. That is logged at INFO once per layer (with the
    parameter names) and at DEBUG per call; a load that moved every T5 module never takes this path."""
    params = dict(module.named_parameters())
    behind = sorted(name for name, p in params.items() if p.device != q.device)
    if not behind:
        return module(q, k, v, grid=grid, text_tokens=text_tokens, text_first=True)
    away = ", ".join(sorted({str(params[name].device) for name in behind}))
    _log_copy(layer, ", ".join(behind), away, str(q.device))
    logger.debug("T5 Linearize: %s: copied %d parameters to %s for this call", layer, len(behind), q.device)
    moved = {name: p.to(q.device, non_blocking=True) for name, p in params.items()}
    kwargs = {"grid": grid, "text_tokens": text_tokens, "text_first": True}
    return torch.func.functional_call(module, moved, (q, k, v), kwargs)


@dataclass(frozen=True)
class CallContext:
    """What one model call tells the T5 patches, under `transformer_options[KEY]`.

    Attributes:
        grid: the latent token grid `(ceil(H / p), ceil(W / p))` of this call (the latent may be an
            area crop, so it is read per call).
        blocks: the `joint_blocks` of the diffusion model running this call. ComfyUI 0.33 can run a
            clone on a re-created model (`clone(disable_dynamic=True)`, hooks, torch.compile), whose
            object patches are this clone's: the patches look their block up here, never keep one.
        t5: whether this call runs T5 attention (inside the `Schedule`); softmax otherwise.
    """

    grid: tuple[int, int]
    blocks: nn.ModuleList
    t5: bool = True


@dataclass(frozen=True)
class Schedule:
    """When T5 attention runs, as a fraction of sampling in ComfyUI's convention (its ControlNet and hook
    nodes): `percent_to_sigma` of the model's sampling turns each percent into a noise level, and T5
    runs on the calls whose noise level lies between those of `start_percent` and `end_percent`;
    the converted modules run ComfyUI's softmax attention on the others.

    An instance is the host's `APPLY_MODEL` wrapper: it puts this call's `CallContext` into a copy of
    `transformer_options`.

    Raises:
        ValueError: a percent outside [0, 1], or `start_percent` after `end_percent`.
    """

    start_percent: float = 0.0
    end_percent: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_percent <= self.end_percent <= 1.0:
            order = "is after" if self.start_percent > self.end_percent else "and"
            raise ValueError(
                f"start_percent {self.start_percent} {order} end_percent {self.end_percent}: they must satisfy "
                "0 <= start_percent <= end_percent <= 1 (T5 runs between them, softmax outside)."
            )

    @property
    def whole(self) -> bool:
        """T5 on every call."""
        return self.start_percent <= 0.0 and self.end_percent >= 1.0

    def describe(self) -> str:
        """ "every step", or "from 20% to 100% of sampling (softmax outside)"."""
        if self.whole:
            return "every step"
        return f"from {self.start_percent:.0%} to {self.end_percent:.0%} of sampling (softmax outside)"

    def runs_t5(self, model_sampling, sigma: float) -> bool:
        """Whether a call at noise level `sigma` runs T5 attention (`model_sampling` is the model's)."""
        if self.whole:
            return True
        low, high = (model_sampling.percent_to_sigma(p) for p in (self.end_percent, self.start_percent))
        return low <= sigma <= high

    def __call__(self, executor, x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        """`APPLY_MODEL` wrapper; `t` is the call's sigma (one per sample; the first decides, as for
        ComfyUI's ControlNet)."""
        model = executor.class_obj
        diffusion = model.diffusion_model
        patch_h, patch_w = diffusion.x_embedder.patch_size
        height, width = x.shape[-2:]
        t5 = self.runs_t5(model.model_sampling, float(t.reshape(-1)[0]))
        context = CallContext((math.ceil(height / patch_h), math.ceil(width / patch_w)), diffusion.joint_blocks, t5)
        options = {**transformer_options, KEY: context}
        return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)


class JointForward:
    """Replacement for `joint_blocks[index].forward`: the block's own pre/post-attention around T5 attention.

    A plain callable, not an `nn.Module` (an object patch holding a Module would register it as a
    child named `forward` instead of calling it). It holds no block: each call takes block `index`
    of the running model from its `CallContext` (so a `Schedule` must be registered as the
    `APPLY_MODEL` wrapper too). With `attn` / `attn2` None, or on a call outside the schedule, that
    attention stays ComfyUI's `optimized_attention`, so `JointForward(index)` reproduces the stock block
    exactly.

    Args:
        index: the block's position in `joint_blocks`.
        attn (`T5Attention`, *optional*): replaces the joint attention over [text, image].
        attn2 (`T5Attention`, *optional*): replaces the image-only `attn2` (MMDiT-X blocks).
    """

    def __init__(self, index: int, attn: T5Attention | None = None, attn2: T5Attention | None = None) -> None:
        from comfy.ldm.modules.diffusionmodules import mmdit

        self.index, self.attn, self.attn2 = index, attn, attn2
        self._mmdit = mmdit

    @classmethod
    def of(cls, modules: T5Modules, index: int) -> JointForward | None:
        """The patch of block `index` running its modules in `modules`; None for a block without one."""
        attn, attn2 = modules.get(index, "attn"), modules.get(index, "attn2")
        return cls(index, attn, attn2) if attn is not None or attn2 is not None else None

    def __call__(
        self,
        context: Tensor,
        x: Tensor,
        c: Tensor | None = None,
        use_checkpoint: bool = True,
        transformer_options: dict | None = None,
    ) -> tuple[Tensor | None, Tensor]:
        options = {} if transformer_options is None else transformer_options
        call = options.get(KEY)
        if not isinstance(call, CallContext):
            raise RuntimeError(
                "T5 attention needs the latent grid and the running model's blocks, which the T5 Linearize "
                f"APPLY_MODEL wrapper puts into transformer_options[{KEY!r}]; this call did not pass through "
                "BaseModel.apply_model. Run the model through a ComfyUI sampler (or BaseModel.apply_model)."
            )
        block = call.blocks[self.index]
        if self.attn2 is not None and not block.x_block.x_block_self_attn:
            raise ValueError(f"block {self.index} has no image-only attention (attn2) for the T5 module given.")
        modules = (self.attn, self.attn2) if call.t5 else (None, None)
        if use_checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                self._mix, block, modules, context, x, c, options, call.grid, use_reentrant=False
            )
        return self._mix(block, modules, context, x, c, options, call.grid)

    def _attend(
        self,
        module: T5Attention | None,
        qkv: tuple[Tensor, ...],
        *,
        layer: str,
        heads: int,
        text_tokens: int,
        options: dict,
        grid: tuple[int, int],
    ) -> Tensor:
        q, k, v = qkv
        if module is None:
            return self._mmdit.optimized_attention(q, k, v, heads=heads, transformer_options=options)
        b, n = q.shape[:2]
        shape = (b, n, heads, q.shape[-1] // heads)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        out = _run_t5(module, q, k, v, layer=layer, grid=grid, text_tokens=text_tokens)
        return out.reshape(b, n, -1)

    def _mix(
        self,
        block: nn.Module,
        modules: tuple[T5Attention | None, T5Attention | None],
        context: Tensor,
        x: Tensor,
        c: Tensor | None,
        options: dict,
        grid: tuple[int, int],
    ) -> tuple[Tensor | None, Tensor]:
        attn_module, attn2_module = modules
        context_block, x_block = block.context_block, block.x_block
        context_qkv, context_rest = context_block.pre_attention(context, c)
        if x_block.x_block_self_attn:
            x_qkv, x_qkv2, x_rest = x_block.pre_attention_x(x, c)
        else:
            x_qkv, x_rest = x_block.pre_attention(x, c)
        text_tokens = context_qkv[0].shape[1]
        joint = tuple(torch.cat((text, image), dim=1) for text, image in zip(context_qkv, x_qkv, strict=True))
        heads = x_block.attn.num_heads
        attn = self._attend(
            attn_module,
            joint,
            layer=f"blocks.{self.index}.attn",
            heads=heads,
            text_tokens=text_tokens,
            options=options,
            grid=grid,
        )
        context_attn, x_attn = attn[:, :text_tokens], attn[:, text_tokens:]
        context = None if context_block.pre_only else context_block.post_attention(context_attn, *context_rest)
        if x_block.x_block_self_attn:
            heads2 = x_block.attn2.num_heads
            attn2 = self._attend(
                attn2_module,
                x_qkv2,
                layer=f"blocks.{self.index}.attn2",
                heads=heads2,
                text_tokens=0,
                options=options,
                grid=grid,
            )
            return context, x_block.post_attention_x(x_attn, attn2, *x_rest)
        return context, x_block.post_attention(x_attn, *x_rest)

"""ComfyUI host: run T5 attention inside a ComfyUI SD3 / SD3.5 model (MMDiT), reversibly.

`linearize(model_patcher, weights)` never touches the model it is given. It returns a clone of the
`ModelPatcher` on which, for every block with a converted attention, `JointBlock.forward` is replaced
by an object patch (`JointForward`) that runs the block's own pre- and post-attention around T5
attention; an `APPLY_MODEL` wrapper puts the latent token grid into `transformer_options["t5_linearize"]`;
the T5 modules live in their own `ModelPatcher`, registered as an additional model, so ComfyUI moves
and offloads them with the diffusion model; and the file's `base.*` tensors become `("set", ...)`
weight patches. Dropping the clone (or bypassing the node) gives the original model back exactly.

ComfyUI puts the text tokens first: the joint attention sees [text (T), image (h x w, row-major)].
`pre_attention` returns q and k as (B, N, H*D) and v as (B, N, H, D).

ComfyUI is imported inside the functions that need it, so `import t5core.hosts.comfy` works without it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from t5core.attention import T5Attention
from t5core.config import BaseArch
from t5core.layers import LayerSpec
from t5core.weights import T5Weights, T5WeightsError, build_modules, check_compatible, load

__all__ = ["KEY", "JointForward", "T5Modules", "arch_of", "converted_layers", "linearize"]

logger = logging.getLogger(__name__)

KEY = "t5_linearize"
"""The one key this host uses: APPLY_MODEL wrapper, additional model and `transformer_options` entry."""


def _mmdit_class() -> type[nn.Module]:
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    return MMDiT


def _describe_model(model_patcher: Any) -> str:
    model = getattr(model_patcher, "model", None)
    config = getattr(model, "model_config", None)
    family = type(config).__name__ if config is not None else type(model).__name__
    diffusion = getattr(model, "diffusion_model", None)
    return f"{family} (diffusion model {type(diffusion).__name__})"


def _diffusion_model(model_patcher: Any) -> nn.Module:
    """The MMDiT of an SD3-family ModelPatcher; TypeError naming the model otherwise."""
    get = getattr(model_patcher, "get_model_object", None)
    if get is None:
        raise TypeError(f"expected a ComfyUI MODEL (a ModelPatcher); got {type(model_patcher).__name__}.")
    try:
        diffusion = get("diffusion_model")
    except AttributeError:
        diffusion = None
    if not isinstance(diffusion, _mmdit_class()) or not hasattr(diffusion, "joint_blocks"):
        raise TypeError(
            f"T5 Linearize converts SD3 / SD3.5 models (MMDiT), but this MODEL is {_describe_model(model_patcher)}. "
            "Connect the MODEL output of an SD3 Medium, SD3.5 Medium or SD3.5 Large loader."
        )
    return diffusion


def arch_of(diffusion_model: nn.Module) -> BaseArch:
    """The `BaseArch` of a ComfyUI MMDiT (`model.diffusion_model`)."""
    blocks = diffusion_model.joint_blocks
    attention = blocks[0].x_block.attn
    return BaseArch(
        depth=len(blocks),
        heads=attention.num_heads,
        head_dim=attention.head_dim,
        dual_attention_layers=tuple(i for i, block in enumerate(blocks) if block.x_block.x_block_self_attn),
        qk_norm=not isinstance(attention.ln_q, nn.Identity),
    )


class T5Modules(nn.Module):
    """The converted modules, laid out as `blocks.{i}.attn` / `blocks.{i}.attn2` (the file's names)."""

    def __init__(self, modules: Mapping[str, T5Attention]) -> None:
        super().__init__()
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


def _run_t5(module: T5Attention, q: Tensor, k: Tensor, v: Tensor, *, grid: tuple[int, int], text_tokens: int) -> Tensor:
    """Call a T5 module on q's device. ComfyUI's partial (low-VRAM) load can leave some of its
    parameters on the offload device; those are copied for this call, as ComfyUI casts its own layers."""
    params = dict(module.named_parameters())
    if all(p.device == q.device for p in params.values()):
        return module(q, k, v, grid=grid, text_tokens=text_tokens, text_first=True)
    moved = {name: p.to(q.device, non_blocking=True) for name, p in params.items()}
    kwargs = {"grid": grid, "text_tokens": text_tokens, "text_first": True}
    return torch.func.functional_call(module, moved, (q, k, v), kwargs)


class JointForward:
    """Replacement for one `JointBlock.forward`: the block's own pre/post-attention around T5 attention.

    A plain callable, not an `nn.Module` (an object patch holding a Module would register it as a
    child named `forward` instead of calling it). With `attn` / `attn2` None that attention stays
    ComfyUI's `optimized_attention`, so `JointForward(block)` reproduces the stock block exactly.

    Args:
        block: the `JointBlock` (`context_block`, `x_block`).
        attn (`T5Attention`, *optional*): replaces the joint attention over [text, image].
        attn2 (`T5Attention`, *optional*): replaces the image-only `attn2` (MMDiT-X blocks).
    """

    def __init__(self, block: nn.Module, attn: T5Attention | None = None, attn2: T5Attention | None = None) -> None:
        from comfy.ldm.modules.diffusionmodules import mmdit

        if attn2 is not None and not block.x_block.x_block_self_attn:
            raise ValueError("attn2 was given for a block without an image-only attention (attn2).")
        self.block, self.attn, self.attn2 = block, attn, attn2
        self._mmdit = mmdit

    def __call__(
        self,
        context: Tensor,
        x: Tensor,
        c: Tensor | None = None,
        use_checkpoint: bool = True,
        transformer_options: dict | None = None,
    ) -> tuple[Tensor | None, Tensor]:
        options = {} if transformer_options is None else transformer_options
        if use_checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._mix, context, x, c, options, use_reentrant=False)
        return self._mix(context, x, c, options)

    def _attend(
        self, module: T5Attention | None, qkv: tuple[Tensor, ...], *, heads: int, text_tokens: int, options: dict
    ) -> Tensor:
        q, k, v = qkv
        if module is None:
            return self._mmdit.optimized_attention(q, k, v, heads=heads, transformer_options=options)
        grid = options.get(KEY)
        if grid is None:
            raise RuntimeError(
                "T5 attention needs the latent grid, which the T5 Linearize APPLY_MODEL wrapper puts into "
                f"transformer_options[{KEY!r}]; this call did not pass through BaseModel.apply_model. "
                "Run the model through a ComfyUI sampler (or BaseModel.apply_model)."
            )
        b, n = q.shape[:2]
        shape = (b, n, heads, q.shape[-1] // heads)
        out = _run_t5(module, q.reshape(shape), k.reshape(shape), v.reshape(shape), grid=grid, text_tokens=text_tokens)
        return out.reshape(b, n, -1)

    def _mix(self, context: Tensor, x: Tensor, c: Tensor | None, options: dict) -> tuple[Tensor | None, Tensor]:
        context_block, x_block = self.block.context_block, self.block.x_block
        context_qkv, context_rest = context_block.pre_attention(context, c)
        if x_block.x_block_self_attn:
            x_qkv, x_qkv2, x_rest = x_block.pre_attention_x(x, c)
        else:
            x_qkv, x_rest = x_block.pre_attention(x, c)
        text_tokens = context_qkv[0].shape[1]
        joint = tuple(torch.cat((text, image), dim=1) for text, image in zip(context_qkv, x_qkv, strict=True))
        attn = self._attend(self.attn, joint, heads=x_block.attn.num_heads, text_tokens=text_tokens, options=options)
        context_attn, x_attn = attn[:, :text_tokens], attn[:, text_tokens:]
        context = None if context_block.pre_only else context_block.post_attention(context_attn, *context_rest)
        if x_block.x_block_self_attn:
            attn2 = self._attend(self.attn2, x_qkv2, heads=x_block.attn2.num_heads, text_tokens=0, options=options)
            return context, x_block.post_attention_x(x_attn, attn2, *x_rest)
        return context, x_block.post_attention(x_attn, *x_rest)


class _GridWrapper:
    """APPLY_MODEL wrapper: puts the token grid `(ceil(H / p), ceil(W / p))` of this call's latent
    into a copy of `transformer_options` (the latent may be an area crop, so it is read per call)."""

    def __init__(self, patch_size: tuple[int, int]) -> None:
        self.patch_size = patch_size

    def __call__(self, executor, x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        height, width = x.shape[-2:]
        grid = (math.ceil(height / self.patch_size[0]), math.ceil(width / self.patch_size[1]))
        options = {**transformer_options, KEY: grid}
        return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)


def converted_layers(model_patcher: Any) -> tuple[str, ...]:
    """The layers a `linearize`d ModelPatcher runs as T5 attention; () for any other model."""
    additional = getattr(model_patcher, "additional_models", {}).get(KEY, [])
    return additional[0].model.layers() if additional else ()


def _base_patches(weights: T5Weights, model_patcher: Any) -> dict[str, tuple]:
    """The file's `base.*` tensors as `("set", ...)` weight patches, checked against the model."""
    if not weights.base:
        return {}
    state = model_patcher.model_state_dict(filter_prefix="diffusion_model.")
    patches: dict[str, tuple] = {}
    for key, tensor in weights.base.items():
        target = state.get(f"diffusion_model.{key}")
        if target is None:
            raise T5WeightsError(
                f"{weights.name}: base tensor {key!r} is not a weight of this model. "
                "The file was made for another model variant; use a T5 weights file trained for this model."
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise T5WeightsError(
                f"{weights.name}: base tensor {key!r} is {tuple(tensor.shape)}, the model's is {tuple(target.shape)}. "
                "Use a T5 weights file trained for this model."
            )
        patches[f"diffusion_model.{key}"] = ("set", (tensor,))
    return patches


def linearize(
    model_patcher: Any,
    weights: T5Weights | str | os.PathLike[str],
    layers: LayerSpec | None = None,
    *,
    backend: str = "auto",
) -> Any:
    """Convert a ComfyUI SD3-family model to T5 attention, on a clone.

    Args:
        model_patcher (`comfy.model_patcher.ModelPatcher`): an SD3 / SD3.5 MODEL; left unchanged.
        weights (`T5Weights | str | PathLike`): a loaded T5 weights file, or its path.
        layers (`str | Sequence[str]`, *optional*): restricts the conversion to a subset of the
            file's layers (a layer spec, see `t5core.layers`); None converts all of them.
        backend (`"auto" | "torch" | "triton"`, *optional*, defaults to `"auto"`): T5 attention backend.

    Returns:
        A patched clone of `model_patcher`.

    Raises:
        TypeError: the MODEL is not an SD3-family MMDiT (the message names the model).
        ValueError: the MODEL is already converted by T5 Linearize, or `layers` selects nothing.
        T5WeightsError: the file is for another architecture, cannot serve `layers`, or has `base.*`
            tensors that do not fit the model.
        FileNotFoundError: `weights` is a path that does not exist.
    """
    import comfy.model_management
    import comfy.model_patcher
    import comfy.patcher_extension

    diffusion = _diffusion_model(model_patcher)
    if converted_layers(model_patcher):
        raise ValueError(
            f"this MODEL already runs T5 attention on {', '.join(converted_layers(model_patcher))}. "
            "Use one T5 Linearize node per model: connect it to the model before the first T5 Linearize."
        )
    weights = weights if isinstance(weights, T5Weights) else load(weights)
    arch = arch_of(diffusion)
    chosen = check_compatible(weights, arch, layers)
    if not chosen:
        raise ValueError(
            f"layers {layers!r} selects no attention module; to run the model unchanged, turn T5 Linearize off."
        )
    base = _base_patches(weights, model_patcher)
    modules = T5Modules(build_modules(weights, chosen, backend=backend))
    modules.requires_grad_(False)
    t5_patcher = comfy.model_patcher.ModelPatcher(
        modules,
        load_device=comfy.model_management.get_torch_device(),
        offload_device=comfy.model_management.unet_offload_device(),
    )

    patched = model_patcher.clone()
    for index, block in enumerate(diffusion.joint_blocks):
        attn, attn2 = modules.get(index, "attn"), modules.get(index, "attn2")
        if attn is None and attn2 is None:
            continue
        name = f"diffusion_model.joint_blocks.{index}.forward"
        if name in patched.object_patches:
            logger.warning("T5 Linearize: replacing another node's patch of %s", name)
        patched.add_object_patch(name, JointForward(block, attn, attn2))
    patch_size = tuple(diffusion.x_embedder.patch_size)
    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, KEY, _GridWrapper(patch_size))
    patched.set_additional_models(KEY, [t5_patcher])
    if base:
        patched.add_patches(base, strength_patch=1.0)
    logger.info(
        "T5 Linearize: %s runs T5 attention on %d of %d attention modules (%s)%s",
        weights.name,
        len(chosen),
        len(arch.attention_modules()),
        ",".join(chosen),
        f", {len(base)} base weights patched" if base else "",
    )
    return patched

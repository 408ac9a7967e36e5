"""ComfyUI host: run T5 attention inside a ComfyUI SD3 / SD3.5 model (MMDiT), reversibly.

`linearize(model_patcher, weights)` never touches the model it is given. It returns a clone of the
`ModelPatcher` on which:

* for every block with a converted attention, `JointBlock.forward` is replaced by an object patch
  (`JointForward`) that runs the block's own pre- and post-attention around T5 attention;
* an `APPLY_MODEL` wrapper (`CallContext.wrapper`) puts the latent token grid and the blocks of the
  model actually running into `transformer_options["t5_linearize"]`, so the patch follows the model
  when ComfyUI 0.33 re-creates it (`clone(disable_dynamic=True)`, hooks, torch.compile);
* the T5 modules live in their own patcher, of the same kind as the model's (Dynamic VRAM's
  `ModelPatcherDynamic` on ComfyUI 0.33 with NVIDIA, `ModelPatcher` otherwise), registered as an
  additional model, so ComfyUI loads, moves and offloads them with the diffusion model;
* the file's `base.*` tensors become `("set", ...)` weight patches on ComfyUI's own layers (applied
  when ComfyUI loads or streams those weights), and a replaced module for the few weights that live
  in plain torch modules (the q/k RMSNorm scales), which ComfyUI's weight patches do not reach under
  Dynamic VRAM or a partial load.

Dropping the clone (or bypassing the node) gives the original model back exactly.

ComfyUI puts the text tokens first: the joint attention sees [text (T), image (h x w, row-major)].
`pre_attention` returns q and k as (B, N, H*D) and v as (B, N, H, D).

ComfyUI is imported inside the functions that need it, so `import t5core.hosts.comfy` works without it.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from t5core.attention import T5Attention
from t5core.config import BaseArch
from t5core.layers import LayerSpec
from t5core.weights import T5Weights, T5WeightsError, build_modules, check_compatible, load

__all__ = ["KEY", "CallContext", "JointForward", "T5Modules", "arch_of", "converted_layers", "linearize"]

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


_copy_logged = False


def _run_t5(module: T5Attention, q: Tensor, k: Tensor, v: Tensor, *, grid: tuple[int, int], text_tokens: int) -> Tensor:
    """Call a T5 module on q's device. ComfyUI's partial (low-VRAM, `--novram`) load can leave some of
    its parameters on the offload device; those are copied for this call, as ComfyUI casts its own
    layers, and the first such copy is logged once (a full load never takes this path)."""
    global _copy_logged
    params = dict(module.named_parameters())
    if all(p.device == q.device for p in params.values()):
        return module(q, k, v, grid=grid, text_tokens=text_tokens, text_first=True)
    if not _copy_logged:
        _copy_logged = True
        away = sorted({str(p.device) for p in params.values() if p.device != q.device})
        logger.info(
            "T5 Linearize: ComfyUI left T5 weights on %s (low-VRAM load); copying them to %s per call",
            ", ".join(away),
            q.device,
        )
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
    """

    grid: tuple[int, int]
    blocks: nn.ModuleList

    @staticmethod
    def wrapper(executor, x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        """`APPLY_MODEL` wrapper: this call's `CallContext` into a copy of `transformer_options`."""
        diffusion = executor.class_obj.diffusion_model
        patch_h, patch_w = diffusion.x_embedder.patch_size
        height, width = x.shape[-2:]
        context = CallContext((math.ceil(height / patch_h), math.ceil(width / patch_w)), diffusion.joint_blocks)
        options = {**transformer_options, KEY: context}
        return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)


class JointForward:
    """Replacement for `joint_blocks[index].forward`: the block's own pre/post-attention around T5 attention.

    A plain callable, not an `nn.Module` (an object patch holding a Module would register it as a
    child named `forward` instead of calling it). It holds no block: each call takes block `index`
    of the running model from its `CallContext` (so `CallContext.wrapper` must be registered too).
    With `attn` / `attn2` None that attention stays ComfyUI's `optimized_attention`, so
    `JointForward(index)` reproduces the stock block exactly.

    Args:
        index: the block's position in `joint_blocks`.
        attn (`T5Attention`, *optional*): replaces the joint attention over [text, image].
        attn2 (`T5Attention`, *optional*): replaces the image-only `attn2` (MMDiT-X blocks).
    """

    def __init__(self, index: int, attn: T5Attention | None = None, attn2: T5Attention | None = None) -> None:
        from comfy.ldm.modules.diffusionmodules import mmdit

        self.index, self.attn, self.attn2 = index, attn, attn2
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
        if use_checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                self._mix, block, context, x, c, options, call.grid, use_reentrant=False
            )
        return self._mix(block, context, x, c, options, call.grid)

    def _attend(
        self,
        module: T5Attention | None,
        qkv: tuple[Tensor, ...],
        *,
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
        out = _run_t5(module, q.reshape(shape), k.reshape(shape), v.reshape(shape), grid=grid, text_tokens=text_tokens)
        return out.reshape(b, n, -1)

    def _mix(
        self, block: nn.Module, context: Tensor, x: Tensor, c: Tensor | None, options: dict, grid: tuple[int, int]
    ) -> tuple[Tensor | None, Tensor]:
        context_block, x_block = block.context_block, block.x_block
        context_qkv, context_rest = context_block.pre_attention(context, c)
        if x_block.x_block_self_attn:
            x_qkv, x_qkv2, x_rest = x_block.pre_attention_x(x, c)
        else:
            x_qkv, x_rest = x_block.pre_attention(x, c)
        text_tokens = context_qkv[0].shape[1]
        joint = tuple(torch.cat((text, image), dim=1) for text, image in zip(context_qkv, x_qkv, strict=True))
        heads = x_block.attn.num_heads
        attn = self._attend(self.attn, joint, heads=heads, text_tokens=text_tokens, options=options, grid=grid)
        context_attn, x_attn = attn[:, :text_tokens], attn[:, text_tokens:]
        context = None if context_block.pre_only else context_block.post_attention(context_attn, *context_rest)
        if x_block.x_block_self_attn:
            heads2 = x_block.attn2.num_heads
            attn2 = self._attend(self.attn2, x_qkv2, heads=heads2, text_tokens=0, options=options, grid=grid)
            return context, x_block.post_attention_x(x_attn, attn2, *x_rest)
        return context, x_block.post_attention(x_attn, *x_rest)


def converted_layers(model_patcher: Any) -> tuple[str, ...]:
    """The layers a `linearize`d ModelPatcher runs as T5 attention; () for any other model."""
    additional = getattr(model_patcher, "additional_models", {}).get(KEY, [])
    return additional[0].model.layers() if additional else ()


@dataclass(frozen=True)
class _BasePlan:
    """Where the file's `base.*` tensors go: `("set", ...)` weight patches for ComfyUI's own layers
    (`comfy.ops`, patched wherever and whenever ComfyUI loads or streams them), and replacement
    modules, by path under the diffusion model, for plain torch modules such as the q/k RMSNorm,
    whose parameters ComfyUI 0.33 neither patches under Dynamic VRAM nor in a partial load."""

    weight_patches: dict[str, tuple]
    modules: dict[str, nn.Module]


def _plan_base(weights: T5Weights, model_patcher: Any, diffusion: nn.Module) -> _BasePlan:
    """Check the file's `base.*` tensors against the model and route each one (see `_BasePlan`)."""
    state = model_patcher.model_state_dict(filter_prefix="diffusion_model.")
    plan = _BasePlan({}, {})
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
        owner_name, _, attribute = key.rpartition(".")
        owner = diffusion.get_submodule(owner_name)
        if hasattr(owner, "comfy_cast_weights"):
            plan.weight_patches[f"diffusion_model.{key}"] = ("set", (tensor,))
        elif attribute in owner._parameters and not any(True for _ in owner.children()):
            replacement = plan.modules.get(owner_name) or copy.deepcopy(owner)
            setattr(replacement, attribute, nn.Parameter(tensor.to(target.dtype), requires_grad=False))
            plan.modules[owner_name] = replacement
        else:
            raise T5WeightsError(
                f"{weights.name}: base tensor {key!r} is not a trainable weight of a layer (a buffer such as the "
                "position embedding), which T5 Linearize does not replace. Export the file without it."
            )
    return plan


def _t5_patcher(model_patcher: Any, modules: T5Modules) -> Any:
    """A patcher for the T5 modules of the same kind as the model's: with Dynamic VRAM (ComfyUI 0.33 on
    NVIDIA) a plain `ModelPatcher` among the models to load makes ComfyUI fall back to estimate-based
    freeing, which unloads the dynamic diffusion model too."""
    import comfy.model_patcher

    dynamic = getattr(model_patcher, "is_dynamic", lambda: False)()
    kind = comfy.model_patcher.ModelPatcherDynamic if dynamic else comfy.model_patcher.ModelPatcher
    return kind(modules, load_device=model_patcher.load_device, offload_device=model_patcher.offload_device)


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
    base = _plan_base(weights, model_patcher, diffusion)
    modules = T5Modules(build_modules(weights, chosen, backend=backend))
    modules.requires_grad_(False)

    patched = model_patcher.clone()
    object_patches = {f"diffusion_model.{path}": module for path, module in base.modules.items()}
    for index in range(len(diffusion.joint_blocks)):
        attn, attn2 = modules.get(index, "attn"), modules.get(index, "attn2")
        if attn is not None or attn2 is not None:
            object_patches[f"diffusion_model.joint_blocks.{index}.forward"] = JointForward(index, attn, attn2)
    for name, patch in object_patches.items():
        if name in patched.object_patches:
            logger.warning("T5 Linearize: replacing another node's patch of %s", name)
        patched.add_object_patch(name, patch)
    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, KEY, CallContext.wrapper)
    patched.set_additional_models(KEY, [_t5_patcher(model_patcher, modules)])
    if base.weight_patches:
        patched.add_patches(base.weight_patches, strength_patch=1.0)
    logger.info(
        "T5 Linearize: %s runs T5 attention on %d of %d attention modules (%s)%s",
        weights.name,
        len(chosen),
        len(arch.attention_modules()),
        ",".join(chosen),
        f", {len(weights.base)} base weights patched" if weights.base else "",
    )
    return patched

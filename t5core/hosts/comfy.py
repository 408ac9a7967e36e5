"""ComfyUI host: run T5 attention inside a ComfyUI SD3 / SD3.5 model (MMDiT), reversibly.

`linearize(model_patcher, weights)` never touches the model it is given. It returns a clone of the
`ModelPatcher` on which:

* for every block with a converted attention, `JointBlock.forward` is replaced by an object patch
  (`JointForward`) that runs the block's own pre- and post-attention around T5 attention;
* an `APPLY_MODEL` wrapper (a `Schedule`) puts the latent token grid, the blocks of the model actually
  running and whether this call runs T5 (its place in sampling) into
  `transformer_options["t5_linearize"]`, so the patch follows the model when ComfyUI 0.33 re-creates
  it (`clone(disable_dynamic=True)`, hooks, torch.compile);
* the T5 modules live in their own patcher, of the same kind as the model's (Dynamic VRAM's
  `ModelPatcherDynamic` on ComfyUI 0.33 with NVIDIA, `ModelPatcher` otherwise), registered as an
  additional model, so ComfyUI loads, moves and offloads them with the diffusion model;
* the file's changes to inherited weights become weight patches on ComfyUI's own layers, applied
  when ComfyUI loads or streams those weights: a delta (format 4) as it is, a LoRA patch per part of
  a low-rank delta (on that part's rows of a fused qkv) or a `("diff", ...)` patch of a full one; a
  `base.*` tensor (formats 1 to 3) as a `("diff", ...)` patch of the fine-tuned value minus the weight
  the model stores, in fp32. Every one adds, as LoRA patches do, so a LoRA before or after the node
  gives the same model; a `("set", ...)` patch would discard a LoRA placed before it. The few weights
  that live in plain torch modules (the q/k RMSNorm scales), which ComfyUI's weight patches do not
  reach under Dynamic VRAM or a partial load, get a replaced module instead, holding the fine-tuned
  value (the stored one plus the delta); in a full load ComfyUI patches the replaced module, so a
  LoRA on such a scale adds on top of it there too.
* a file that records its base's fingerprint is compared with the model's (`t5core.convert.check_fingerprint`);
* a `layers` subset applies only the file's changes that go with the modules it converts
  (`t5core.convert.left_out_by`);
* MultiGPU CFG Split's per-device clones get T5 modules and patches of their own
  (`t5core.hosts.comfy_patcher`);
* `summary` of the clone says what was done (the node's status output).

Dropping the clone (or bypassing the node) gives the original model back exactly.

`t5core.convert.prepare` reads and checks the file; the per-call parts (`CallContext`, `JointForward`)
live in `t5core.hosts.comfy_runtime`. ComfyUI is imported inside the functions that need it, so
`import t5core.hosts.comfy` works without it.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from t5core.backend import describe_backend
from t5core.config import BaseArch
from t5core.convert import Prepared, prepare
from t5core.deltas import Delta, TensorsOnRead, fingerprint, fingerprint_keys
from t5core.hosts.comfy_patcher import PerDeviceClone, fresh_copy, t5_modules, t5_patcher
from t5core.hosts.comfy_runtime import KEY, CallContext, JointForward, Schedule, T5Modules
from t5core.layers import LayerSpec
from t5core.weights import T5Weights, T5WeightsError

__all__ = [
    "KEY",
    "CallContext",
    "JointForward",
    "Schedule",
    "T5Modules",
    "arch_of",
    "converted_layers",
    "linearize",
    "summary",
]

logger = logging.getLogger(__name__)


def _describe_model(model_patcher: Any) -> str:
    model = getattr(model_patcher, "model", None)
    config = getattr(model, "model_config", None)
    family = type(config).__name__ if config is not None else type(model).__name__
    diffusion = getattr(model, "diffusion_model", None)
    return f"{family} (diffusion model {type(diffusion).__name__})"


def _diffusion_model(model_patcher: Any) -> nn.Module:
    """The MMDiT of an SD3-family ModelPatcher; TypeError naming what it got otherwise."""
    get = getattr(model_patcher, "get_model_object", None)
    if get is None:
        raise TypeError(
            f"expected a ComfyUI MODEL (a ModelPatcher); got {type(model_patcher).__name__}. Pass the MODEL "
            "output of a ComfyUI loader (or comfy.sd.load_diffusion_model), not its diffusion model."
        )
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    try:
        diffusion = get("diffusion_model")
    except AttributeError:
        diffusion = None
    if not isinstance(diffusion, MMDiT) or not hasattr(diffusion, "joint_blocks"):
        raise TypeError(
            f"T5 Linearize converts SD3 / SD3.5 models (MMDiT), but this MODEL is {_describe_model(model_patcher)}. "
            "Connect the MODEL output of an SD3 Medium, SD3.5 Medium or SD3.5 Large loader."
        )
    return diffusion


def arch_of(model_patcher: Any) -> BaseArch:
    """The `BaseArch` of a ComfyUI SD3-family MODEL.

    Raises:
        TypeError: not a ModelPatcher, or not an SD3 / SD3.5 MMDiT (names what it got).
    """
    blocks = _diffusion_model(model_patcher).joint_blocks
    attention = blocks[0].x_block.attn
    return BaseArch(
        depth=len(blocks),
        heads=attention.num_heads,
        head_dim=attention.head_dim,
        dual_attention_layers=tuple(i for i, block in enumerate(blocks) if block.x_block.x_block_self_attn),
        qk_norm=not isinstance(attention.ln_q, nn.Identity),
    )


def converted_layers(model_patcher: Any) -> tuple[str, ...]:
    """The layers a `linearize`d ModelPatcher runs as T5 attention; () for any other model."""
    modules = t5_modules(model_patcher)
    return modules.layers() if modules is not None else ()


def summary(model_patcher: Any) -> str:
    """What `linearize` did to this ModelPatcher, a fact per line (file, modules, backend, schedule,
    base match, changes to weights); "" for a model it did not convert."""
    modules = t5_modules(model_patcher)
    return modules.summary if modules is not None else ""


_PatchKey = str | tuple[str, tuple[int, int, int]]
"""A ComfyUI weight patch's key: the weight's name, or its name and (dim, start, length) of a slice."""


@dataclass(frozen=True)
class _WeightPlan:
    """Where the file's changes to inherited weights (`base.*` tensors or deltas) go: weight patches
    that add a delta (LoRA patches, or `("diff", ...)`; for a `base.*` tensor the fine-tuned value
    minus the model's stored one) for ComfyUI's own layers (`comfy.ops`, patched wherever and whenever
    ComfyUI loads or streams them; additive, so they commute with LoRA patches placed before or after
    the node), and replacement modules, by path under the diffusion model, for plain torch modules
    such as the q/k RMSNorm, whose parameters ComfyUI 0.33 neither patches under Dynamic VRAM nor in a
    partial load."""

    weight_patches: dict[_PatchKey, Any]
    modules: dict[str, nn.Module]


@dataclass(frozen=True)
class _Stored:
    """A diffusion-model tensor as ComfyUI stores it, and ComfyUI's function that turns it into the
    weight its patches apply to (it dequantizes a quantized layer; identity otherwise)."""

    tensor: Tensor
    convert: Callable[..., Tensor]

    def value(self) -> Tensor:
        """The weight patches apply to, in fp32 on the CPU."""
        return self.convert(self.tensor.to(device="cpu", dtype=torch.float32, copy=True), inplace=True)


def _stored_tensors(model_patcher: Any) -> dict[str, _Stored]:
    """The diffusion model's own tensors by SD3 checkpoint name (ComfyUI's names without
    `diffusion_model.`). The live model is as the clone that ComfyUI loaded last left it (an earlier
    prompt's). Its modules may hold that clone's patched weights (a LoRA), which `get_key_patches`
    reads from ComfyUI's backup of the originals instead; and a module that clone replaced by an object
    patch (this host's RMSNorm replacements) shows the replacement's tensors, which are read from the
    original module, kept unchanged in ComfyUI's backup of object patches (shared by all clones)."""
    entries = model_patcher.get_key_patches(filter_prefix="diffusion_model.")
    stored = {key.removeprefix("diffusion_model."): _Stored(*patches[0]) for key, patches in entries.items()}
    for path, original in model_patcher.object_patches_backup.items():
        if path.startswith("diffusion_model.") and isinstance(original, nn.Module):
            prefix = path.removeprefix("diffusion_model.") + "."
            for key, tensor in original.state_dict(prefix=prefix).items():
                if key in stored:
                    stored[key] = _Stored(tensor, stored[key].convert)
    return stored


def _weight_patches(key: str, delta: Delta) -> dict[_PatchKey, Any]:
    """ComfyUI weight patches that add `delta` to the diffusion model's `key`: a LoRA patch (scale 1)
    on each part's rows of a low-rank delta, else a `("diff", ...)` patch of the full delta."""
    import comfy.weight_adapter

    name = f"diffusion_model.{key}"
    if not delta.low_rank:
        return {name: ("diff", (delta.full(),))}
    rows = delta.up.shape[1]
    # (mat_up, mat_down, alpha, mid, dora_scale, reshape); alpha None is scale 1
    return {
        (name, (0, part * rows, rows)): comfy.weight_adapter.LoRAAdapter(set(), (up, down, None, None, None, None))
        for part, (up, down) in enumerate(zip(delta.up, delta.down, strict=True))
    }


def _plan_weights(prepared: Prepared, stored: Callable[[], Mapping[str, _Stored]], model_patcher: Any) -> _WeightPlan:
    """Route the file's checked `base.*` tensors and deltas (see `_WeightPlan`); `stored` gives the
    model's own tensors."""
    plan = _WeightPlan({}, {})
    changes = [(key, tensor, None) for key, tensor in prepared.base.items()]
    changes += [(key, None, delta) for key, delta in prepared.deltas.items()]
    for key, value, delta in changes:
        owner_name, _, attribute = key.rpartition(".")
        # this clone's module: another clone's object patch may be installed in the live model
        # a top-level tensor (pos_embed) is owned by the diffusion model itself
        owner = model_patcher.get_model_object(f"diffusion_model.{owner_name}" if owner_name else "diffusion_model")
        if hasattr(owner, "comfy_cast_weights"):
            if delta is None:
                delta = Delta(diff=value.to(torch.float32) - stored()[key].value())
            plan.weight_patches.update(_weight_patches(key, delta))
        elif attribute in owner._parameters and not any(True for _ in owner.children()):
            if value is None:
                value = stored()[key].value() + delta.full()
            replacement = plan.modules.get(owner_name) or fresh_copy(owner)
            dtype = stored()[key].tensor.dtype
            setattr(replacement, attribute, nn.Parameter(value.to(dtype), requires_grad=False))
            plan.modules[owner_name] = replacement
        else:
            what = "base tensor" if delta is None else "delta"
            raise T5WeightsError(
                f"{prepared.weights.name}: {what} {key!r} is not a trainable weight of a layer (a buffer such "
                "as the position embedding), which T5 Linearize does not change. Export the file without it."
            )
    return plan


def _fingerprint(stored: Callable[[], Mapping[str, _Stored]], arch: BaseArch) -> str:
    """`t5core.deltas.fingerprint` of the weights the model stores, each qkv dequantized when it is read."""
    return fingerprint(TensorsOnRead(fingerprint_keys(arch), lambda key: stored()[key].value()), arch)


_BASE_MATCH = {
    True: "the file's own base",
    False: "not the file's base (a fine-tune of it, or another model): its changes added anyway",
    None: "not recorded in the file",
}


def _chain_notes(model_patcher: Any) -> list[str]:
    """Warnings about nodes placed before this one that cannot work on an SD3 model."""
    import comfy.patcher_extension

    wrappers = model_patcher.wrappers.get(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, {})
    if "easycache" in wrappers:
        return [
            "note: EasyCache skips no step on SD3 (ComfyUI's SD3 model never calls its hook), with T5 or "
            "without; use LazyCache"
        ]
    return []


CPU_MEMORY_NOTE = (
    "note: on a CPU, THP_MEM_ALLOC_ENABLE=1 in ComfyUI's environment (set before it starts) makes T5 attention "
    "steadier and faster; see the pack's docs/comfyui.md, 'On a CPU'"
)


def _cpu_notes(device: torch.device) -> list[str]:
    """The hint for a Linux CPU whose torch allocates without huge pages: T5's chunk temporaries then fault
    in page by page (docs/comfyui.md, "On a CPU"). torch turns them on for exactly "1" and ignores any other
    value with a warning."""
    huge_pages = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
    return [CPU_MEMORY_NOTE] if device.type == "cpu" and sys.platform.startswith("linux") and not huge_pages else []


def _summary(prepared: Prepared, model_patcher: Any, arch: BaseArch, schedule: Schedule, backend: str) -> str:
    """What the conversion did, one fact per line: the file, modules, backend, schedule, base match and
    changes to the model's weights (the node's status output and, joined, its log line)."""
    model = model_patcher.model
    dtype = getattr(model, "manual_cast_dtype", None) or model_patcher.model_dtype()
    device = model_patcher.load_device
    runs = describe_backend(backend, device, dtype, head_dim=arch.head_dim, variant=prepared.config.variant)
    return "\n".join(
        (
            f"T5 Linearize: {prepared.weights.name}",
            f"modules: T5 attention on {len(prepared.layers)} of {len(arch.attention_modules())} attention modules "
            f"({','.join(prepared.layers)})",
            f"backend: {runs} on {device}",
            f"schedule: T5 {schedule.describe()}",
            f"base: {_BASE_MATCH[prepared.fingerprint_matches]}",
            f"file: {prepared.describe()}",
            *_chain_notes(model_patcher),
            *_cpu_notes(torch.device(device)),
        )
    )


def linearize(
    model_patcher: Any,
    weights: T5Weights | str | os.PathLike[str],
    *,
    layers: LayerSpec | None = None,
    backend: str = "auto",
    schedule: Schedule | None = None,
) -> Any:
    """Convert a ComfyUI SD3-family model to T5 attention, on a clone.

    Args:
        model_patcher (`comfy.model_patcher.ModelPatcher`): an SD3 / SD3.5 MODEL; left unchanged.
        weights (`T5Weights | str | PathLike`): a loaded T5 weights file, or its path.
        layers (`str | Sequence[str]`, *optional*): restricts the conversion to a subset of the
            file's layers (a layer spec, see `t5core.layers`); None converts all of them.
        backend (`"auto" | "torch" | "triton"`, *optional*, defaults to `"auto"`): T5 attention backend.
        schedule (`Schedule`, *optional*): the part of sampling that runs T5 attention; softmax outside
            it, with the file's changes to the model's weights applied throughout. None: all of it.

    Returns:
        A patched clone of `model_patcher`; `summary` of it says what was done, as the log line does.

    Raises:
        TypeError: the MODEL is not an SD3-family MMDiT (the message names the model).
        ValueError: the MODEL is already converted by T5 Linearize, or `layers` selects nothing.
        T5WeightsError: the file is for another architecture, cannot serve `layers`, or has `base.*`
            tensors or deltas that do not fit the model.
        FileNotFoundError: `weights` is a path that does not exist.
    """
    import comfy.patcher_extension

    schedule = schedule or Schedule()
    arch, diffusion = arch_of(model_patcher), _diffusion_model(model_patcher)
    if converted_layers(model_patcher):
        raise ValueError(
            f"this MODEL already runs T5 attention on {', '.join(converted_layers(model_patcher))}. "
            "Use one T5 Linearize node per model: connect it to the model before the first T5 Linearize."
        )
    stored = functools.cache(functools.partial(_stored_tensors, model_patcher))

    def state() -> dict[str, Tensor]:
        return {key: entry.tensor for key, entry in stored().items()}

    prepared = prepare(
        weights,
        arch,
        model_state=state,
        model_fingerprint=functools.partial(_fingerprint, stored, arch),
        layers=layers,
        backend=backend,
    )
    if not prepared.layers:
        raise ValueError(
            f"layers {layers!r} selects no attention module; to run the model unchanged, turn T5 Linearize off."
        )
    plan = _plan_weights(prepared, stored, model_patcher)
    modules = T5Modules(prepared.modules, _summary(prepared, model_patcher, arch, schedule, backend))
    modules.requires_grad_(False)

    patched = model_patcher.clone()
    object_patches = {f"diffusion_model.{path}": module for path, module in plan.modules.items()}
    for index in range(len(diffusion.joint_blocks)):
        if (patch := JointForward.of(modules, index)) is not None:
            object_patches[f"diffusion_model.joint_blocks.{index}.forward"] = patch
    for name, patch in object_patches.items():
        if name in patched.object_patches:
            logger.warning("T5 Linearize: replacing another node's patch of %s", name)
        patched.add_object_patch(name, patch)
    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, KEY, schedule)
    t5 = t5_patcher(model_patcher, modules, path=prepared.weights.path, backend=backend)
    patched.set_additional_models(KEY, [t5])
    per_device = PerDeviceClone(tuple(f"diffusion_model.{name}" for name in plan.modules))
    for event in ("ON_DEEPCLONE_MULTIGPU", "ON_MATCH_MULTIGPU_CLONES"):  # ComfyUI 0.33's MultiGPU CFG Split
        if hasattr(comfy.patcher_extension.CallbacksMP, event):
            patched.add_callback_with_key(getattr(comfy.patcher_extension.CallbacksMP, event), KEY, per_device)
    if plan.weight_patches:
        patched.add_patches(plan.weight_patches, strength_patch=1.0)
    logger.info("%s", modules.summary.replace("\n", "; "))
    return patched

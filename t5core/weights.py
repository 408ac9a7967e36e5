"""The T5 weights file (format versions 1 to 4): save, load, validate.

A safetensors file with `blocks.{i}.attn.{param}` / `blocks.{i}.attn2.{param}` tensors (the T5
parameters of each converted module), the changes a run made to inherited weights (SD3 checkpoint
naming) and string metadata: `t5.format_version`, the `T5Config` fields (`t5.variant`,
`t5.key_norm_eps`, `t5.locality`, `t5.layers`, in version 2 `t5.joint_mode`, `t5.merge`, in version
3 `t5.neighborhood`), `t5.base` (the `BaseArch` as JSON), `t5.trainer` (free-form provenance as JSON)
and, in version 4, `t5.base_fingerprint` (`t5core.deltas.fingerprint` of the base it was trained on).

Inherited weights are stored one of two ways. Versions 1 to 3 hold `base.{key}` tensors, absolute
values that replace the model's. Version 4 holds deltas (`t5core.deltas.Delta`) that a host adds to
the model it is given: `delta.{key}.diff`, or low-rank `delta.{key}.up` (parts, rows, rank) and
`delta.{key}.down` (parts, rank, cols); a version-4 file holds no `base.*`.

A file is written with the lowest version whose readers run it correctly: version 4 with deltas or a
fingerprint, which older readers refuse (they do not know `delta.*`); else version 3 with the
neighbourhood blend (`T5Config.neighborhood`), which older readers would drop without a word; else
version 2 for hybrid joint attention (`T5Config.joint_mode = "hybrid"`), which a version-1 reader
would run as plain T5 attention; else version 1, so older readers keep loading it. Every mismatch
raises `T5WeightsError` naming the file, the problem and the fix. Never pickle.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from t5core.atomic import write_atomic
from t5core.attention import T5Attention
from t5core.config import BaseArch, T5Config
from t5core.contract import fast_weight_names
from t5core.deltas import Delta
from t5core.layers import LayerSpec, resolve_layers

__all__ = [
    "FORMAT_VERSION",
    "T5Weights",
    "T5WeightsError",
    "build_modules",
    "check_base",
    "check_compatible",
    "expected_shapes",
    "load",
    "save",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 4
"""The newest format this module reads and writes; it reads every version from 1 up."""
DELTAS_VERSION = 4
"""The first format with deltas and a base fingerprint, and without `base.*`."""
BASE_PREFIX = "base."
DELTA_PREFIX = "delta."
DELTA_FORMS = ("diff", "up", "down")
"""The suffixes of a delta's tensors: `delta.{key}.diff`, or `delta.{key}.up` and `delta.{key}.down`."""


class T5WeightsError(ValueError):
    """A T5 weights file that cannot serve the request: the message names the file, problem and fix."""


class _Converted(Protocol):
    modules: Mapping[str, T5Attention]
    config: T5Config
    arch: BaseArch


@dataclass(frozen=True)
class T5Weights:
    """A loaded T5 weights file.

    Attributes:
        path: where it was read from.
        config: variant, key-norm eps, locality and the converted layers.
        arch: the base model it was made for.
        modules: per converted module (`blocks.3.attn`), its tensors by parameter name (`w1`, `q_conv.weight`).
        base: fine-tuned inherited weights in SD3 checkpoint naming, without the `base.` prefix
            (versions 1 to 3).
        provenance: free-form facts about how the file was made (trainer settings, steps, ...).
        deltas: changes to inherited weights in SD3 checkpoint naming, to add to the model's (version 4).
        fingerprint: `t5core.deltas.fingerprint` of the base the file was trained on; None when the
            file does not say.
    """

    path: str
    config: T5Config
    arch: BaseArch
    modules: dict[str, dict[str, Tensor]]
    base: dict[str, Tensor] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)
    deltas: dict[str, Delta] = field(default_factory=dict)
    fingerprint: str | None = None

    @property
    def name(self) -> str:
        return Path(self.path).name


def expected_shapes(config: T5Config, arch: BaseArch, layer: str) -> dict[str, tuple[int, ...]]:
    """Shape of every T5 parameter of the converted module `layer` for this config and architecture."""
    d, channels = arch.head_dim, arch.hidden
    shapes = {name: (arch.heads, d, d) for name in fast_weight_names(config.variant)}
    if config.locality:
        for conv in ("q_conv", "k_conv"):
            shapes[f"{conv}.weight"] = (channels, 1, 3, 3)
            shapes[f"{conv}.bias"] = (channels,)
    if config.exact_text(layer) and config.merge == "learned":
        shapes["merge_bias"] = (arch.heads,)
    return shapes


def _format_version(config: T5Config, *, deltas: bool) -> int:
    """The lowest version whose readers run the file correctly (module docstring)."""
    if deltas:
        return DELTAS_VERSION
    if config.neighborhood:
        return 3
    return 1 if config.joint_mode == "ttt" else 2


def save(
    path: str | os.PathLike[str],
    source: _Converted | Mapping[str, T5Attention],
    *,
    arch: BaseArch | None = None,
    config: T5Config | None = None,
    base: Mapping[str, Tensor] | None = None,
    provenance: Mapping[str, object] | None = None,
    deltas: Mapping[str, Delta] | None = None,
    fingerprint: str | None = None,
) -> Path:
    """Write a T5 weights file atomically (temp file, fsync, rename).

    Args:
        path: destination `.safetensors` file.
        source: a conversion handle (`.modules`, `.config`, `.arch`) or a mapping of module name
            (`blocks.3.attn`) to `T5Attention`; a mapping needs `arch` and `config`.
        arch: the base model; defaults to the handle's.
        config: the T5 config; defaults to the handle's. Its `layers` are set to the saved modules.
        base: fine-tuned inherited weights in SD3 checkpoint naming, stored as `base.{key}` (absolute
            values; versions 1 to 3).
        provenance: facts about how the file was made, stored as JSON in `t5.trainer`.
        deltas: changes to inherited weights in SD3 checkpoint naming, stored as `delta.{key}.diff` or
            `delta.{key}.up` and `.down`; makes the file version 4.
        fingerprint: `t5core.deltas.fingerprint` of the base the deltas were trained on, stored as
            `t5.base_fingerprint`; makes the file version 4.

    Returns:
        The path written.

    Raises:
        ValueError: missing arch/config, a module that does not match them, or `base` given with
            `deltas` or `fingerprint`.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: T5 weights files are .safetensors; name the file '{path.stem}.safetensors'.")
    modules = dict(source.modules if hasattr(source, "modules") else source)
    arch = arch or getattr(source, "arch", None)
    config = config or getattr(source, "config", None)
    if arch is None or config is None:
        raise ValueError("save() needs arch= and config= when given a plain mapping of modules.")
    changes = bool(deltas) or fingerprint is not None
    if base and changes:
        raise ValueError(
            "save() got base= (absolute values, format 1 to 3) and deltas= or fingerprint= (changes to add, "
            "format 4); a file holds one of them. Pass the trained changes as deltas= instead of base=."
        )
    layers = resolve_layers(list(modules), arch)
    config = replace(config, layers=layers)
    tensors: dict[str, Tensor] = {}
    for name in layers:
        state = modules[name].file_state()
        got = {key: tuple(t.shape) for key, t in state.items()}
        shapes = expected_shapes(config, arch, name)
        if got != shapes:
            raise ValueError(f"module {name} has parameters {got}; the config and architecture expect {shapes}.")
        tensors.update({f"{name}.{key}": t.detach().to("cpu").contiguous() for key, t in state.items()})
    for key, tensor in (base or {}).items():
        tensors[BASE_PREFIX + key] = tensor.detach().to("cpu").contiguous()
    for key, delta in (deltas or {}).items():
        for form, tensor in delta.stored().items():
            tensors[f"{DELTA_PREFIX}{key}.{form}"] = tensor.detach().to("cpu").contiguous()
    metadata = {
        "format": "pt",
        "t5.format_version": str(_format_version(config, deltas=changes)),
        **config.to_metadata(),
        "t5.base": arch.to_metadata(),
        "t5.trainer": json.dumps(dict(provenance or {}), sort_keys=True, default=str),
        **({"t5.base_fingerprint": fingerprint} if fingerprint is not None else {}),
    }
    write_atomic(path, lambda temp: save_file(tensors, temp, metadata=metadata))
    logger.info(
        "T5 weights: wrote %d modules (%d base tensors, %d deltas) to %s",
        len(layers),
        len(base or {}),
        len(deltas or {}),
        path,
    )
    return path


def _fail(path: Path, problem: str, fix: str) -> T5WeightsError:
    return T5WeightsError(f"{path.name}: {problem} {fix}")


def _read(path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    not_ours = "Choose a T5 weights file (.safetensors) written by t5core.weights.save or trainer/run.py."
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise _fail(
            path,
            f"is not a readable safetensors file ({error}).",
            f"The file is corrupt or truncated, or of another format. {not_ours}",
        ) from error
    if "t5.format_version" not in metadata:
        raise _fail(
            path,
            "is a safetensors file but not a T5 weights file (it has no t5.format_version metadata; "
            "is it a model checkpoint or a LoRA?).",
            not_ours,
        )
    return metadata, tensors


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes a T5 weights file may store (T5 parameters, `base.*` and `delta.*` tensors alike)."""


def _check_values(path: Path, key: str, tensor: Tensor) -> None:
    """Refuse a tensor that would load quietly and then ruin every image: a dtype that is not a
    float the models compute in (int, bool, fp8, fp64), or any NaN or infinite value."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise _fail(
            path,
            f"tensor {key!r} is {str(tensor.dtype).removeprefix('torch.')}; T5 weights files hold float32, "
            "float16 or bfloat16 tensors.",
            "The file was edited or written by another tool; re-export it with t5core.weights.save or trainer/run.py.",
        )
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        nan = int(torch.isnan(tensor).sum())
        inf = tensor.numel() - int(finite.sum()) - nan
        found = ", ".join(f"{count} {what}" for count, what in ((nan, "NaN"), (inf, "infinite")) if count)
        raise _fail(
            path,
            f"tensor {key!r} holds {found} values (of {tensor.numel()}), which would turn every image to noise.",
            "Training diverged or the file is damaged: export again from an earlier checkpoint "
            "(trainer/run.py keeps them), with a lower learning rate if the loss went to nan.",
        )


def load(path: str | os.PathLike[str]) -> T5Weights:
    """Read and check a T5 weights file: metadata, and every tensor's presence and shape.

    Raises:
        FileNotFoundError: no such file.
        T5WeightsError: not a T5 weights file, a newer format, corrupt or truncated, missing or
            misshapen tensors, tensors that do not belong, `base.*` in a version-4 file or `delta.*`
            in an older one, deltas of no known form or whose factors do not fit, or tensors (T5,
            `base.*` or `delta.*`) that are not float32 / float16 / bfloat16 or hold NaN or infinite
            values.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"T5 weights file not found: {path}. Check the path, or put the file in ComfyUI/models/t5_linearize/."
        )
    metadata, tensors = _read(path)
    version = metadata["t5.format_version"]
    if version not in {str(known) for known in range(1, FORMAT_VERSION + 1)}:
        raise _fail(
            path,
            f"has format version {version}; this t5core reads versions 1 to {FORMAT_VERSION}.",
            "Upgrade this package (or re-export the file with this version).",
        )
    try:
        config = T5Config.from_metadata(metadata)
        arch = BaseArch.from_metadata(metadata["t5.base"])
        provenance = json.loads(metadata.get("t5.trainer", "{}"))
        layers = resolve_layers(list(config.layers), arch)
    except (KeyError, ValueError, TypeError) as error:
        raise _fail(
            path, f"has unreadable T5 metadata ({error!r}).", "Re-export it with t5core.weights.save."
        ) from error
    shapes = {name: expected_shapes(config, arch, name) for name in layers}
    modules: dict[str, dict[str, Tensor]] = {name: {} for name in layers}
    base: dict[str, Tensor] = {}
    stored_deltas: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        _check_values(path, key, tensor)
        if key.startswith(BASE_PREFIX):
            base[key[len(BASE_PREFIX) :]] = tensor
            continue
        if key.startswith(DELTA_PREFIX):
            target, _, form = key[len(DELTA_PREFIX) :].rpartition(".")
            if form not in DELTA_FORMS:
                raise _fail(
                    path,
                    f"holds tensor {key!r}, which is not a delta (delta.{{key}}.diff, .up or .down).",
                    "The file is damaged or was edited; re-export it.",
                )
            stored_deltas.setdefault(target, {})[form] = tensor
            continue
        module, _, param = key.rpartition(".")
        if module.endswith("_conv"):
            module, _, conv = module.rpartition(".")
            param = f"{conv}.{param}"
        if module not in modules or param not in shapes[module]:
            raise _fail(
                path,
                f"holds tensor {key!r}, which is not a T5 parameter of its layers {list(layers)}.",
                "The file is damaged or was edited; re-export it.",
            )
        if tuple(tensor.shape) != shapes[module][param]:
            raise _fail(
                path,
                f"{key} is {tuple(tensor.shape)}, but its metadata ({arch.describe()}, "
                f"variant {config.variant!r}) expects {shapes[module][param]}.",
                "The file is damaged or was edited; re-export it.",
            )
        modules[module][param] = tensor
    for name, params in modules.items():
        missing = sorted(set(shapes[name]) - set(params))
        if missing:
            raise _fail(
                path,
                f"is missing {', '.join(f'{name}.{p}' for p in missing)}.",
                "The file is incomplete (an interrupted copy?); download or export it again.",
            )
    return T5Weights(
        str(path),
        config,
        arch,
        modules,
        base,
        {str(k): str(v) for k, v in provenance.items()},
        deltas=_deltas(path, int(version), base, stored_deltas),
        fingerprint=metadata.get("t5.base_fingerprint"),
    )


def _deltas(
    path: Path, version: int, base: Mapping[str, Tensor], stored: dict[str, dict[str, Tensor]]
) -> dict[str, Delta]:
    """The file's deltas from their tensors by form, checked: only in version 4, where `base.*` is not."""
    if version >= DELTAS_VERSION and base:
        raise _fail(
            path,
            f"is format version {version}, which stores inherited weights as delta.* changes, but it also "
            f"holds base.* tensors ({', '.join(sorted(base)[:3])}).",
            "The file was edited or written by another tool; re-export it with t5core.weights.save or "
            "trainer/run.py (deltas, or base tensors in an older format, not both).",
        )
    if version < DELTAS_VERSION and stored:
        raise _fail(
            path,
            f"holds delta.* tensors ({', '.join(sorted(stored)[:3])}), which format version {DELTAS_VERSION} "
            f"brought, but says it is version {version}.",
            "The file is damaged or was edited; re-export it.",
        )
    deltas = {}
    for key, forms in stored.items():
        try:
            deltas[key] = Delta(**forms)
        except ValueError as error:
            raise _fail(path, f"delta {key!r}: {error}", "The file is damaged or was edited; re-export it.") from error
    return deltas


def _arch_mismatch(weights: T5Weights, arch: BaseArch) -> str:
    ours, theirs = weights.arch, arch
    diffs = [
        f"{field_name} {getattr(ours, field_name)} (file) vs {getattr(theirs, field_name)} (model)"
        for field_name in ("depth", "heads", "head_dim", "dual_attention_layers", "qk_norm")
        if getattr(ours, field_name) != getattr(theirs, field_name)
    ]
    return "; ".join(diffs)


def check_compatible(weights: T5Weights, arch: BaseArch, layers: LayerSpec | None = None) -> tuple[str, ...]:
    """Check that a file fits a model and can serve a layer request.

    Args:
        weights: the loaded file.
        arch: the model's architecture.
        layers: restricts the conversion to a subset of the file's layers; None takes them all.

    Returns:
        The module names to convert.

    Raises:
        T5WeightsError: the file is for another architecture or variant, or lacks requested layers.
    """
    path = Path(weights.path)
    if weights.arch != arch:
        raise _fail(
            path,
            f"was made for a {weights.arch.describe()}, but the model is a {arch.describe()} "
            f"({_arch_mismatch(weights, arch)}).",
            "Use a T5 weights file trained for this model.",
        )
    if layers is None:
        return weights.config.layers
    try:
        wanted = resolve_layers(layers, arch)
    except ValueError as error:
        raise _fail(path, f"cannot serve layers {layers!r}: {error}", "") from error
    missing = [name for name in wanted if name not in weights.config.layers]
    if missing:
        raise _fail(
            path,
            f"holds T5 weights for {len(weights.config.layers)} modules ({','.join(weights.config.layers)}); "
            f"the request {layers!r} also needs {', '.join(missing)}.",
            "Ask for a subset of the file's layers, or train a file that covers them.",
        )
    return wanted


def check_base(weights: T5Weights, model_state: Mapping[str, Tensor]) -> None:
    """Check what a file does to the base model's weights: every `base.*` tensor and every delta is of
    a tensor of the model, with its shape (a low-rank delta's parts x rows by cols).

    Args:
        weights: the loaded file.
        model_state: the model's tensors by SD3 checkpoint name (`joint_blocks.0.x_block.attn.qkv.weight`);
            only names and shapes are read, so meta tensors will do.

    Raises:
        T5WeightsError: a base tensor or delta of a tensor the model lacks, or of another shape.
    """
    path = Path(weights.path)
    changes = [(key, f"base tensor {key!r}", tuple(tensor.shape)) for key, tensor in weights.base.items()]
    for key, delta in weights.deltas.items():
        form = f"low-rank delta {key!r} ({delta.parts} parts of rank {delta.rank})" if delta.low_rank else None
        changes.append((key, form or f"delta {key!r}", delta.shape))
    for key, what, shape in changes:
        target = model_state.get(key)
        if target is None:
            raise _fail(
                path,
                f"{what} is not a weight of this model.",
                "The file was made for another model variant; use a T5 weights file trained for this model.",
            )
        if tuple(target.shape) != shape:
            raise _fail(
                path,
                f"{what} is {shape}, the model's is {tuple(target.shape)}.",
                "Use a T5 weights file trained for this model.",
            )


def build_modules(weights: T5Weights, layers: tuple[str, ...], *, backend: str = "auto") -> dict[str, T5Attention]:
    """Build `T5Attention` modules holding the file's tensors for the given layers."""
    modules: dict[str, T5Attention] = {}
    for name in layers:
        module = T5Attention.from_config(
            weights.config, weights.arch.heads, weights.arch.head_dim, layer=name, backend=backend
        )
        with torch.no_grad():
            module.load_file_state(weights.modules[name])
        modules[name] = module
    return modules

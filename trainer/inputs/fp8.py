"""fp8 checkpoints read for training: plain fp8 weights upcast, ComfyUI's scaled-fp8 ones dequantized.

A scaled-fp8 file (`sd3.5_large_fp8_scaled.safetensors`, `t5xxl_fp8_e4m3fn_scaled.safetensors`) stores a
layer's weight in fp8 (`<layer>.weight`) beside one float32 scale for the whole tensor
(`<layer>.scale_weight`, shape [] or [1]); the weight is `weight.float() * scale_weight`, as ComfyUI
multiplies it when it casts the weight for a matmul. `<layer>.scale_input` scales activations for fp8
matmuls at inference, not weights, so training drops it, and so the `scaled_fp8` marker tensor. Other
tensors (biases, norms, unquantized layers) are stored as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from t5core.deltas import TensorsOnRead

__all__ = ["dequantize_scaled_fp8", "is_scaled_fp8", "read_weights"]

logger = logging.getLogger(__name__)

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_MARKER = "scaled_fp8"
_WEIGHT, _SCALE, _INPUT_SCALE = ".weight", ".scale_weight", ".scale_input"


def _is_extra(key: str) -> bool:
    """The marker and the scales: tensors of the fp8 format, not of the model."""
    return key == _MARKER or key.endswith(("." + _MARKER, _SCALE, _INPUT_SCALE))


def is_scaled_fp8(keys: Iterable[str]) -> bool:
    """Whether tensor names are a scaled-fp8 model's: its `scaled_fp8` marker, or a `.scale_weight`."""
    return any(key == _MARKER or key.endswith(("." + _MARKER, _SCALE)) for key in keys)


def _dequantize(weight: Tensor, scale: Tensor, name: str, source: str) -> Tensor:
    if scale.numel() != 1:
        raise ValueError(
            f"{source}: {name} has {tuple(scale.shape)} scales; a scaled-fp8 file holds one per weight tensor "
            "(ComfyUI's format). Give the fp16 / bf16 file of the same model."
        )
    return weight.to(torch.float32) * scale.to(torch.float32).reshape(())


def dequantize_scaled_fp8(
    state: Mapping[str, Tensor], dtype: torch.dtype, *, source: str = "the state dict"
) -> dict[str, Tensor]:
    """A scaled-fp8 model's tensors as the model's weights: each weight with a `.scale_weight` is multiplied
    by it in float32, the other tensors kept; all in `dtype`, without the scales and the marker.

    Args:
        state (`Mapping[str, Tensor]`):
            The model's tensors with their scales; read once each, in order, so a mapping that loads on
            access (`t5core.deltas.TensorsOnRead`) holds one tensor at a time.
        dtype (`torch.dtype`):
            The dtype of the weights returned.
        source (`str`):
            What `state` was read from, for error messages. Default: `"the state dict"`.

    Returns:
        The weights by name, in `dtype`.

    Raises:
        ValueError: an fp8 tensor without a scale, or a scale that is not a single number.
    """
    weights = {}
    for key in state:
        if _is_extra(key):
            continue
        scale = key.removesuffix(_WEIGHT) + _SCALE
        tensor = state[key]
        if key.endswith(_WEIGHT) and scale in state:
            tensor = _dequantize(tensor, state[scale], scale, source)
        elif tensor.dtype in _FP8:
            raise ValueError(
                f"{source}: the fp8 tensor {key} has no {scale}, so its values "
                "cannot be known. The file is damaged or was converted incompletely; download it again, or give "
                "the fp16 / bf16 file of the same model."
            )
        weights[key] = tensor.to(dtype)
    return weights


def read_weights(
    path: Path, dtype: torch.dtype, *, prefix: str = "", ignore: Collection[str] = (), what: str
) -> dict[str, Tensor]:
    """One model's tensors from a safetensors file, in `dtype`, read one at a time: fp8 ones upcast, or
    dequantized with their scales when the model is scaled fp8.

    Args:
        path (`Path`):
            The file.
        dtype (`torch.dtype`):
            The dtype of the tensors returned.
        prefix (`str`):
            The model's key prefix in a file that bundles several (removed from the names); a file with no
            key under it holds only this model, and all of it is read. Default: `""`.
        ignore (`Collection[str]`):
            Names (without the prefix) to leave out. Default: `()`.
        what (`str`):
            The model, for the log line (`t5xxl`, `transformer`).

    Returns:
        The tensors by name (without the prefix), in `dtype`.

    Raises:
        ValueError: a scaled-fp8 model with an fp8 tensor that has no scale, or a scale per channel.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        keys = list(handle.keys())
        if not any(key.startswith(prefix) for key in keys):
            prefix = ""
        names = [key.removeprefix(prefix) for key in keys if key.startswith(prefix)]
        state = TensorsOnRead(
            (name for name in names if name not in ignore), lambda name: handle.get_tensor(prefix + name)
        )
        if is_scaled_fp8(state):
            logger.info("Model: %s holds scaled fp8 %s weights; dequantizing them to %s", path.name, what, dtype)
            return dequantize_scaled_fp8(state, dtype, source=path.name)
        if any(handle.get_slice(prefix + name).get_dtype().startswith("F8") for name in state):
            logger.info("Model: %s holds fp8 %s weights; upcasting them to %s", path.name, what, dtype)
        return {name: state[name].to(dtype) for name in state}

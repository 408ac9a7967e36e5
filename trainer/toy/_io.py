"""Atomic JSON and safetensors writes for the toy's outputs (`t5core.atomic`)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from t5core.atomic import write_bytes_atomic

__all__ = ["write_json_atomic", "write_safetensors_atomic"]


def write_json_atomic(path: Path | str, payload: object) -> Path:
    return write_bytes_atomic(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def write_safetensors_atomic(
    path: Path | str, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None
) -> Path:
    contiguous = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return write_bytes_atomic(path, safetensors_bytes(contiguous, metadata=metadata))

"""Atomic file writes for the toy's outputs (temp file in the same folder, fsync, os.replace)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from safetensors.torch import save as safetensors_bytes
from torch import Tensor

__all__ = ["write_bytes_atomic", "write_json_atomic", "write_safetensors_atomic"]


def write_bytes_atomic(path: Path | str, data: bytes) -> Path:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp makes the file private; shipped outputs are ordinary readable files.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: Path | str, payload: object) -> Path:
    return write_bytes_atomic(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def write_safetensors_atomic(
    path: Path | str, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None
) -> Path:
    contiguous = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return write_bytes_atomic(path, safetensors_bytes(contiguous, metadata=metadata))

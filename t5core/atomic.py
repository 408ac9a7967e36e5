"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

Every file the project writes (weights, checkpoint metadata, configs, reports, caches, benchmark
results) goes through `write_atomic`: a temp file in the target's folder is filled, flushed to disk,
given the permissions a plain `open(path, "w")` would give it (0666 minus the umask; `mkstemp`
alone makes it private, which hides exported weights from a ComfyUI running as another user) and
renamed over the target. A failed write leaves the old file and no temp file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_atomic", "write_bytes_atomic", "write_text_atomic"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Create or replace `path` atomically; `write(temp)` writes the content to the temp path.

    Args:
        path: the file to write; its folder is created when missing.
        write: fills the file at the path it is given (e.g. `safetensors.torch.save_file`).

    Returns:
        `path` as a `Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    temp = Path(name)
    try:
        write(temp)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(temp, 0o666 & ~_umask())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    return write_atomic(path, lambda temp: temp.write_bytes(data))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    return write_atomic(path, lambda temp: temp.write_text(text, encoding="utf-8"))

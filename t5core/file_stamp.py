"""A cheap identity of a file on disk, to tell when a file under the same name was replaced.

Size and modification time catch a normal rewrite; a hash of the first and last MiB catches a copy
that keeps the time (`cp -p`, a synced folder) when the header (a safetensors file's names, shapes and
metadata) or the tail changed. Reading at most 2 MiB keeps it cheap on multi-GB files.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["file_identity"]

_CHUNK = 1 << 20


def file_identity(path: str | os.PathLike[str]) -> tuple[int, int, str]:
    """(size in bytes, modification time in ns, sha256 of the first and last MiB) of `path`.

    Raises:
        FileNotFoundError: no file at `path`.
    """
    with open(path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        digest = hashlib.sha256(handle.read(_CHUNK))
        if stat.st_size > 2 * _CHUNK:
            handle.seek(-_CHUNK, os.SEEK_END)
        digest.update(handle.read(_CHUNK))
    return stat.st_size, stat.st_mtime_ns, digest.hexdigest()

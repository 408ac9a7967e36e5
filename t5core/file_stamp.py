"""Identities of files on disk: the sha256 of the whole file, and a cheap stamp to tell when a file
under the same name was replaced.

For the stamp, size and modification time catch a normal rewrite; a hash of the first and last MiB
catches a copy that keeps the time (`cp -p`, a synced folder) when the header (a safetensors file's
names, shapes and metadata) or the tail changed. Reading at most 2 MiB keeps it cheap on multi-GB files.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["file_identity", "sha256_file"]

_CHUNK = 1 << 20
_HASH_CHUNK = 1 << 24


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


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks (what `sha256sum` prints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()

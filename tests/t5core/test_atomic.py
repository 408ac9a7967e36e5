"""Atomic writes: whole file or old file, permissions of a plain open(), no temp file left."""

from __future__ import annotations

import os
import stat

import pytest

from t5core.atomic import write_atomic, write_bytes_atomic, write_text_atomic
from tests.t5core.test_weights import write as write_weights


@pytest.fixture
def umask():
    """`os.umask` for one test: the process's mask is restored after it."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_get_the_permissions_of_a_plain_open(tmp_path, umask, mask, mode):
    umask(mask)
    path = write_text_atomic(tmp_path / "sub" / "report.md", "# done\n")
    assert path.read_text() == "# done\n" and _mode(path) == mode


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = write_bytes_atomic(tmp_path / "t5.safetensors", b"old")

    def fail_halfway(temp):
        temp.write_bytes(b"new but partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, fail_halfway)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t5.safetensors"]


def test_exported_weights_are_readable_by_other_users(tmp_path, umask):
    """A ComfyUI running as another user must be able to read the weights the trainer exports."""
    umask(0o022)
    path, _ = write_weights(tmp_path)
    assert _mode(path) == 0o644

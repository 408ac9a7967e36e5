"""How the tests find a ComfyUI tree (testing/comfy_env.py): the lookup order, the skip that says how to
get a tree, and that the project reads no ComfyUI tree from shared/ (trees are unpacked per machine)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testing import comfy_env


def _fake_tree(path: Path) -> Path:
    for name in ("main.py", "nodes.py", "folder_paths.py", "comfy/model_patcher.py"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).touch()
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    if any(parent.name == "custom_nodes" for parent in comfy_env.REPO_ROOT.parents):
        pytest.skip("this checkout sits inside a ComfyUI's custom_nodes/, which the lookup takes first")
    return tmp_path


def test_the_lookup_order_is_current_then_floor_then_comfy_cli(home: Path):
    assert comfy_env.locate() is None
    workspace = _fake_tree(home / "comfy" / "ComfyUI")
    assert comfy_env.locate() == workspace
    floor = _fake_tree(home / "comfy" / "0.3.64")
    assert comfy_env.locate() == floor
    current = _fake_tree(home / "comfy" / "0.33.0")
    assert comfy_env.locate() == current


def test_comfyui_path_comes_first_and_must_be_a_tree(home: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_tree(home / "comfy" / "0.33.0")
    chosen = _fake_tree(home / "elsewhere")
    monkeypatch.setenv("COMFYUI_PATH", str(chosen))
    assert comfy_env.locate() == chosen
    monkeypatch.setenv("COMFYUI_PATH", str(home / "nothing-here"))
    with pytest.raises(FileNotFoundError, match="is not a ComfyUI tree"):
        comfy_env.locate()


def test_without_a_tree_the_comfyui_tests_skip_saying_how_to_get_one(home: Path):
    with pytest.raises(pytest.skip.Exception) as skipped:
        comfy_env.require_tree()
    message = str(skipped.value)
    assert "ComfyUI not found" in message and str(home / "comfy" / "0.33.0") in message
    assert "checkout v0.33.0" in message and "COMFYUI_PATH" in message


def test_no_tracked_file_reads_a_comfyui_tree_from_shared():
    """ComfyUI trees live in ~/comfy per machine; shared/comfyui/ holds only its README."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=comfy_env.REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    needle = "shared/" + "comfyui/0."
    hits = [
        name
        for name in files
        if (comfy_env.REPO_ROOT / name).is_file()
        and needle in (comfy_env.REPO_ROOT / name).read_text(encoding="utf-8", errors="ignore")
    ]
    assert hits == []

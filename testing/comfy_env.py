"""ComfyUI in this process for the tests and benchmarks that need it (docs/comfyui.md, "How the tests run
ComfyUI").

ComfyUI is on no package registry and is never committed (upstream GPL code), so each machine
unpacks its trees outside every repository. A tree is looked up in this order (`candidate_trees`):
`COMFYUI_PATH`, an enclosing ComfyUI (this repository inside `custom_nodes/`), `~/comfy/0.33.0`
(current), `~/comfy/0.3.64` (the floor the pack claims), `~/comfy/ComfyUI` (comfy-cli's default
workspace). `.ci/run` names each tree it finds through `COMFYUI_PATH`. Nothing found: the tests
skip with `not_found_message()`, which says how to get a tree. A tree that is found but cannot be imported,
or that does not load this node pack, is a failure with its reason.

The tests use only ComfyUI APIs that both the floor (0.3.64) and the current tree (0.33.0) have;
where a signature changed between them, the helpers here adapt (`run_prompt`).

ComfyUI runs on CUDA when torch sees a GPU and on CPU otherwise, from a throw-away base directory
(its own `models/`, `output/`), with this repository loaded the way ComfyUI loads a custom node.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTING_NODES = Path(__file__).resolve().parent / "comfy_testing_nodes.py"
"""A test-only node pack (`T5TestConditioning`), loaded beside this one."""


@dataclass(frozen=True)
class ComfyEnv:
    """A ComfyUI imported in this process, with this pack and the testing nodes loaded."""

    root: Path
    base_dir: Path
    device: torch.device
    nodes: ModuleType

    @property
    def models_dir(self) -> Path:
        return self.base_dir / "models"

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"


def _is_tree(path: Path) -> bool:
    return all((path / name).is_file() for name in ("main.py", "nodes.py", "folder_paths.py", "comfy/model_patcher.py"))


def candidate_trees() -> tuple[Path, ...]:
    """Where a tree is looked for after `COMFYUI_PATH` and an enclosing ComfyUI, in this order."""
    home = Path.home() / "comfy"
    return home / "0.33.0", home / "0.3.64", home / "ComfyUI"


def not_found_message() -> str:
    """Why the ComfyUI tests skip on a machine without a tree, and how to get one."""
    current, floor, _ = candidate_trees()
    return (
        f"ComfyUI not found, so the ComfyUI tests skip. Get a tree: `git clone https://github.com/Comfy-Org/ComfyUI "
        f"{current} && git -C {current} checkout v0.33.0` (and v0.3.64, the floor, into {floor}), or set "
        "COMFYUI_PATH to a ComfyUI tree, or put this repository in ComfyUI/custom_nodes/ (README.md, 'Tests')."
    )


def locate() -> Path | None:
    """The ComfyUI tree to test against, or None when there is none.

    Raises:
        FileNotFoundError: `COMFYUI_PATH` is set but is not a ComfyUI tree.
    """
    explicit = os.environ.get("COMFYUI_PATH")
    if explicit:
        path = Path(explicit).expanduser().resolve()
        if not _is_tree(path):
            raise FileNotFoundError(
                f"COMFYUI_PATH={explicit} is not a ComfyUI tree (no main.py, nodes.py, comfy/). Fix or unset it."
            )
        return path
    for parent in REPO_ROOT.parents:
        if parent.name == "custom_nodes" and _is_tree(parent.parent):
            return parent.parent
    return next((tree for tree in candidate_trees() if _is_tree(tree)), None)


def require_tree() -> Path:
    """The tree `locate` finds; skips the calling test with `not_found_message()` when there is none."""
    tree = locate()
    if tree is None:
        pytest.skip(not_found_message())
    return tree


def _load_pack(nodes: ModuleType, path: Path) -> None:
    """Load a custom node pack the way ComfyUI does; fail with ComfyUI's own log lines if it refuses."""
    records: list[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Collect(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        loaded = asyncio.run(nodes.load_custom_node(str(path)))
    finally:
        logging.getLogger().removeHandler(handler)
    if not loaded:
        details = " | ".join(record.getMessage() for record in records) or "no log output"
        pytest.fail(f"ComfyUI refused to load the custom node pack {path}: {details}", pytrace=False)


def _check_nodes_not_shadowed(root: Path) -> None:
    loaded = sys.modules.get("nodes")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(root)):
        pytest.fail(
            f"`nodes` is already imported from {getattr(loaded, '__file__', loaded)}, which hides ComfyUI's nodes.py. "
            "Do not import this repository's `nodes` package as a top-level module in tests.",
            pytrace=False,
        )


def import_comfy(root: Path, base_dir: Path, *, cpu: bool, sdpa: bool = False) -> ModuleType:
    """Import ComfyUI from `root` as `main.py` would, serving `base_dir`, with its core extra nodes.

    Its `nodes.py` must win over this repository's `nodes/` package, and its `utils/` package over
    `comfy/utils.py` (nodes.py puts `comfy/` first on sys.path), so ComfyUI is first on sys.path while
    its modules are imported, then moves to the end.

    Args:
        root (`Path`):
            The ComfyUI tree.
        base_dir (`Path`):
            ComfyUI's base directory (its `models/`, `output/`).
        cpu (`bool`):
            Run on the CPU (ComfyUI's `--cpu`).
        sdpa (`bool`):
            Force PyTorch SDPA for softmax attention (`--use-pytorch-cross-attention`). Default: `False`.

    Returns:
        ComfyUI's `nodes` module.
    """
    sys.path.insert(0, str(root))
    try:
        from comfy.cli_args import args

        args.cpu = cpu
        if sdpa:
            args.use_pytorch_cross_attention = True
        args.base_directory = str(base_dir)
        args.disable_auto_launch = True
        for name in ("folder_paths", "utils.install_util", "comfy.model_management", "nodes", "execution", "server"):
            importlib.import_module(name)
        nodes = sys.modules["nodes"]
        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    finally:
        sys.path.remove(str(root))
        sys.path.append(str(root))
    return nodes


_ENV: ComfyEnv | None = None


def comfy_env(base_dir: Path) -> ComfyEnv:
    """Import ComfyUI once per session with this pack and the testing nodes (skips or fails as the module
    docstring says); the `comfy` fixture of `testing.fixtures`."""
    global _ENV
    if _ENV is not None:
        return _ENV
    root = require_tree()
    _check_nodes_not_shadowed(root)
    try:
        nodes = import_comfy(root, base_dir, cpu=not torch.cuda.is_available())
    except Exception as error:  # any import-time error of the tree is the failure being reported
        pytest.fail(
            f"ComfyUI at {root} cannot be imported: {error!r}. Install its requirements "
            f"(pip install -r {root / 'requirements.txt'}, without torch/torchvision/torchaudio).",
            pytrace=False,
        )
    _load_pack(nodes, REPO_ROOT)
    _load_pack(nodes, TESTING_NODES)
    import comfy.model_management

    _ENV = ComfyEnv(root, base_dir, comfy.model_management.get_torch_device(), nodes)
    return _ENV


class _Server:
    """What `execution.PromptExecutor` needs of ComfyUI's PromptServer when nobody is listening."""

    client_id = None
    last_node_id = None
    last_prompt_id = None
    sockets_metadata: dict = {}

    def send_sync(self, event, data, sid=None) -> None:
        pass

    def queue_updated(self) -> None:
        pass


@dataclass(frozen=True)
class PromptResult:
    success: bool
    errors: list[str]
    outputs: dict


def _no_cache_args(executor_class: type) -> dict:
    """0.33 added `cache_args` (RAM-pressure cache headroom in GiB, read on every run); 0.3.64 has none."""
    if "cache_args" in inspect.signature(executor_class).parameters:
        return {"cache_args": {"lru": 0, "ram": 0.0, "ram_inactive": 0.0}}
    return {}


def run_prompt(prompt: dict, prompt_id: str = "t5-test") -> PromptResult:
    """Validate and execute an API-format prompt with ComfyUI's own executor (no server, no cache)."""
    import execution

    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    if not valid:
        messages = [str(error.get("message", error)) if isinstance(error, dict) else str(error)]
        for node in node_errors.values():
            messages += [f"{item['message']}: {item['details']}" for item in node["errors"]]
        return PromptResult(False, messages, {})
    executor = execution.PromptExecutor(_Server(), cache_type=False, **_no_cache_args(execution.PromptExecutor))
    executor.execute(prompt, prompt_id, extra_data={}, execute_outputs=outputs)
    errors = [data["exception_message"] for event, data in executor.status_messages if event == "execution_error"]
    return PromptResult(executor.success, errors, executor.history_result.get("outputs", {}))

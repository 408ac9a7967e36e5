"""ComfyUI nodes of the T5 Linearize pack (V3 schema API).

Importing this package needs neither ComfyUI nor torch: ComfyUI calls `comfy_entrypoint`, which
imports the node modules then. That keeps `import t5core` and pytest collection independent of ComfyUI.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

__all__ = ["comfy_entrypoint"]

logger = logging.getLogger(__name__)

_PACK_ROOT = Path(__file__).resolve().parent.parent


def _ensure_t5core() -> None:
    """Make the `t5core` library shipped beside these nodes importable.

    ComfyUI imports a pack from `custom_nodes/` by file location, so the pack's own top-level
    packages are not on `sys.path`; a pip-installed `t5core` is used when there is one.
    """
    if importlib.util.find_spec("t5core") is None:
        sys.path.append(str(_PACK_ROOT))
        logger.debug("T5 Linearize: added %s to sys.path for t5core", _PACK_ROOT)


async def comfy_entrypoint() -> Any:
    """ComfyUI's V3 entry point: the `ComfyExtension` that lists this pack's nodes."""
    _ensure_t5core()
    from .linearize import T5LinearizeExtension

    return T5LinearizeExtension()

"""The "T5 Linearize" node: an SD3 / SD3.5 MODEL in, the same MODEL running T5 attention out.

Weights files live in `ComfyUI/models/t5_linearize/` (or any `t5_linearize:` path of
`extra_model_paths.yaml`); only `.safetensors` files are listed.
"""

from __future__ import annotations

import logging
import os

import folder_paths
from comfy_api.latest import ComfyExtension, io
from typing_extensions import override

from t5core.config import BaseArch
from t5core.file_stamp import file_identity
from t5core.hosts import comfy as comfy_host
from t5core.layers import resolve_layers

__all__ = ["FOLDER", "T5Linearize", "T5LinearizeExtension"]

logger = logging.getLogger(__name__)

FOLDER = "t5_linearize"
CATEGORY = "T5"

# Layer specs are checked for syntax when a prompt is queued, against a model that has every block
# index a spec can name (whether the connected model has those modules is checked when the node runs).
_ANY_MODEL = BaseArch(depth=10_000, heads=1, head_dim=1, dual_attention_layers=tuple(range(10_000)))


def register_folder() -> None:
    """Register `models/t5_linearize` (first in the list) and restrict it to `.safetensors`.

    Paths already added from `extra_model_paths.yaml` are kept.
    """
    folder_paths.add_model_folder_path(FOLDER, os.path.join(folder_paths.models_dir, FOLDER), is_default=True)
    paths, _ = folder_paths.folder_names_and_paths[FOLDER]
    folder_paths.folder_names_and_paths[FOLDER] = (paths, {".safetensors"})


register_folder()


def _percent_input(name: str, default: float, tooltip: str) -> io.Float.Input:
    """A schedule input: a fraction of sampling in [0, 1], optional so that prompts saved without it run."""
    return io.Float.Input(name, default=default, min=0.0, max=1.0, step=0.001, optional=True, tooltip=tooltip)


class T5Linearize(io.ComfyNode):
    """Swap SD3 / SD3.5 softmax attention for T5 (linear-time test-time-training) attention."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="T5Linearize",
            display_name="T5 Linearize",
            category=CATEGORY,
            description=(
                "Runs the attention of an SD3 / SD3.5 model as T5 attention: linear time in the number of "
                "image tokens, so large images sample faster. The weights file says which attention modules "
                "it converts and holds their trained T5 weights; it must match the model (SD3.5 Medium, "
                "SD3.5 Large, ...). On a fine-tune of the file's base its changes to the model's weights add "
                "to the fine-tune's, as a LoRA's do. The incoming model is not changed: remove or bypass this "
                "node to get softmax attention back."
            ),
            inputs=[
                io.Model.Input("model", tooltip="An SD3 Medium, SD3.5 Medium or SD3.5 Large model."),
                io.Combo.Input(
                    "weights",
                    options=folder_paths.get_filename_list(FOLDER),
                    tooltip=(
                        "T5 weights file (.safetensors) from ComfyUI/models/t5_linearize/, trained for this "
                        "model or for the base it was fine-tuned from. Press R to refresh the list after adding "
                        "files."
                    ),
                ),
                io.String.Input(
                    "layers",
                    default="",
                    placeholder="all layers in the file",
                    tooltip=(
                        "Empty: convert every attention module the file holds. Otherwise a subset of them, "
                        "to trade speed for quality: 'paper', 'joint:18-23', 'attn2:0-12', 'blocks.20.attn', "
                        "comma separated. Fewer converted modules = closer to the original, slower at high "
                        "resolution. The modules left out keep the model's own weights: the file's changes to "
                        "them, and to the rest of a block where every module it converts is left out, are not "
                        "applied."
                    ),
                ),
                io.Boolean.Input(
                    "enabled",
                    default=True,
                    label_on="T5 attention",
                    label_off="off (original model)",
                    tooltip="Off passes the model through unchanged, exactly like bypassing the node.",
                ),
                _percent_input(
                    "start_percent",
                    0.0,
                    "Where in sampling T5 attention starts (0 = the first step). Before it the converted modules "
                    "run the original softmax attention, e.g. 0.2 lets the layout form with softmax. The file's "
                    "changes to the model's weights apply on every step.",
                ),
                _percent_input(
                    "end_percent", 1.0, "Where in sampling T5 attention ends (1 = the last step); softmax after it."
                ),
            ],
            outputs=[
                io.Model.Output(tooltip="The model running T5 attention on the converted modules."),
                io.String.Output(
                    "status",
                    tooltip=(
                        "What the node did: the file, the modules converted, the backend that runs them, the "
                        "schedule, whether the model is the file's base and the weight changes applied or left "
                        "out. Wire it to a text display node."
                    ),
                ),
            ],
        )

    @classmethod
    def validate_inputs(
        cls,
        weights: str | None = None,
        layers: str | None = None,
        enabled: bool | None = True,
        start_percent: float | None = 0.0,
        end_percent: float | None = 1.0,
    ) -> bool | str:
        if enabled is False:
            return True
        if start_percent is not None and end_percent is not None:
            try:
                comfy_host.Schedule(start_percent, end_percent)
            except ValueError as error:
                return f"T5 Linearize: {error}"
        if layers and layers.strip():
            try:
                resolve_layers(layers.strip(), _ANY_MODEL)
            except ValueError as error:
                return f"T5 Linearize layers: {error}"
        if weights is not None and weights not in folder_paths.get_filename_list(FOLDER):
            folders = ", ".join(folder_paths.get_folder_paths(FOLDER))
            return (
                f"T5 weights file {weights!r} is not in the t5_linearize models folder ({folders}). "
                "Put the .safetensors file there and refresh (R), or pick one from the list."
            )
        return True

    @classmethod
    def fingerprint_inputs(cls, weights: str | None = None, **_: object) -> tuple | None:
        """The weights file's identity on disk, so a file replaced under the same name is read again."""
        path = folder_paths.get_full_path(FOLDER, weights) if weights else None
        return file_identity(path) if path else None

    @classmethod
    def execute(
        cls,
        model,
        weights: str,
        layers: str = "",
        enabled: bool = True,
        start_percent: float = 0.0,
        end_percent: float = 1.0,
    ) -> io.NodeOutput:
        if not enabled:
            return io.NodeOutput(model, "T5 Linearize: off (the model passes through unchanged)")
        path = folder_paths.get_full_path_or_raise(FOLDER, weights)
        spec = layers.strip() if layers else ""
        schedule = comfy_host.Schedule(start_percent, end_percent)
        converted = comfy_host.linearize(model, path, layers=spec or None, schedule=schedule)
        return io.NodeOutput(converted, comfy_host.summary(converted))


class T5LinearizeExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [T5Linearize]

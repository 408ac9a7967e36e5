"""The "T5 Linearize" node as ComfyUI sees it: registration, schema, models folder, validation and a
whole prompt through ComfyUI's executor on a tiny SD3.5-format checkpoint written here.

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import re

import pytest
import torch

from t5core.config import BaseArch
from testing import comfy_env, comfy_tiny
from testing.comfy_prompts import sampling_prompt, saved_latents
from testing.models import tiny_transformer

ARCH = BaseArch(depth=2, heads=2, head_dim=64, dual_attention_layers=(0,), qk_norm=True)


@pytest.fixture(scope="module")
def node(comfy):
    return comfy.nodes.NODE_CLASS_MAPPINGS["T5Linearize"]


@pytest.fixture(scope="module")
def assets(comfy):
    """A tiny SD3.5-format single-file checkpoint and T5 weights files in the ComfyUI models folders."""
    checkpoint = comfy.models_dir / "checkpoints" / "tiny_sd35m_e2e.safetensors"
    comfy_tiny.write_checkpoint(checkpoint, tiny_transformer("comfy_sd35_medium_like", seed=7))
    folder = comfy.models_dir / "t5_linearize"
    comfy_tiny.write_t5_weights(folder / "tiny_e2e.safetensors", ARCH, ARCH.attention_modules(), seed=3)
    other = BaseArch(depth=3, heads=3, head_dim=64, qk_norm=True)
    comfy_tiny.write_t5_weights(folder / "for_another_model.safetensors", other, other.attention_modules())
    return checkpoint


def _prompt(*, weights: str = "tiny_e2e.safetensors", layers: str = "", enabled: bool = True, prefix: str) -> dict:
    return sampling_prompt(
        checkpoint="tiny_sd35m_e2e.safetensors", weights=weights, layers=layers, enabled=enabled, prefix=prefix
    )


def _latents(comfy, result: comfy_env.PromptResult) -> torch.Tensor:
    assert result.success, result.errors
    return saved_latents(comfy.output_dir, result.outputs)


def test_the_pack_registers_one_v3_node_with_tooltips(comfy, node):
    schema = node.GET_SCHEMA()
    assert (schema.node_id, schema.display_name, schema.category) == ("T5Linearize", "T5 Linearize", "T5")
    assert comfy.nodes.NODE_DISPLAY_NAME_MAPPINGS["T5Linearize"] == "T5 Linearize"
    assert "bypass" in schema.description
    assert [i.id for i in schema.inputs] == ["model", "weights", "layers", "enabled", "start_percent", "end_percent"]
    assert [i.optional for i in schema.inputs[-2:]] == [True, True], "prompts saved before them still validate"
    assert [o.get_io_type() for o in schema.outputs] == ["MODEL", "STRING"] and schema.outputs[1].id == "status"
    assert all(item.tooltip for item in [*schema.inputs, *schema.outputs])


def test_the_models_folder_lists_only_safetensors(comfy, node):
    import folder_paths

    folder = comfy.models_dir / "t5_linearize"
    (folder / "nested").mkdir(parents=True, exist_ok=True)
    for name in ("nested/deep.safetensors", "notes.txt", "old.ckpt", "pickle.pt"):
        (folder / name).write_bytes(b"x")
    listed = folder_paths.get_filename_list("t5_linearize")
    assert "nested/deep.safetensors" in listed
    assert not [name for name in listed if not name.endswith(".safetensors")]
    options = next(item for item in node.GET_SCHEMA().inputs if item.id == "weights").options
    assert options == listed


def test_off_returns_the_incoming_model_itself(node):
    sentinel = object()
    result = node.execute(model=sentinel, weights="any.safetensors", layers="", enabled=False).result
    assert result[0] is sentinel and "off" in result[1]


@pytest.mark.parametrize(
    "inputs, match",
    [
        pytest.param(
            {"weights": "missing.safetensors"},
            r"'missing\.safetensors' is not in the t5_linearize models folder",
            id="missing-file",
        ),
        pytest.param({"weights": "missing.safetensors", "enabled": False}, None, id="off-needs-no-file"),
        pytest.param(
            {"layers": "joint:18-23, atn2:0-12"},
            r"layers: layer spec item 'atn2:0-12' is not understood",
            id="layer-typo",
        ),
        pytest.param({"layers": "joint:5-2"}, r"the range 5-2 is empty", id="layer-range-reversed"),
        pytest.param({"weights": "tiny_e2e.safetensors", "layers": " paper "}, None, id="valid"),
        pytest.param(
            {"start_percent": 0.6, "end_percent": 0.4},
            r"start_percent 0\.6 is after end_percent 0\.4.*start_percent <= end_percent",
            id="schedule-reversed",
        ),
        pytest.param({"start_percent": 0.6, "end_percent": 0.4, "enabled": False}, None, id="off-needs-no-schedule"),
    ],
)
def test_validate_inputs_names_the_folder(node, assets, inputs, match):
    outcome = node.validate_inputs(**inputs)
    if match is None:
        assert outcome is True
    else:
        assert isinstance(outcome, str) and re.search(match, outcome)


def test_a_prompt_runs_end_to_end_and_t5_changes_the_latents(comfy, assets):
    softmax = _latents(comfy, comfy_env.run_prompt(_prompt(enabled=False, prefix="softmax")))
    t5 = _latents(comfy, comfy_env.run_prompt(_prompt(prefix="t5")))
    again = _latents(comfy, comfy_env.run_prompt(_prompt(prefix="t5_again")))
    partial = _latents(comfy, comfy_env.run_prompt(_prompt(layers="joint:1", prefix="t5_partial")))
    assert t5.shape == softmax.shape == (2, 16, 12, 20)
    assert torch.isfinite(t5).all() and torch.isfinite(partial).all()
    assert not torch.equal(t5, softmax) and not torch.equal(partial, t5) and not torch.equal(partial, softmax)
    assert torch.equal(t5, again)


@pytest.mark.parametrize(
    "overrides, match",
    [
        pytest.param(
            {"weights": "for_another_model.safetensors"},
            r"for_another_model\.safetensors: was made for",
            id="other-architecture",
        ),
        pytest.param(
            {"layers": "attn2:1"}, r"blocks\.1\.attn2, which the model does not have", id="layers-not-in-model"
        ),
        pytest.param(
            {"weights": "nope.safetensors"},
            r"'nope\.safetensors' is not in the t5_linearize models folder",
            id="unknown-file",
        ),
        pytest.param(
            {"layers": "atn2:0"}, r"layer spec item 'atn2:0' is not understood", id="layer-typo-at-queue-time"
        ),
    ],
)
def test_a_failed_node_reports_why_and_the_model_still_samples(comfy, assets, overrides, match):
    failed = comfy_env.run_prompt(_prompt(prefix="failed", **overrides))
    assert not failed.success
    assert any(re.search(match, message) for message in failed.errors), failed.errors
    softmax = comfy_env.run_prompt(_prompt(enabled=False, prefix="after_failure"))
    assert torch.isfinite(_latents(comfy, softmax)).all()


def test_comfyui_reads_the_pack_metadata_from_pyproject(comfy):
    """What ComfyUI and the Comfy Registry read: `[project]` and `[tool.comfy]`."""
    from comfy_config import config_parser

    config = config_parser.extract_node_configuration(str(comfy_env.REPO_ROOT))
    assert config is not None, "pyproject.toml could not be parsed by ComfyUI"
    assert config.project.name and config.project.version
    assert config.tool_comfy.publisher_id and config.tool_comfy.display_name == "T5 Linearize"


def test_the_pack_root_exports_only_comfyuis_entry_point(comfy):
    import sys

    # ComfyUI's loader names a pack folder after its path, with every "." replaced by "_x_".
    name = str(comfy_env.REPO_ROOT).replace(".", "_x_")
    root = sys.modules[name]
    assert root.__all__ == ["comfy_entrypoint"]
    assert root.comfy_entrypoint is sys.modules[f"{name}.nodes"].comfy_entrypoint
    linearize = sys.modules[f"{name}.nodes.linearize"]
    assert sorted(linearize.__all__) == ["FOLDER", "T5Linearize", "T5LinearizeExtension"]

"""Every UI-format workflow in `workflows/` loads in this ComfyUI: its node types exist (core, this
pack, or the frontend's own Note / Reroute nodes), its links agree with the nodes on both ends and
with the node schemas, and its widget values are accepted by the schemas.

Runs when ComfyUI is found (testing/comfy_env.py), skips with the reason otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testing import comfy_env

WORKFLOWS = sorted((comfy_env.REPO_ROOT / "workflows").glob("*.json"))
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_CONTROLS = {"fixed", "increment", "decrement", "randomize"}
MODEL_SUFFIXES = (".safetensors", ".sft", ".gguf", ".ckpt", ".pt", ".pth")


def _inputs(node_class) -> dict[str, tuple]:
    spec = node_class.INPUT_TYPES()
    return {name: value for section in ("required", "optional") for name, value in spec.get(section, {}).items()}


def _is_widget(kind, options: dict) -> bool:
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")


def _file_lists() -> list[list[str]]:
    import folder_paths

    return [folder_paths.get_filename_list(name) for name in folder_paths.folder_names_and_paths]


def _check_widget(where: str, kind, options: dict, value) -> None:
    if kind == "INT":
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r} is not an integer"
        assert options.get("min", value) <= value <= options.get("max", value), f"{where}: {value} is out of range"
    elif kind == "FLOAT":
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{where}: {value!r} is not a number"
        assert options.get("min", value) <= value <= options.get("max", value), f"{where}: {value} is out of range"
    elif kind == "BOOLEAN":
        assert isinstance(value, bool), f"{where}: {value!r} is not a boolean"
    elif kind == "STRING":
        assert isinstance(value, str), f"{where}: {value!r} is not a string"
    else:
        choices = kind if isinstance(kind, list) else options.get("options", [])
        if not choices or choices in _file_lists():
            # A model-file list: the user's files are not here, so the name must look like a model file.
            assert isinstance(value, str) and value.endswith(MODEL_SUFFIXES), (
                f"{where}: {value!r} is not a model file name"
            )
        else:
            assert value in choices, f"{where}: {value!r} is not one of {choices}"


def _check_widgets(node: dict, node_class) -> None:
    values = list(node.get("widgets_values") or [])
    for name, spec in _inputs(node_class).items():
        kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
        if not _is_widget(kind, options):
            continue
        where = f"node {node['id']} {node['type']}.{name}"
        assert values, f"{where}: no widget value"
        _check_widget(where, kind, options, values.pop(0))
        if options.get("control_after_generate"):
            control = values.pop(0)
            assert control in SEED_CONTROLS, (
                f"{where}: control_after_generate {control!r} is not one of {SEED_CONTROLS}"
            )
    assert not values, f"node {node['id']} {node['type']}: unexpected extra widget values {values}"


def _check_sockets(node: dict, node_class) -> None:
    inputs = _inputs(node_class)
    for slot in node["inputs"]:
        assert slot["name"] in inputs, f"node {node['id']} {node['type']} has no input {slot['name']!r}"
        kind = inputs[slot["name"]][0]
        expected = "COMBO" if isinstance(kind, list) else kind
        assert slot["type"] == expected, (
            f"node {node['id']} input {slot['name']} is {slot['type']}, the schema says {expected}"
        )
    # A node may gain outputs in later ComfyUI versions (SaveImage returns its images since 0.3x), and
    # the frontend adds the missing slots when it loads the workflow: the saved ones must be a prefix.
    returns = list(node_class.RETURN_TYPES)
    saved = [slot["type"] for slot in node["outputs"]]
    assert saved == returns[: len(saved)], f"node {node['id']} {node['type']} outputs {saved} differ from {returns}"
    required = node_class.INPUT_TYPES().get("required", {})
    linked = {slot["name"] for slot in node["inputs"] if slot.get("link") is not None}
    for name, spec in required.items():
        options = spec[1] if len(spec) > 1 else {}
        if not _is_widget(spec[0], options):
            assert name in linked, f"node {node['id']} {node['type']}: required input {name!r} is not connected"


def test_there_are_workflows_for_each_use():
    names = {path.name for path in WORKFLOWS}
    assert names == {
        "sd3.5_medium_t5_1k.json",
        "sd3.5_medium_t5_2k.json",
        "sd3.5_large_t5_1k.json",
        "sd3.5_medium_t5_ab_compare.json",
    }


@pytest.mark.parametrize("path", [pytest.param(path, id=path.stem) for path in WORKFLOWS])
def test_workflow_is_valid_for_this_comfyui(comfy, path: Path):
    workflow = json.loads(path.read_text())
    registry = comfy.nodes.NODE_CLASS_MAPPINGS
    nodes = {node["id"]: node for node in workflow["nodes"]}
    assert len(nodes) == len(workflow["nodes"]), "node ids repeat"
    unknown = sorted({node["type"] for node in nodes.values()} - set(registry) - FRONTEND_ONLY)
    assert not unknown, f"node types missing from ComfyUI and this pack: {unknown}"
    assert any(node["type"] == "T5Linearize" for node in nodes.values())
    assert any(
        node["type"] in ("Note", "MarkdownNote") and "t5_linearize" in node["widgets_values"][0]
        for node in nodes.values()
    )

    link_ids = set()
    for link_id, source, source_slot, target, target_slot, kind in workflow["links"]:
        link_ids.add(link_id)
        output = nodes[source]["outputs"][source_slot]
        target_input = nodes[target]["inputs"][target_slot]
        assert link_id in (output["links"] or []), f"link {link_id} is missing from node {source}'s output"
        assert target_input["link"] == link_id, f"link {link_id} is missing from node {target}'s input"
        assert output["type"] == target_input["type"] == kind, (
            f"link {link_id}: {output['type']} -> {target_input['type']} ({kind})"
        )
    for node in nodes.values():
        dangling = [
            slot["link"] for slot in node["inputs"] if slot.get("link") is not None and slot["link"] not in link_ids
        ]
        dangling += [link for slot in node["outputs"] for link in slot["links"] or [] if link not in link_ids]
        assert not dangling, f"node {node['id']} refers to links {dangling} that do not exist"
    assert workflow["last_link_id"] >= max(link_ids) and workflow["last_node_id"] >= max(nodes)

    for node in nodes.values():
        if node["type"] in FRONTEND_ONLY:
            continue
        _check_sockets(node, registry[node["type"]])
        _check_widgets(node, registry[node["type"]])

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


def _load(path: Path) -> tuple[dict, dict[int, dict], dict[int, list]]:
    """The workflow, its nodes by id and its links by id."""
    workflow = json.loads(path.read_text())
    return workflow, {node["id"]: node for node in workflow["nodes"]}, {link[0]: link for link in workflow["links"]}


def _source(nodes: dict[int, dict], links: dict[int, list], node: dict, name: str) -> dict:
    """The node whose output feeds `node`'s input `name`."""
    slot = next(slot for slot in node["inputs"] if slot["name"] == name)
    assert slot.get("link") is not None, f"node {node['id']} {node['type']}.{name} is not connected"
    return nodes[links[slot["link"]][1]]


def test_there_are_workflows_for_each_use():
    names = {path.name for path in WORKFLOWS}
    assert names == {
        "sd3.5_medium_t5_1k.json",
        "sd3.5_medium_t5_2k.json",
        "sd3.5_medium_t5_2k_two_pass.json",
        "sd3.5_large_t5_1k.json",
        "sd3.5_medium_t5_ab_compare.json",
    }


@pytest.mark.parametrize("path", [pytest.param(path, id=path.stem) for path in WORKFLOWS])
def test_t5_nodes_have_the_nodes_inputs_and_outputs(path: Path):
    """Without ComfyUI: each T5 Linearize node saves the widgets weights, layers, enabled, start_percent,
    end_percent (T5 over the whole schedule) and the outputs MODEL and status, as the node declares them."""
    _, nodes, _ = _load(path)
    t5_nodes = [node for node in nodes.values() if node["type"] == "T5Linearize"]
    assert t5_nodes
    for node in t5_nodes:
        weights, layers, enabled, start, end = node["widgets_values"]
        assert isinstance(weights, str) and weights.endswith(".safetensors"), weights
        assert isinstance(layers, str) and enabled is True
        assert (start, end) == (0.0, 1.0), f"node {node['id']}: T5 runs from {start} to {end}, not every step"
        assert [(slot["name"], slot["type"]) for slot in node["outputs"]] == [("MODEL", "MODEL"), ("status", "STRING")]


def test_the_two_pass_workflow_refines_its_1k_pass_at_2k_with_t5_in_both():
    """1024x1024 at full denoise, the latent upscaled x2, then 2048x2048 at partial denoise with fewer
    steps, both samplers on the one T5 Linearize model."""
    _, nodes, links = _load(comfy_env.REPO_ROOT / "workflows" / "sd3.5_medium_t5_2k_two_pass.json")
    save = next(node for node in nodes.values() if node["type"] == "SaveImage")
    decode = _source(nodes, links, save, "images")
    refine = _source(nodes, links, decode, "samples")
    upscale = _source(nodes, links, refine, "latent_image")
    base = _source(nodes, links, upscale, "samples")
    empty = _source(nodes, links, base, "latent_image")
    assert (refine["type"], upscale["type"], base["type"]) == ("KSampler", "LatentUpscaleBy", "KSampler")
    assert empty["type"] == "EmptySD3LatentImage" and empty["widgets_values"][:2] == [1024, 1024]
    assert upscale["widgets_values"][1] == 2.0
    # KSampler widgets: seed, control, steps, cfg, sampler, scheduler, denoise.
    base_steps, base_denoise = base["widgets_values"][2], base["widgets_values"][6]
    refine_steps, refine_denoise = refine["widgets_values"][2], refine["widgets_values"][6]
    assert base_denoise == 1.0 and 0.45 <= refine_denoise <= 0.55 and refine_steps < base_steps
    models = {_source(nodes, links, sampler, "model")["id"] for sampler in (base, refine)}
    assert len(models) == 1 and nodes[models.pop()]["type"] == "T5Linearize"


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

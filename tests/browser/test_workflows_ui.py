"""The workflows in `workflows/` open cleanly in ComfyUI's own frontend, the way a user opens them.

One ComfyUI server (the tree from `comfy_env.locate()`; verified on 0.33.0 with frontend 1.49.6)
runs with this pack in `custom_nodes/`, a small real T5 weights file in `models/t5_linearize/`, and
empty stand-ins for the model files the workflows' read-me notes ask for (the frontend flags a
model name its server does not list; nothing runs here, so their content is never read). Headless
Chromium opens each workflow through the frontend's File > Open input, and the test proves:

- the frontend reports nothing on opening it (no missing nodes, no missing models), and every
  node's type is registered in the frontend; a self-check opens a workflow with an unknown node
  type and shows that the same detector fires;
- every node has the output slots the server's schema lists (e.g. SaveImage's IMAGE output, which
  0.33 added and the saved workflows do not have: the frontend adds the slot);
- no two nodes overlap at the sizes the frontend draws them, title bars included;
- the graph opens in view: the saved view (`extra.ds`) puts every node inside the canvas, clear of
  the frontend's side bar, tabs, toolbars and minimap, at a zoom where node text is drawn;
- every note shows its whole text without scrolling, none of its lines wrapped;
- the T5 Linearize node's `weights` list offers the file in `models/t5_linearize/`.

It saves what the window shows for each workflow in the test's temporary folder, and with
`T5_UPDATE_SCREENSHOTS=1` as `docs/screenshots/<workflow>.png` (the committed pictures).

Skips, saying why, where Chromium or chromium-driver is not installed or no ComfyUI tree is found
(`comfy_env.not_found_message()` says how). A server that does not start is a failure quoting the
server log.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path

import pytest
from selenium.webdriver.remote.webdriver import WebDriver

from t5core.config import BaseArch
from testing import comfy_env
from testing.comfy_server import ComfyServer
from testing.comfy_tiny import write_t5_weights
from tests.browser import frontend

WORKFLOWS = sorted((comfy_env.REPO_ROOT / "workflows").glob("*.json"))
SCREENSHOTS = comfy_env.REPO_ROOT / "docs" / "screenshots"
T5_WEIGHTS = "tiny_sd35_t5.safetensors"
# The model files the workflows' read-me notes list, by models/ folder.
STAND_INS = {
    "checkpoints": ("sd3.5_medium.safetensors", "sd3.5_large.safetensors"),
    "text_encoders": ("clip_l.safetensors", "clip_g.safetensors", "t5xxl_fp16.safetensors"),
    "t5_linearize": ("sd3.5_medium_t5.safetensors", "sd3.5_large_t5.safetensors"),
}
USER_SETTINGS = {
    "Comfy.TutorialCompleted": True,  # a first start opens the template browser over the canvas
    "Comfy.Graph.CanvasInfo": False,  # the FPS counter would make every screenshot differ
    "Comfy.Workflow.Persist": False,  # each test starts from a fresh page: no tabs left by the last one
}
NOTE_TYPES = {"Note", "MarkdownNote"}

CHROMIUM = frontend.find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason=f"needs Chromium ({' or '.join(frontend.BROWSER_NAMES)}) and {frontend.DRIVER_NAME} on PATH "
    "(Debian: apt-get install chromium chromium-driver)",
)


def _stage_base_dir(base_dir: Path) -> None:
    """A ComfyUI base directory's model files and the user's settings (the server links this pack)."""
    models = base_dir / "models"
    arch = BaseArch(depth=2, heads=2, head_dim=64, dual_attention_layers=(0,), qk_norm=True)
    write_t5_weights(models / "t5_linearize" / T5_WEIGHTS, arch, arch.attention_modules())
    for folder, names in STAND_INS.items():
        (models / folder).mkdir(parents=True, exist_ok=True)
        for name in names:
            (models / folder / name).touch()
    settings = base_dir / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps(USER_SETTINGS))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    tree = comfy_env.require_tree()
    base_dir = tmp_path_factory.mktemp("comfyui-base")
    _stage_base_dir(base_dir)
    with ComfyServer.start(tree, base_dir, timeout_s=120) as server:
        yield server


@pytest.fixture(scope="module")
def browser(server: ComfyServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    assert CHROMIUM is not None  # the module skips otherwise
    driver = frontend.launch(CHROMIUM, tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


@pytest.fixture
def page(browser: WebDriver, server: ComfyServer) -> WebDriver:
    """The browser with the frontend freshly loaded, as a user finds it on opening ComfyUI."""
    try:
        frontend.open_frontend(browser, server.url)
    except Exception as error:  # whatever kept the page from coming up is the failure reported
        pytest.fail(
            f"ComfyUI's frontend did not come up at {server.url}: {error!r}\n"
            f"Script errors: {frontend.script_errors(browser)}\nServer log, last lines:\n{server.log_tail()}",
            pytrace=False,
        )
    frontend.script_errors(browser)  # the frontend's startup noise is not what the tests look at
    return browser


@pytest.fixture(scope="module")
def schemas(server: ComfyServer) -> dict:
    with urllib.request.urlopen(f"{server.url}/object_info", timeout=30) as response:
        return json.load(response)


def _open(page: WebDriver, path: Path) -> list[frontend.LiveNode]:
    workflow = json.loads(path.read_text())
    frontend.open_workflow(page, path, len(workflow["nodes"]))
    return frontend.live_nodes(page)


def test_missing_node_detector_fires(page: WebDriver, tmp_path: Path):
    """The detector the workflow test relies on sees a node type that no pack provides."""
    unknown = "T5TestNoSuchNodeType"
    path = tmp_path / "unknown_node.json"
    node = {"id": 1, "type": unknown, "pos": [100, 100], "size": [300, 100], "flags": {}, "order": 0, "mode": 0}
    path.write_text(
        json.dumps({"last_node_id": 1, "last_link_id": 0, "nodes": [node], "links": [], "groups": [], "version": 0.4})
    )
    nodes = _open(page, path)
    overlay = frontend.error_overlay(page)
    assert overlay is not None and unknown in overlay, (
        f"the frontend's error overlay ({frontend.ERROR_OVERLAY}) did not report the unknown node type "
        f"{unknown}: {overlay!r}"
    )
    assert [n.registered for n in nodes] == [False], f"{unknown} counts as registered: {nodes}"


def test_covered_node_detector_fires(page: WebDriver, tmp_path: Path):
    """The check that nodes open clear of the frontend's panels sees a node under the minimap, which
    sits in the canvas's bottom right corner, with the node's own id as the workflow test looks it up."""
    path = tmp_path / "node_under_minimap.json"
    view = frontend.view(page)
    # At scale 1 and offset 0 a graph point is a canvas point: 60 px in from the bottom right corner.
    corner = (view.canvas.right - view.canvas.left - 60, view.canvas.bottom - view.canvas.top - 60)
    node = {"id": 1, "type": "Note", "pos": [corner[0] - 100, corner[1] - 40], "size": [100, 40], "flags": {}}
    node |= {"order": 0, "mode": 0, "inputs": [], "outputs": [], "properties": {}, "widgets_values": [""]}
    workflow = {"last_node_id": 1, "last_link_id": 0, "nodes": [node], "links": [], "groups": [], "version": 0.4}
    path.write_text(json.dumps(workflow | {"extra": {"ds": {"scale": 1.0, "offset": [0, 0]}}}))
    nodes = _open(page, path)
    view = frontend.view(page)
    found = frontend.covered(page, {n.id: view.to_screen(n.box) for n in nodes})
    assert [n.id for n in nodes if n.id in found] == [nodes[0].id], (
        f"a node at {view.to_screen(nodes[0].box)} (canvas {view.canvas}) does not count as covered: {found}"
    )


@pytest.mark.parametrize("path", [pytest.param(path, id=path.stem) for path in WORKFLOWS])
def test_workflow_opens_cleanly(page: WebDriver, schemas: dict, path: Path, tmp_path: Path):
    name = path.name
    nodes = _open(page, path)
    screenshots = SCREENSHOTS if os.environ.get("T5_UPDATE_SCREENSHOTS") == "1" else tmp_path
    screenshots.mkdir(parents=True, exist_ok=True)
    page.save_screenshot(str(screenshots / f"{path.stem}.png"))

    overlay = frontend.error_overlay(page)
    assert overlay is None, f"{name}: the frontend reports errors on opening it:\n{overlay}"
    errors = frontend.script_errors(page)
    assert not errors, f"{name}: script errors while opening it: {errors}"
    unregistered = [n.label for n in nodes if not n.registered]
    assert not unregistered, f"{name}: node types the frontend does not know: {unregistered}"
    for n in nodes:
        if n.type in schemas:
            assert list(n.outputs) == schemas[n.type]["output"], (
                f"{name}: {n.label} has outputs {list(n.outputs)}, the server's schema {schemas[n.type]['output']}"
            )

    # Sharing an edge is allowed, any common area is not (0 px tolerance): the layouts keep 20+ units
    # between nodes, and the boxes are the drawn ones, so no allowance for size rounding is needed.
    too_small = [n.label for n in nodes if not n.content_fits]
    assert not too_small, f"{name}: nodes smaller than their widgets need (drawn past their size): {too_small}"
    overlapping = [f"{a.label} and {b.label}" for a, b in combinations(nodes, 2) if a.box.overlaps(b.box)]
    assert not overlapping, f"{name}: overlapping nodes: {overlapping}"

    view = frontend.view(page)
    assert not view.low_quality, f"{name}: opens zoomed out to {view.scale}, where node text is not drawn"
    on_screen = {n.id: view.to_screen(n.box) for n in nodes}
    outside = [f"{n.label} at {on_screen[n.id]}" for n in nodes if not on_screen[n.id].inside(view.canvas)]
    assert not outside, f"{name}: nodes outside the canvas ({view.canvas}) when it opens: {outside}"
    covered = frontend.covered(page, on_screen)
    hidden = {n.label: covered[n.id] for n in nodes if n.id in covered}
    assert not hidden, f"{name}: nodes partly under the frontend's own panels when it opens: {hidden}"

    notes = [n for n in nodes if n.type in NOTE_TYPES]
    assert notes, f"{name}: no read-me note"
    for n in notes:
        text = frontend.note_text(page, n.id)
        assert text is not None and text.shown, f"{name}: {n.label} shows no text box"
        assert not text.clipped, (
            f"{name}: {n.label} cuts its text off ({text.scroll_height} px of text in {text.client_height} px)"
        )
        assert not text.lines_wrap, (
            f"{name}: {n.label} wraps lines (widest {text.widest_line:.0f} px, {text.text_width:.0f} px wide)"
        )

    t5_nodes = [n for n in nodes if n.type == "T5Linearize"]
    assert t5_nodes, f"{name}: no T5 Linearize node"
    for n in t5_nodes:
        options = frontend.combo_options(page, n.id, "weights")
        assert options is not None and T5_WEIGHTS in options, (
            f"{name}: {n.label}'s weights list {options} does not offer {T5_WEIGHTS} from models/t5_linearize/"
        )

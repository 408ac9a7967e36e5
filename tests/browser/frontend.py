"""ComfyUI's own frontend in headless Chromium, driven through Selenium and Debian's chromium-driver:
open a workflow file the way a user does, then read what the frontend made of it (its live graph,
view, widgets and error overlay).

Selenium is always given the driver's path, so Selenium Manager never looks for or downloads one.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.wait import WebDriverWait

BROWSER_NAMES = ("chromium", "chromium-browser")
DRIVER_NAME = "chromedriver"
WINDOW_SIZE = (1600, 1000)  # a laptop-sized window; the page gets what the browser's own bars leave
# How long to keep watching for an error overlay once a workflow is open. The frontend shows it
# while it loads the graph (by the first poll that sees the new graph), so this is a wide margin.
SETTLE_S = 1.0

# The hidden <input type=file> that the frontend's Open command (menu File > Open, Ctrl+O) clicks.
# send_keys on a file input sets its files and fires `change`, so the file goes through the same
# handler (app.handleFile) as one the user picks; more reliable than a synthetic drop event (no
# forged DataTransfer, no drop-target geometry).
OPEN_FILE_INPUT = "#comfy-file-input"
# Where the frontend reports problems found on loading a workflow (missing nodes, missing models),
# e.g. "Missing node: <type>" with a "View details" button; it is not in the DOM when there are none.
ERROR_OVERLAY = '[data-testid="error-overlay"]'

_READY_JS = """
const w = window.app?.extensionManager?.workflow;
return Boolean(window.LiteGraph && window.app?.graph && window.app?.canvas && w?.activeWorkflow);
"""

_ACTIVE_WORKFLOW_JS = """
const w = window.app.extensionManager.workflow.activeWorkflow;
return [w?.filename ?? null, window.app.graph.nodes.length];
"""

_TWO_FRAMES_JS = """
const done = arguments[arguments.length - 1];
requestAnimationFrame(() => requestAnimationFrame(() => done(true)));
"""

_NODES_JS = """
return window.app.graph.nodes.map((n) => {
  const content = n.computeSize();
  return {
    id: n.id, type: n.type, title: n.title,
    registered: n.type in LiteGraph.registered_node_types,
    pos: [n.pos[0], n.pos[1]], size: [n.size[0], n.size[1]], content: [content[0], content[1]],
    outputs: (n.outputs ?? []).map((o) => o.type),
  };
});
"""

_VIEW_JS = """
const c = window.app.canvas, r = c.canvas.getBoundingClientRect();
return {scale: c.ds.scale, offset: [c.ds.offset[0], c.ds.offset[1]], canvas: [r.left, r.top, r.right, r.bottom],
        low_quality: Boolean(c.low_quality)};
"""

# For each node's on-screen box, which element a click at each point of a grid over the box (edges
# included, 1 px in) would reach. Points that reach the graph canvas or one of the graph's DOM widgets
# (text boxes) show the graph; anything else is frontend chrome on top of it (side bar, tabs,
# toolbars, minimap, panels), named by the nearest test id or label of it or its ancestors.
_COVERED_JS = """
const [boxes, steps] = arguments;
const canvas = window.app.canvas.canvas;
const widgets = window.app.graph.nodes.flatMap((n) => (n.widgets ?? []).map((w) => w.element).filter(Boolean));
const isGraph = (el) => el === canvas || widgets.some((w) => w.parentElement.contains(el));
const describe = (el) => {
  if (el === null) return 'nothing (outside the window)';
  const named = el.closest('[data-testid], [aria-label]');
  return named ? named.getAttribute('data-testid') ?? named.getAttribute('aria-label') : el.tagName.toLowerCase();
};
const covered = {};
for (const [id, [left, top, right, bottom]] of Object.entries(boxes)) {
  for (let i = 0; i < steps && !(id in covered); i++) {
    for (let j = 0; j < steps && !(id in covered); j++) {
      const x = left + 1 + (right - left - 2) * i / (steps - 1), y = top + 1 + (bottom - top - 2) * j / (steps - 1);
      const el = document.elementFromPoint(x, y);
      if (el === null || !isGraph(el)) covered[id] = `${describe(el)} at (${Math.round(x)}, ${Math.round(y)})`;
    }
  }
}
return covered;
"""

_COMBO_JS = """
const [id, name] = arguments;
const widget = window.app.graph.getNodeById(id)?.widgets?.find((w) => w.name === name);
return widget ? [...(widget.options?.values ?? [])] : null;
"""

# A note's text box: the width of its widest line in the box's own font, the width the box has for
# text, and whether all of its lines fit in its height (no scrolling needed).
_NOTE_TEXT_JS = """
const node = window.app.graph.getNodeById(arguments[0]);
const el = (node.widgets ?? []).map((w) => w.element).find(Boolean);
if (!el) return null;
const style = getComputedStyle(el);
const ctx = document.createElement('canvas').getContext('2d');
ctx.font = style.font;
const text = el.value ?? el.innerText;
return {
  shown: el.getClientRects().length > 0 && style.visibility !== 'hidden',
  widest_line: Math.max(...text.split('\\n').map((line) => ctx.measureText(line).width)),
  text_width: el.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight),
  scroll_height: el.scrollHeight, client_height: el.clientHeight,
};
"""


@dataclass(frozen=True)
class Chromium:
    """Paths of the Chromium browser and its WebDriver."""

    browser: str
    driver: str


def find_chromium() -> Chromium | None:
    """Chromium and chromium-driver from PATH, or None when either is not installed."""
    browser = next(filter(None, map(shutil.which, BROWSER_NAMES)), None)
    driver = shutil.which(DRIVER_NAME)
    return Chromium(browser, driver) if browser and driver else None


def launch(chromium: Chromium, profile_dir: Path) -> WebDriver:
    """Headless Chromium with a fresh profile in `profile_dir` and nothing that calls out."""
    options = webdriver.ChromeOptions()
    options.binary_location = chromium.browser
    for argument in (
        "--headless=new",
        "--no-sandbox",  # the tests may run as root (CI containers)
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile_dir}",
        f"--window-size={WINDOW_SIZE[0]},{WINDOW_SIZE[1]}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(chromium.driver), options=options)


def open_frontend(driver: WebDriver, url: str, *, timeout: float = 60.0) -> None:
    """Load the frontend and wait until its app, canvas and first workflow tab exist.

    Raises:
        TimeoutException: the frontend did not come up within `timeout` seconds.
    """
    driver.get(url)
    WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: d.execute_script(_READY_JS))


def open_workflow(driver: WebDriver, path: Path, node_count: int, *, timeout: float = 30.0) -> None:
    """Open a workflow file as a user does (File > Open), wait until its tab is active with all of its
    nodes and has been drawn, then wait `SETTLE_S` for anything the frontend reports on loading it.

    Raises:
        TimeoutException: the workflow did not become the active one within `timeout` seconds.
    """
    driver.find_element(By.CSS_SELECTOR, OPEN_FILE_INPUT).send_keys(str(path.resolve()))
    expected = [path.stem, node_count]
    try:
        WebDriverWait(driver, timeout, poll_frequency=0.05).until(
            lambda d: d.execute_script(_ACTIVE_WORKFLOW_JS) == expected
        )
    except TimeoutException as error:
        seen = driver.execute_script(_ACTIVE_WORKFLOW_JS)
        raise TimeoutException(
            f"{path.name} did not open within {timeout:.0f} s: active workflow and node count {seen}, "
            f"expected {expected}; error overlay: {error_overlay(driver)!r}"
        ) from error
    driver.execute_async_script(_TWO_FRAMES_JS)
    time.sleep(SETTLE_S)


def error_overlay(driver: WebDriver) -> str | None:
    """The text of the frontend's error overlay, or None when it is not shown."""
    shown = [el.text for el in driver.find_elements(By.CSS_SELECTOR, ERROR_OVERLAY) if el.is_displayed()]
    return "\n".join(shown) if shown else None


def script_errors(driver: WebDriver) -> list[str]:
    """The errors the page's scripts threw or logged since the last call.

    Failed requests are left out: on every start the frontend probes for optional user files
    (user.css, saved workflows) and asks the internet for release notes and node packs, and these
    machines have loopback networking only.
    """
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and entry["source"] != "network"
    ]


@dataclass(frozen=True)
class Box:
    """An axis-aligned rectangle: left < right, top < bottom."""

    left: float
    top: float
    right: float
    bottom: float

    def overlaps(self, other: Box) -> bool:
        """Whether the two share any area (sharing an edge is not overlapping)."""
        return min(self.right, other.right) > max(self.left, other.left) and min(self.bottom, other.bottom) > max(
            self.top, other.top
        )

    def inside(self, other: Box) -> bool:
        return (
            self.left >= other.left
            and self.top >= other.top
            and self.right <= other.right
            and self.bottom <= other.bottom
        )

    def as_list(self) -> list[float]:
        return [self.left, self.top, self.right, self.bottom]


@dataclass(frozen=True)
class LiveNode:
    """A node of the frontend's live graph, after the frontend has configured and sized it."""

    id: int | str  # as the frontend holds it (0.33's gives strings for a workflow's integer ids)
    type: str
    title: str
    registered: bool
    box: Box  # graph units, title bar included
    content_fits: bool  # its size holds what its slots and widgets need (computeSize)
    outputs: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"node {self.id} {self.title!r} ({self.type})"


def live_nodes(driver: WebDriver) -> list[LiveNode]:
    """The active graph's nodes.

    A node's box is what the canvas draws for it: from `pos` (the top left of its body) up by
    `LiteGraph.NODE_TITLE_HEIGHT` for the title bar, and its size grown to what its widgets need
    (`computeSize()`), since widgets that do not fit are drawn past a node's saved size.
    """
    title = driver.execute_script("return LiteGraph.NODE_TITLE_HEIGHT")
    nodes = []
    for n in driver.execute_script(_NODES_JS):
        (x, y), size, content = n["pos"], n["size"], n["content"]
        width, height = max(size[0], content[0]), max(size[1], content[1])
        nodes.append(
            LiveNode(
                id=n["id"],
                type=n["type"],
                title=n["title"],
                registered=n["registered"],
                box=Box(x, y - title, x + width, y + height),
                content_fits=size[0] >= content[0] and size[1] >= content[1],
                outputs=tuple(n["outputs"]),
            )
        )
    return nodes


@dataclass(frozen=True)
class View:
    """The canvas's view of the graph: screen = (graph + offset) * scale, plus the canvas's page position."""

    scale: float
    offset: tuple[float, float]
    canvas: Box  # CSS pixels of the page
    low_quality: bool  # zoomed out so far that the frontend stops drawing node text

    def to_screen(self, box: Box) -> Box:
        def x(value: float) -> float:
            return (value + self.offset[0]) * self.scale + self.canvas.left

        def y(value: float) -> float:
            return (value + self.offset[1]) * self.scale + self.canvas.top

        return Box(x(box.left), y(box.top), x(box.right), y(box.bottom))


def view(driver: WebDriver) -> View:
    v = driver.execute_script(_VIEW_JS)
    return View(v["scale"], tuple(v["offset"]), Box(*v["canvas"]), v["low_quality"])


def covered(driver: WebDriver, screen_boxes: dict[int | str, Box], *, steps: int = 7) -> dict[int | str, str]:
    """Nodes whose on-screen box is partly under frontend chrome or outside the window, with what covers
    them; sampled on a `steps` x `steps` grid over each box, its edges included. Keyed as `screen_boxes`
    is: the script sees every key as a string, and a caller's int or str id must find its entry."""
    keys = {str(key): key for key in screen_boxes}
    found = driver.execute_script(_COVERED_JS, {str(k): b.as_list() for k, b in screen_boxes.items()}, steps)
    return {keys[i]: what for i, what in found.items()}


def combo_options(driver: WebDriver, node_id: int, widget: str) -> list[str] | None:
    """The choices a node's combo widget offers, or None when the node has no such widget."""
    return driver.execute_script(_COMBO_JS, node_id, widget)


@dataclass(frozen=True)
class NoteText:
    """How a note's text sits in its text box (CSS pixels of the unscaled box)."""

    shown: bool
    widest_line: float
    text_width: float
    scroll_height: int
    client_height: int

    @property
    def lines_wrap(self) -> bool:
        return self.widest_line > self.text_width

    @property
    def clipped(self) -> bool:
        return self.scroll_height > self.client_height


def note_text(driver: WebDriver, node_id: int) -> NoteText | None:
    """The text layout of a note node's text box, or None when it has none."""
    found = driver.execute_script(_NOTE_TEXT_JS, node_id)
    return NoteText(**found) if found else None

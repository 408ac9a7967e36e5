"""What the Comfy Registry and pip read from `pyproject.toml` is complete and agrees with the repository:
the license file, the project's addresses, `[tool.comfy]` and its icon, a semver version.

ComfyUI's own parser reads the same file in the last test here and in tests/nodes/test_linearize_node.py.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
# The heading of each license's standard text, by the SPDX id `[project] license` gives.
LICENSE_HEADINGS = {"Apache-2.0": ("Apache License", "Version 2.0, January 2004")}
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
# The registry's node id: letters, digits, "-", "_", "."; no two special characters in a row; starts with a letter.
REGISTRY_NAME = re.compile(r"^[A-Za-z](?:[A-Za-z0-9]|[-_.](?=[A-Za-z0-9]))*$")
ICON_SUFFIXES = (".svg", ".png", ".jpg", ".jpeg", ".gif")
ICON_MAX_PX = (800, 400)


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_license_file_is_the_license_pyproject_names(pyproject):
    name = pyproject["project"]["license"]["text"]
    assert name in LICENSE_HEADINGS, f"no standard text known for license {name!r}"
    path = ROOT / "LICENSE"
    assert path.is_file(), "LICENSE is missing"
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert tuple(lines[:2]) == LICENSE_HEADINGS[name], f"LICENSE starts {lines[:2]}, not the {name} text"
    assert not any("[yyyy]" in line for line in lines), "LICENSE's copyright line still has its placeholder"


def test_the_version_is_semver(pyproject):
    version = pyproject["project"]["version"]
    assert SEMVER.match(version), f"version {version!r} is not MAJOR.MINOR.PATCH"


def test_the_name_is_a_valid_registry_node_id(pyproject):
    name = pyproject["project"]["name"]
    assert len(name) < 100 and REGISTRY_NAME.match(name), f"{name!r} is not a valid Comfy Registry node id"


def test_the_project_urls_name_the_repository_its_issues_and_docs(pyproject):
    urls = pyproject["project"].get("urls", {})
    assert {"Repository", "Issues", "Documentation"} <= set(urls), f"[project.urls] has only {sorted(urls)}"
    repository = urls["Repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repository), repository
    assert urls["Issues"] == f"{repository}/issues"
    assert urls["Documentation"].startswith(f"{repository}/")


def test_tool_comfy_is_complete(pyproject):
    comfy = pyproject["tool"]["comfy"]
    for key in ("PublisherId", "DisplayName", "Icon", "requires-comfyui"):
        assert comfy.get(key), f"[tool.comfy] has no {key}"
    assert comfy["DisplayName"] == "T5 Linearize"
    missing = [path for path in comfy.get("includes", []) if not (ROOT / path).exists()]
    assert not missing, f"[tool.comfy] includes paths that do not exist: {missing}"


def test_the_icon_is_a_file_of_this_repository_served_raw(pyproject):
    """The registry fetches the icon by URL: it must be this repository's file on its main branch."""
    owner_name = pyproject["project"]["urls"]["Repository"].removeprefix("https://github.com/")
    raw = f"https://raw.githubusercontent.com/{owner_name}/main/"
    icon = pyproject["tool"]["comfy"]["Icon"]
    assert icon.startswith(raw), f"Icon {icon!r} is not under {raw}"
    path = ROOT / icon.removeprefix(raw)
    assert path.is_file(), f"Icon {icon!r} names {path.relative_to(ROOT)}, which is not in the repository"
    assert path.suffix in ICON_SUFFIXES, f"the registry takes {ICON_SUFFIXES} icons, not {path.suffix}"
    if path.suffix == ".svg":
        svg = ET.parse(path).getroot()
        size = (float(svg.get("width", "0")), float(svg.get("height", "0")))
        assert 0 < size[0] <= ICON_MAX_PX[0] and 0 < size[1] <= ICON_MAX_PX[1], (
            f"{path.name} is {size}, the registry takes at most {ICON_MAX_PX} px"
        )


def test_comfyui_reads_the_urls_and_icon(comfy, pyproject):
    """ComfyUI's own parser of the registry metadata (comfy_config) finds the same addresses and icon."""
    from comfy_config import config_parser

    config = config_parser.extract_node_configuration(str(ROOT))
    assert config is not None, "pyproject.toml could not be parsed by ComfyUI"
    urls = pyproject["project"]["urls"]
    parsed = config.project.urls
    assert (parsed.repository, parsed.issues, parsed.documentation) == (
        urls["Repository"],
        urls["Issues"],
        urls["Documentation"],
    )
    assert config.tool_comfy.icon == pyproject["tool"]["comfy"]["Icon"]
    assert config.project.license.text == pyproject["project"]["license"]["text"]

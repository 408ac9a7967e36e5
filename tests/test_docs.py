"""The docs say what the code does: every page passes the docs checker (`python -m tools.docs_check`),
the checker itself catches each kind of stale statement, `benchmarks/README.md` is what
`python -m benchmarks.report` generates from the results, the README keeps CI's test commands, and
the tracked files cite only what a clone holds."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tools.docs_check import DOC_FILES, ROOT, check_markdown, source_corpus


@pytest.fixture(scope="module")
def corpus() -> str:
    return source_corpus()


@pytest.mark.parametrize("name", DOC_FILES)
def test_doc_names_only_what_exists(name, corpus):
    doc = ROOT / name
    assert check_markdown(doc.read_text(encoding="utf-8"), doc, corpus=corpus) == []


def test_benchmarks_readme_is_generated_from_the_results():
    command = [sys.executable, "-m", "benchmarks.report", "--check"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:] + "run `python -m benchmarks.report` and commit the result"


def test_readme_keeps_the_ci_test_commands():
    """CI (`.ci/run`) follows these lines of the README's Tests section."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    for command in (
        "pip install torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0",
        "grep -vE '^(torch|torchvision|torchaudio)([<>=~ ]|$)' ~/comfy/0.33.0/requirements.txt > comfy-req.txt",
        "pip install -r comfy-req.txt",
        'pip install -e ".[test]"',
        "COMFYUI_PATH=~/comfy/0.33.0 python -m pytest",
        "grep -vE '^(torch|torchvision|torchaudio)([<>=~ ]|$)' ~/comfy/0.3.64/requirements.txt > floor-req.txt",
        "pip install -r floor-req.txt",
        "COMFYUI_PATH=~/comfy/0.3.64 python -m pytest -m comfyui",
    ):
        assert command in lines


OUTSIDE_FILE = re.compile(r"\b(?:DESIGN|STYLE)\.md\b|\bresearch notes\b|(?<![\w/.-])research/")
"""A document the project keeps outside the repository: its design and style pages, its research notes."""
TRACKER_NUMBER = re.compile(r"\b(?:issue|stop) #?\d+", re.IGNORECASE)
"""A work item's number ("issue 12", "stop 3"): history, which belongs in commit messages, not in code."""
NOT_SCANNED = ("tests/test_docs.py",)
"""This file: its examples name what the scan forbids."""


def citation_problems(text: str, name: str) -> list[str]:
    """`name:line: ...` for each citation a clone cannot follow. A reference to a file outside the
    repository fails in any tracked source, page or config (generated pages included); an issue or stop
    number fails in Python files only, since in prose "issue" and "stop" are also plain words."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        found = OUTSIDE_FILE.findall(line) + (TRACKER_NUMBER.findall(line) if name.endswith(".py") else [])
        problems += [f"{name}:{number}: {match!r}" for match in found]
    return problems


def test_tracked_files_cite_only_what_the_repository_holds():
    names = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    problems = [
        problem
        for name in names
        if name not in NOT_SCANNED and (ROOT / name).is_file()
        for problem in citation_problems((ROOT / name).read_text(encoding="utf-8"), name)
    ]
    assert not problems, "cite a page of docs/ instead; history goes in commit messages:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "name"),
    [
        pytest.param("# the math (DESIGN.md section 2)", "t5core/x.py", id="design-in-code"),
        pytest.param("See DESIGN.md, section 3.", "docs/x.md", id="design-in-docs"),
        pytest.param('"""Forms follow STYLE.md."""', "tools/x.py", id="style"),
        pytest.param("# measured in the research notes", "t5core/x.py", id="research-notes"),
        pytest.param("# `research/kernels.md` section 2.3", "t5core/x.py", id="research-path"),
        pytest.param("# one chunk with its text (issue 20)", "t5core/x.py", id="issue"),
        pytest.param('"""Issue #12\'s goals."""', "benchmarks/x.py", id="issue-hash"),
        pytest.param("# kept from stop 3", "tests/x.py", id="stop"),
    ],
)
def test_citation_check_flags_what_a_clone_cannot_follow(text, name):
    assert len(citation_problems(text, name)) == 1


@pytest.mark.parametrize(
    ("text", "name"),
    [
        pytest.param('# see docs/method.md, "The inner step in closed form"', "t5core/x.py", id="docs-page"),
        pytest.param("# stop at step 3; an issue with 2 heads", "t5core/x.py", id="plain-words"),
        pytest.param("Known issue 2 of the list: stop 3 steps early.", "docs/x.md", id="prose"),
        pytest.param("# docs/research/ would be ours", "t5core/x.py", id="repo-path"),
    ],
)
def test_citation_check_passes_what_a_clone_holds(text, name):
    assert citation_problems(text, name) == []


def _problems(markdown: str, corpus: str) -> list[str]:
    return check_markdown(markdown, ROOT / "README.md", corpus=corpus)


def test_checker_passes_true_statements(corpus):
    markdown = (
        "Use `--optim.inherited_lr_mult` (default 1.0) and `--model.trainable` defaults to `all`; "
        "`--checkpoint.resume auto`, the default. See `t5core/ttt.py`, [kernels](t5kernels/README.md#which-gpus), "
        "`T5_BACKEND` and `t5kernels.launch.LaunchSettings`.\n\n"
        "```bash\nCOMFYUI_PATH=x python -m benchmarks.report --check\npython trainer/run.py --config a.toml "
        "--model.base b\nbash benchmarks/gpu_check.sh\n```\n"
    )
    assert _problems(markdown, corpus) == []


@pytest.mark.parametrize(
    "markdown",
    [
        pytest.param("Set `--optim.inherited_lr_mult` (default 0.1).", id="parenthesis"),
        pytest.param("`--model.trainable` defaults to `attention`.", id="defaults-to"),
        pytest.param("`--model.trainable t5` trains the T5 parameters; `attention` (default) more.", id="value"),
        pytest.param("| flag | default |\n|---|---|\n| `--optim.inherited_lr_mult` | `0.1` |\n", id="table"),
    ],
)
def test_checker_flags_a_stale_default(markdown, corpus):
    problems = _problems(markdown, corpus)
    assert len(problems) == 1 and "the docs say the default is" in problems[0], problems


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        pytest.param("See `t5core/no_such_file.py`.", "does not exist", id="path"),
        pytest.param("See [the page](docs/no_such_page.md).", "does not exist", id="link"),
        pytest.param("See [the page](docs/method.md#no-such-heading).", "no heading with anchor", id="anchor"),
        pytest.param("Pass `--model.no_such_option 3`.", "unknown trainer flag --model.no_such_option", id="flag"),
        pytest.param("    python benchmarks/bench_toy_speed.py --no-such-flag", "unknown flag", id="script-flag"),
        pytest.param("Run `python -m trainer.no_such_module`.", "no such module", id="module"),
        pytest.param("Run `python benchmarks/no_such.py`.", "no such file", id="script"),
        pytest.param("Run `bash benchmarks/no_such.sh`.", "no such file", id="bash"),
        pytest.param("Set `T5_NO_SUCH_VARIABLE`.", "appears nowhere", id="env"),
        pytest.param("Use `t5kernels.NoSuchThing(...)`.", "has no attribute", id="api"),
    ],
)
def test_checker_flags_what_does_not_exist(markdown, expected, corpus):
    problems = _problems(markdown, corpus)
    assert problems and all(expected in problem or "does not exist" in problem for problem in problems), problems

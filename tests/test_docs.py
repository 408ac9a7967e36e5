"""The docs say what the code does: every page passes the docs checker (`python -m tools.docs_check`),
the checker itself catches each kind of stale statement, `benchmarks/README.md` is what
`python -m benchmarks.report` generates from the results, and the README keeps CI's test commands."""

from __future__ import annotations

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

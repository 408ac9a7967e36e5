"""The docs say what the code does: check that every name the docs give exists.

    python -m tools.docs_check                    # README.md, docs/*.md, t5kernels/ and benchmarks/ READMEs
    python -m tools.docs_check docs/training.md   # one page

Every trainer flag (`--section.field`), repository path, command (`python -m X`, `python path.py`,
`bash path`), script flag, environment variable, dotted API name (`t5core.x.y`) and link anchor named
in a page must exist, and a trainer default stated as "(default X)", "defaults to X", "`--s.f X`, the
default", "`X` (default)" after a flag, or in a table column headed "default", must equal the default
in `trainer/config.py`. Prints one line per problem and exits 1 when there is any;
`tests/test_docs.py` runs it on every page.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import re
import sys
import typing
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig

__all__ = ["DOC_FILES", "ROOT", "check_markdown", "main", "source_corpus", "trainer_defaults"]

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = (
    "README.md",
    *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")),
    "t5kernels/README.md",
    "benchmarks/README.md",
)
# Top-level entries of the repository: a backticked token starting with one of these is a path to check.
REPO_ENTRIES = (
    "t5core",
    "t5kernels",
    "nodes",
    "trainer",
    "sd3_testbed",
    "experiments",
    "benchmarks",
    "tools",
    "testing",
    "tests",
    "workflows",
)
REPO_ENTRIES += ("docs", ".ci")
REPO_FILES = ("README.md", "pyproject.toml", "__init__.py")
PACKAGES = ("t5core", "t5kernels", "trainer", "sd3_testbed", "experiments", "benchmarks", "tools")
SOURCE_GLOBS = (
    "t5core/**/*.py",
    "t5kernels/**/*.py",
    "nodes/**/*.py",
    "trainer/**/*.py",
    "sd3_testbed/**/*.py",
    "experiments/**/*.py",
    "benchmarks/**/*.py",
)
SOURCE_GLOBS += ("tools/*.py", "benchmarks/*.sh", "testing/*.py", "tests/**/*.py", ".ci/run", "pyproject.toml")
NOT_IN_CORPUS = ("tools/docs_check.py", "tests/test_docs.py")
"""This checker and its tests: they name flags, variables and files that do not exist on purpose."""

FLAG = re.compile(r"--([a-z_]+)\.([a-z_]+)\b")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?$(.*?)^```", re.MULTILINE | re.DOTALL)
INDENTED = re.compile(r"^(?: {4}|\t)(\S.*)$", re.MULTILINE)
COMMAND = re.compile(r"\b(?:python3?|torchrun)\s+(?:-m\s+([\w.]+)|(?:--\S+\s+)*([\w./-]+\.py))([^\n#]*)")
BASH = re.compile(r"\bbash\s+([\w./-]+\.sh)")
SCRIPT_FLAG = re.compile(r"(?<![\w.])--([a-z][a-z0-9-]*)(?![\w.])")
ENV_ASSIGN = re.compile(r"(?:^|\s)([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)=", re.MULTILINE)
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
API_NAME = re.compile(rf"^((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
DEFAULT_FORMS = (
    re.compile(r"`--(\w+)\.(\w+)`\s*\((?:the )?default:?\s+`?([^`),]+?)`?\)"),
    re.compile(r"`--(\w+)\.(\w+)`,?\s+defaults to\s+`?([^`\s,;)]+?)`?[\s,.;)]"),
    re.compile(r"`--(\w+)\.(\w+) ([^`]+)`,?\s+\(?the default\b"),
)
VALUE_MARKED_DEFAULT = re.compile(r"`([^`]+)`\s+\((?:the )?default\b")


def trainer_defaults() -> dict[str, Any]:
    """`section.field` -> default of every trainer setting."""
    defaults = TrainConfig()
    return {
        f"{section}.{item.name}": getattr(getattr(defaults, section), item.name)
        for section in TrainConfig.sections()
        for item in dataclasses.fields(typing.get_type_hints(TrainConfig)[section])
    }


def _same_value(text: str, default: Any) -> bool:
    text = text.strip().strip("`'\"")
    if isinstance(default, bool):
        return text.lower() == str(default).lower()
    if default is None:
        return text.lower() == "none"
    if isinstance(default, int | float):
        try:
            return float(text) == float(default)
        except ValueError:
            return False
    return text == str(default)


def _code_texts(text: str) -> list[str]:
    """Inline code spans, fenced blocks and indented code, each a string (backslash continuations joined)."""
    blocks = [block.replace("\\\n", " ") for block in FENCE.findall(text)]
    outside = FENCE.sub("", text)
    return blocks + INDENTED.findall(outside) + CODE_SPAN.findall(outside)


def source_corpus() -> str:
    """All code and scripts of the repository as one text, where environment variable names are looked up."""
    skip = {(ROOT / name).resolve() for name in NOT_IN_CORPUS}
    files = {path for pattern in SOURCE_GLOBS for path in ROOT.glob(pattern) if path.resolve() not in skip}
    return "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in sorted(files))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def _check_path(token: str, base: Path) -> str | None:
    target, _, anchor = token.partition("#")
    path = (base / target).resolve() if target else None
    if path is not None and not path.exists():
        return f"path {token!r} does not exist"
    if anchor and path is not None and path.suffix == ".md" and anchor not in _anchors(path):
        return f"link {token!r}: {path.name} has no heading with anchor #{anchor}"
    return None


def _is_repo_path(token: str) -> bool:
    if any(mark in token for mark in "<>{}*$") or "..." in token:
        return False
    return token in REPO_FILES or token.split("/")[0] in REPO_ENTRIES and "/" in token


def _module_file(module: str) -> Path | None:
    """The source file of a project module named on a `python -m` line, or None if not a project module."""
    base = ROOT / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def _check_command(module: str | None, script: str | None, args: str, valid_flags: set[str]) -> list[str]:
    if module is not None:
        source = _module_file(module)
        if source is None:
            if module.split(".")[0] in (*PACKAGES, "tests", "nodes") or importlib.util.find_spec(module) is None:
                return [f"command `python -m {module}`: no such module"]
            return []
    else:
        source = ROOT / script
        if not source.is_file():
            return [f"command `python {script}`: no such file"]
    text = source.read_text(encoding="utf-8")
    problems = []
    for flag in SCRIPT_FLAG.findall(args):
        known = f"--{flag}" in valid_flags if source == ROOT / "trainer/run.py" else f'"--{flag}"' in text
        if not known and flag != "help":
            problems.append(f"command `{module or script}`: unknown flag --{flag}")
    return problems


def _check_api(name: str) -> str | None:
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                return f"`{name}`: {'.'.join(parts[:split])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"`{name}`: cannot import {parts[0]}"


def _check_defaults(text: str, defaults: dict[str, Any]) -> list[str]:
    problems = []

    def compare(flag: str, value: str) -> None:
        if flag in defaults and not _same_value(value, defaults[flag]):
            problems.append(
                f"--{flag}: the docs say the default is {value!r}, trainer/config.py has {defaults[flag]!r}"
            )

    for form in DEFAULT_FORMS:
        for section, name, value in form.findall(text):
            compare(f"{section}.{name}", value)
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        for match in VALUE_MARKED_DEFAULT.finditer(sentence):
            flags = FLAG.findall(sentence[: match.start()])
            if flags and not match.group(1).startswith("--"):
                compare(".".join(flags[-1]), match.group(1))
    header: list[str] | None = None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            column = next((i for i, title in enumerate(header) if "default" in title.lower()), None)
            flag = re.fullmatch(r"`--(\w+\.\w+)`", cells[0])
            if column is not None and flag and column < len(cells):
                compare(flag.group(1), cells[column])
    return problems


def check_markdown(text: str, doc: Path, *, corpus: str | None = None) -> list[str]:
    """Every problem in one markdown text.

    Args:
        text (`str`): the markdown.
        doc (`Path`): where it lives, for relative links and its own anchors.
        corpus (`str`, *optional*): `source_corpus()`, passed in to check many pages at the cost of one.

    Returns:
        One message per problem, naming the stale or unknown thing.
    """
    defaults = trainer_defaults()
    valid_flags = {f"--{flag}" for flag in defaults} | {"--config"}
    corpus = source_corpus() if corpus is None else corpus
    problems = [f"unknown trainer flag --{s}.{n}" for s, n in FLAG.findall(text) if f"{s}.{n}" not in defaults]
    problems += _check_defaults(text, defaults)
    for target in LINK.findall(text):
        if target.startswith("#"):
            problems.append(None if target[1:] in _anchors(doc) else f"link {target!r}: no such heading in {doc.name}")
        elif not re.match(r"^[a-z]+:", target):
            problems.append(_check_path(target, doc.parent))
    codes = _code_texts(text)
    for code in codes:
        for token in re.split(r"[\s=(),;]+", code):
            token = token.rstrip(":.,`")
            if _is_repo_path(token):
                problems.append(_check_path(token, ROOT))
        for module, script, args in COMMAND.findall(code):
            problems += _check_command(module or None, script or None, args, valid_flags)
        problems += [
            f"command `bash {path}`: no such file" for path in BASH.findall(code) if not (ROOT / path).is_file()
        ]
        names = set(ENV_ASSIGN.findall(code)) | ({code} if ENV_NAME.match(code) else set())
        problems += [
            f"environment variable / name `{name}` appears nowhere in the code" for name in names if name not in corpus
        ]
        api = API_NAME.match(code)
        if api and not _is_repo_path(code):
            problems.append(_check_api(api.group(1)))
    return sorted({problem for problem in problems if problem})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", nargs="*", default=list(DOC_FILES), help="markdown files (default: every page)")
    args = parser.parse_args(argv)
    corpus = source_corpus()
    problems = 0
    for name in args.docs:
        doc = Path(name).resolve()
        for problem in check_markdown(doc.read_text(encoding="utf-8"), doc, corpus=corpus):
            print(f"{name}: {problem}")
            problems += 1
    print(f"{len(args.docs)} pages checked, {problems} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The project's packages import each other without cycles, and the trainer's config is a leaf.

The graph is static: every `import` statement of every tracked module of t5core, t5kernels,
trainer, sd3_testbed, nodes and experiments, read with `ast`, wherever it stands (module level, inside a function, under
`if TYPE_CHECKING:`). A deferred or type-only import hides a cycle from the interpreter, not from
the design: the two modules still depend on each other.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("t5core", "t5kernels", "trainer", "sd3_testbed", "nodes", "experiments")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for the tracked `.py` files of PACKAGES."""
    listed = subprocess.run(
        ["git", "ls-files", "--", *(f"{package}/*.py" for package in PACKAGES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    modules = {}
    for name in listed:
        parts = Path(name).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = ROOT / name
    return modules


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `module` imports: `from a.b import c` names `a.b.c` when that is a module, else `a.b`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != module)
    return found


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {module: _imported(module, path, known) for module, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]`, or None when the graph is acyclic (depth-first, sorted order)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_reads_relative_and_submodule_imports():
    graph = import_graph()
    assert "trainer.config" in graph["trainer.cli"]
    assert "t5core.ttt" in graph["t5core.ttt_chunked"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_trainer_config_imports_no_trainer_module():
    assert not {name for name in import_graph()["trainer.config"] if name.startswith("trainer")}


def test_nothing_shipped_imports_experiments():
    """The toy experiments sit on top: the library, trainer, toy and nodes never depend on them."""
    arrows = {
        (module, target)
        for module, targets in import_graph().items()
        if not module.startswith("experiments")
        for target in targets
        if target.startswith("experiments")
    }
    assert not arrows

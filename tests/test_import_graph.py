"""Dependencies point one way (README.md, Architecture): communication -> parallel building blocks -> engine -> CLI.

Walks every module's imports with ``ast`` (nothing is imported, so no torch): no module may
reach itself through imports, and no parallel building block may import the engine, the
executors, the trainer, the models or the CLI (a building block that knows the model or the
engine is no longer a building block).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "trainmesh"
LOWER = ("comm", "data_parallel", "tensor_parallel", "pipeline_parallel")
UPPER = ("engine", "executor", "trainer", "models", "cli")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, is_package: bool) -> set[str]:
    """Every trainmesh module or name ``path`` imports (relative imports resolved)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {t for t in out if t == "trainmesh" or t.startswith("trainmesh.")}


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], set[str]]:
    """({module: the trainmesh modules it imports}, the package names)."""
    files = {_module_name(f, root): f for f in root.rglob("*.py")}
    packages = {name for name, f in files.items() if f.name == "__init__.py"}
    graph = {name: {t for t in _imports(f, name, name in packages) if t in files and t != name}
             for name, f in files.items()}
    return graph, packages


def cycles(graph: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """Import cycles between modules. A package's ``__init__`` re-exports its own modules, so
    an import of the package itself is not followed (``from ..comm import Comm`` reaches
    ``comm.ops``, which does not import the engine, whatever ``comm/__init__`` imports)."""
    edges = {m: sorted(d - packages) for m, d in graph.items()}
    found: list[list[str]] = []
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in edges.get(m, ()):
            if state.get(d) == 1:
                found.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a parallel building block up to the engine, executors, trainer, models, CLI."""
    low = tuple(f"trainmesh.{p}" for p in LOWER)
    high = tuple(f"trainmesh.{p}" for p in UPPER)
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if _under(m, low)
                  for d in deps if _under(d, high))


@pytest.mark.timeout(30)
def test_no_import_cycle():
    graph, packages = import_graph()
    assert len(graph) > 40, "the walk found too few modules: is ROOT right?"
    found = cycles(graph, packages)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.timeout(30)
def test_building_blocks_never_import_upward():
    graph, _ = import_graph()
    found = upward(graph)
    assert not found, "upward imports (a building block importing the layer above):\n" + "\n".join(found)


@pytest.mark.timeout(30)
def test_the_checks_see_what_they_look_for(tmp_path):
    """The walk itself: a planted cycle and a planted upward import are both found."""
    pkg = tmp_path / "trainmesh"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "comm" / "__init__.py").write_text("from .ops import Comm\n")
    (pkg / "comm" / "ops.py").write_text("from ..engine import Engine\n")
    (pkg / "engine.py").write_text("from . import checkpoint\n")
    (pkg / "checkpoint.py").write_text("from .engine import Engine\nfrom .comm import Comm\n")
    graph, packages = import_graph(pkg)
    assert ["trainmesh.checkpoint", "trainmesh.engine", "trainmesh.checkpoint"] in cycles(graph, packages)
    assert upward(graph) == ["trainmesh.comm.ops -> trainmesh.engine"]

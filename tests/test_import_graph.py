"""Dependencies point one way: core -> comm -> observe -> models, data, the strategies'
declarations -> config -> the parallel building blocks and the planner -> checkpoint -> engine
-> run -> cli.

Walks every module's imports with ``ast`` (nothing is imported, so no torch; imports under
``if TYPE_CHECKING:`` are annotations, not dependencies, and are skipped): no module may reach
itself through imports, and no package may import a package of a higher layer.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "trainmesh"
# Package -> layer. A package may import packages of its own layer or below, never above.
LAYERS = {
    "core": 0, "comm": 1, "observe": 2, "models": 3, "data": 3, "strategies": 3, "config": 4,
    "data_parallel": 5, "tensor_parallel": 5, "pipeline_parallel": 5, "parameter_server": 5,
    "planner": 5, "context_parallel": 5, "expert_parallel": 5, "fault_tolerance": 5, "checkpoint": 6, "engine": 7, "run": 8, "cli": 9,
}
FACES = {"trainmesh", "trainmesh.__main__", "trainmesh.testing"}   # the package's public face


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return skip


def _imports(path: Path, name: str, is_package: bool) -> set[str]:
    """Every trainmesh module or name ``path`` imports at run time (relative imports resolved)."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
    an import of the package itself is not followed."""
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


def _package(name: str) -> str:
    return name.split(".")[1] if name.count(".") else name


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a package to a package of a higher layer."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if m not in FACES
                  for d in deps if d not in FACES
                  and LAYERS[_package(d)] > LAYERS[_package(m)])


@pytest.mark.timeout(30)
def test_every_package_has_a_layer_and_a_docstring():
    graph, packages = import_graph()
    assert len(graph) > 40, "the walk found too few modules: is ROOT right?"
    top = {p.split(".")[1] for p in packages if p.count(".") == 1}
    assert top == set(LAYERS), f"packages without a layer or layers without a package: {top ^ set(LAYERS)}"
    for p in sorted(top):
        doc = ast.get_docstring(ast.parse((ROOT / p / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"trainmesh.{p}: the docstring says what lives there and what it imports"
    loose = sorted(f.name for f in ROOT.glob("*.py"))
    assert len(loose) <= 6, f"loose modules at the top of the package: {loose}"


@pytest.mark.timeout(30)
def test_no_import_cycle():
    graph, packages = import_graph()
    found = cycles(graph, packages)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.timeout(30)
def test_packages_never_import_upward():
    graph, _ = import_graph()
    found = upward(graph)
    assert not found, "upward imports (a package importing a layer above its own):\n" + "\n".join(found)


@pytest.mark.timeout(30)
def test_the_checks_see_what_they_look_for(tmp_path):
    """The walk itself: a planted cycle and a planted upward import are found; a type-only one is not."""
    pkg = tmp_path / "trainmesh"
    for p in ("comm", "engine", "checkpoint"):
        (pkg / p).mkdir(parents=True)
        (pkg / p / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "comm" / "ops.py").write_text("from ..engine.engine import Engine\n")
    (pkg / "comm" / "hints.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine.engine import Engine\n")
    (pkg / "engine" / "engine.py").write_text("from ..checkpoint import sharded\n")
    (pkg / "checkpoint" / "sharded.py").write_text("from ..engine.engine import Engine\n")
    graph, packages = import_graph(pkg)
    assert ["trainmesh.checkpoint.sharded", "trainmesh.engine.engine",
            "trainmesh.checkpoint.sharded"] in cycles(graph, packages)
    assert upward(graph) == ["trainmesh.checkpoint.sharded -> trainmesh.engine.engine",
                             "trainmesh.comm.ops -> trainmesh.engine.engine"]

"""Packages only point down (docs/architecture.md): no import cycle between morion's packages, read from
the source with `ast` so that every import counts, those inside functions too. In particular the engine
builds on speculative decoding and the model runner, and neither of them imports the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import morion

MORION = Path(morion.__file__).parent


def package_imports(root: Path) -> dict[str, set[str]]:
    """For each package (or top-level module) under `root`, the others it imports."""
    units = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("__")}
    units |= {p.stem for p in root.glob("*.py")}
    graph: dict[str, set[str]] = {unit: set() for unit in units}
    for path in root.rglob("*.py"):
        unit = path.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from morion import x`: x is a unit when it names one (else an attribute of the root).
                names = [f"morion.{a.name}" for a in node.names] if node.module == "morion" else [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "morion" and len(parts) > 1 and parts[1] in units and parts[1] != unit:
                    graph[unit].add(parts[1])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            cycle = visit(target, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"engine": {"spec"}, "spec": {"runner"}, "runner": set()}) is None
    assert find_cycle({"engine": {"spec"}, "spec": {"runner", "engine"}}) == ["engine", "spec", "engine"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_the_reader_sees_imports_inside_functions(tmp_path):
    (tmp_path / "spec").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "spec" / "late.py").write_text("def f():\n    from morion.engine.engine import Engine\n")
    (tmp_path / "engine" / "engine.py").write_text("import morion.spec.late\n")
    graph = package_imports(tmp_path)
    assert graph == {"spec": {"engine"}, "engine": {"spec"}}
    assert find_cycle(graph) == ["engine", "spec", "engine"]


def test_morion_packages_form_no_cycle():
    graph = package_imports(MORION)
    assert find_cycle(graph) is None


def test_speculation_and_the_runner_never_import_the_engine():
    graph = package_imports(MORION)
    assert {"runner", "spec"} <= graph["engine"]
    assert "engine" not in graph["spec"] and "engine" not in graph["runner"]
    assert "spec" not in graph["runner"]

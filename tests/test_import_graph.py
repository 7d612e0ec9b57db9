"""The package's import graph, function-level imports included, has no cycle."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parents[1] / "src" / "onnx_kvcache"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _absolute(node: ast.ImportFrom, package: str) -> str | None:
    """The package module an import names (``from ..cli import x`` resolved), None for another."""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])
    return node.module if node.module and node.module.startswith("onnx_kvcache") else None


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, at any depth of its code."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (target := _absolute(node, package)) is not None:
                for alias in node.names:  # `from onnx_kvcache import file_io` names a module
                    candidate = f"{target}.{alias.name}"
                    found.add(candidate if candidate in modules else target)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("onnx_kvcache")}
        # importing a.b.c runs package a.b first, unless the importer is inside a.b already
        found |= {p for m in found for p in _parents(m) if not name.startswith(p + ".")}
        graph[name] = {m for m in found if m in modules and m != name and m != "onnx_kvcache"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_is_acyclic():
    graph = import_graph()
    assert len(graph) > 20
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_module_imports_the_package_root():
    """Modules import each other, never ``onnx_kvcache`` itself (which imports them all)."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "onnx_kvcache":
                modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
                names = [a.name for a in node.names if f"onnx_kvcache.{a.name}" not in modules]
                assert not names, f"{path.name} imports {names} from the package root"


def test_a_relative_import_is_an_arrow_too(tmp_path):
    tree = ast.parse("from ..cli import commands\nfrom . import sites\n")
    first, second = (n for n in tree.body if isinstance(n, ast.ImportFrom))
    assert _absolute(first, "onnx_kvcache.cache") == "onnx_kvcache.cli"
    assert _absolute(second, "onnx_kvcache.cache") == "onnx_kvcache.cache"

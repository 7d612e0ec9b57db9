"""The package's import graph, function-level imports included, has no cycle."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parents[1] / "src" / "onnx_kvcache"


def _module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _absolute(node: ast.ImportFrom, package: str, root: str = "onnx_kvcache") -> str | None:
    """The package module an import names (``from ..cli import x`` resolved), None for another."""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])
    return node.module if node.module and (node.module + ".").startswith(root + ".") else None


def _lazy_imports(tree: ast.Module, name: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """What a module imports by name at run time (``importlib.import_module``, ``find_spec``,
    ``_lazy.lazy_getattr``): a lazy ``__getattr__``'s table, every package module named as a
    string in the module; an ``f"{__name__}.{attr}"`` import, each of the module's own submodules."""
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute | ast.Name)
        and getattr(n.func, "attr", getattr(n.func, "id", ""))
        in ("import_module", "find_spec", "__import__", "lazy_getattr")
    ]
    if not calls:
        return set()
    found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in modules}
    by_own_name = any(
        isinstance(part, ast.FormattedValue)
        and isinstance(part.value, ast.Name)
        and part.value.id == "__name__"
        for call in calls
        for arg in call.args[:1]
        if isinstance(arg, ast.JoinedStr)
        for part in arg.values
    )
    if by_own_name:
        found |= {m for m in modules if m.rpartition(".")[0] == name}
    return found


def import_graph(package_dir: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, at any depth of its code, lazy loading
    by name included. The package root is a module too: ``from onnx_kvcache import convert_model``
    (or ``import onnx_kvcache``) is an arrow to it, and its ``__getattr__`` one to every module
    of its table."""
    root = package_dir.name
    modules = {_module_name(p, package_dir): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (target := _absolute(node, package, root)) is not None:
                for alias in node.names:  # `from onnx_kvcache import file_io` names a module
                    candidate = f"{target}.{alias.name}"
                    found.add(candidate if candidate in modules else target)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if (a.name + ".").startswith(root + ".")}
        found |= _lazy_imports(tree, name, modules)
        # importing a.b.c runs package a.b first, unless the importer is inside a.b already
        found |= {p for m in found for p in _parents(m) if not name.startswith(p + ".")}
        graph[name] = {m for m in found if m in modules and m != name}
    for name, path in modules.items():  # a package handing out its own modules' names lazily
        if path.name == "__init__.py" and name != root:
            for inner in _own_lazy_modules(ast.parse(path.read_text(encoding="utf-8")), name, root):
                if inner in graph:  # importing it runs the package, whose names are its: both ways
                    graph[inner].add(name)
    return graph


def _own_lazy_modules(tree: ast.Module, package: str, root: str) -> set[str]:
    """The package's own modules its ``__getattr__`` imports (the root's, the whole API, aside)."""
    found = set()
    for function in tree.body:
        if isinstance(function, ast.FunctionDef) and function.name == "__getattr__":
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (target := _absolute(node, package, root)):
                    found |= {target, *(f"{target}.{a.name}" for a in node.names)}
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
    return {m for m in found if m.startswith(package + ".")}


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


def test_the_root_loads_its_names_lazily_and_that_is_an_arrow_too():
    """The root's ``__getattr__`` imports the module of each name it exports, and its submodules."""
    import onnx_kvcache

    graph = import_graph()
    assert set(onnx_kvcache._EXPORTS) | {"onnx_kvcache.cli", "onnx_kvcache._version"} <= graph["onnx_kvcache"]


def _write(folder: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    return folder / "pkg"


_LAZY_ROOT = """
_TABLE = {"X": "pkg.b"}
def __getattr__(name):
    import importlib
    return getattr(importlib.import_module(_TABLE[name]), name)
"""
_LAZY_BY_THE_HELPER = """
from onnx_kvcache._lazy import lazy_getattr
__getattr__ = lazy_getattr(__name__, {"pkg.b": ("X",)})
"""
_LAZY_SUBPACKAGE = """
def __getattr__(name):
    from pkg.sub.impl import main
    return main
"""


def test_a_cycle_through_a_lazy_getattr_is_found(tmp_path):
    """A module that takes a name from a package whose ``__getattr__`` imports, by a table (its
    own code or ``_lazy.lazy_getattr``) or directly, its own module (``onnx_kvcache.cli.main``
    was: cli -> cli.commands -> cli)."""
    for name, root in (("root", _LAZY_ROOT), ("helper", _LAZY_BY_THE_HELPER)):  # model_io, runtime, files
        package = _write(
            tmp_path / name,
            {
                "pkg/__init__.py": root,
                "pkg/a.py": "def use():\n    from pkg import X\n",
                "pkg/b.py": "import pkg.a\n",
            },
        )
        cycle = find_cycle(import_graph(package))
        assert cycle is not None and "pkg" in cycle and "pkg.b" in cycle, (name, cycle)
    through_a_subpackage = _write(
        tmp_path / "sub",
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": _LAZY_SUBPACKAGE,
            "pkg/sub/impl.py": "def main():\n    pass\n",
        },
    )
    assert find_cycle(import_graph(through_a_subpackage)) == ["pkg.sub", "pkg.sub.impl", "pkg.sub"]
    without = _write(
        tmp_path / "none", {"pkg/__init__.py": _LAZY_ROOT, "pkg/a.py": "", "pkg/b.py": "import pkg.a\n"}
    )
    assert find_cycle(import_graph(without)) is None


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

"""No underscore name crosses a folder: a module imports another folder's names by their public path.

A folder (``model_io``, ``runtime``, ``files``, ...) keeps its private modules and names to itself;
what other folders use it exports under a public name (``from onnx_kvcache.model_io import
create_session``, imported from its private module on first use). Imports within a folder are
free, and the package's own top-level modules (``errors``, ``_signals``, ``_version``, ...) are
the bottom every folder shares (tests/test_layering.py).
"""

from __future__ import annotations

import ast

from test_import_graph import PACKAGE, _absolute, _module_name

#: (importer, imported dotted name) crossings still allowed, and why; it only shrinks.
ALLOWED = {
    ("onnx_kvcache.__main__", "onnx_kvcache.cli._entry.main"): (
        "`python -m onnx_kvcache` runs the console script's entry point (pyproject's cli._entry:main)"
    ),
}


def _folder(dotted: str) -> str | None:
    """The top-level folder (subpackage) a dotted name lies in; None for the package's own modules."""
    parts = dotted.split(".")
    if len(parts) < 2 or not (PACKAGE / parts[1] / "__init__.py").is_file():
        return None
    return parts[1]


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


def crossings(source: str, importer: str, is_package: bool = False) -> list[str]:
    """The underscore names ``importer`` (whose code is ``source``) imports from another folder."""
    package = importer if is_package else importer.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (target := _absolute(node, package)) is not None:
            dotted = [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            dotted = [a.name for a in node.names if a.name.startswith("onnx_kvcache")]
        else:
            continue
        for name in dotted:
            folder = _folder(name)
            if folder is not None and folder != _folder(importer) and _private(name):
                found.append(name)
    return found


def _all_crossings() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        source = path.read_text(encoding="utf-8")
        found |= {(importer, name) for name in crossings(source, importer, path.name == "__init__.py")}
    return found


def test_no_module_imports_an_underscore_name_from_another_folder():
    found = _all_crossings()
    assert sorted(found - set(ALLOWED)) == [], "export it from its folder under a public name"
    assert sorted(set(ALLOWED) - found) == [], "fixed: remove it from ALLOWED"


def test_a_crossing_is_found():
    source = (
        "from onnx_kvcache.model_io._atomic import format_bytes\nfrom onnx_kvcache.model_io import _marker\n"
    )
    assert crossings(source, "onnx_kvcache.scales.data") == [
        "onnx_kvcache.model_io._atomic.format_bytes",
        "onnx_kvcache.model_io._marker",
    ]
    lazy = "def f():\n    import onnx_kvcache.runtime._memory\n"
    assert crossings(lazy, "onnx_kvcache.calibrate.calibration") == ["onnx_kvcache.runtime._memory"]
    relative = "from ..files._export_folder import read_export_config\n"
    assert crossings(relative, "onnx_kvcache.runtime.runner") == [
        "onnx_kvcache.files._export_folder.read_export_config"
    ]


def test_within_a_folder_and_from_the_packages_own_modules_is_free():
    source = "from onnx_kvcache.model_io import _atomic\nfrom onnx_kvcache._signals import Interrupted\n"
    assert crossings(source, "onnx_kvcache.model_io._outputs") == []
    assert crossings("from onnx_kvcache._version import __version__\n", "onnx_kvcache.cli.commands") == []
    assert (
        crossings("from onnx_kvcache.model_io import create_session\n", "onnx_kvcache.runtime.doctor") == []
    )


def test_every_public_name_a_folder_exports_resolves():
    import importlib

    for folder in sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")):
        package = importlib.import_module(f"onnx_kvcache.{folder}")
        for name in getattr(package, "__all__", ()):
            assert hasattr(package, name), f"onnx_kvcache.{folder}.{name}"

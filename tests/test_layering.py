"""The package tree is layered: a module imports only modules of its own folder or below.

model_io < cache < models < capabilities < scales < passes < pipeline < files < runtime <
calibrate < cli. Each folder (package) has one rank, and no module of it is an exception: the
file primitives every layer reads a model or writes a file with (safe reads and writes, the
converted marker, genai folders) and the onnxruntime import are ``model_io``, the bottom folder;
only the package's own top-level modules (errors, the version, signals) sit below it. Every
import counts, a function's lazy one too (tests/test_import_graph.py).
"""

from __future__ import annotations

import pytest

from test_import_graph import PACKAGE, import_graph

#: the package's top-level modules, below every folder
BOTTOM = ("errors", "_version", "_signals", "_enums", "_gc", "_lazy")
#: folder (package) -> rank, bottom first: a folder imports only folders ranked below it
FOLDERS = (
    "model_io",  # reading models and genai folders, the marker, safe reads and writes, onnxruntime
    "cache",  # what a cache is: formats, operators, sites, layout, validation
    "models",  # the bundled decoder (the demo's, the docs' examples)
    "capabilities",  # who can run what: rows, gating, the device
    "scales",  # scale values and files, the token data
    "passes",  # the graph rewrites
    "pipeline",  # choosing and running the passes
    "files",  # converting model files and folders
    "runtime",  # running models: sessions, the runner, evaluation, doctor
    "calibrate",  # measuring scales by running the model
    "cli",  # the command
)
LAYERS = {
    **{f"onnx_kvcache.{m}": 0 for m in BOTTOM},
    **{f"onnx_kvcache.{f}": rank for rank, f in enumerate(FOLDERS, start=1)},
    "onnx_kvcache.__main__": len(FOLDERS) + 1,  # `python -m onnx_kvcache`: runs the command
}


def layer(module: str) -> int:
    if module == "onnx_kvcache":  # the package root, the API: its __getattr__ loads every layer
        return len(FOLDERS) + 2
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    assert len(prefixes) <= 1, f"{module}: nested ranks {prefixes}"
    assert prefixes, f"{module} has no layer: add its folder to FOLDERS"
    return LAYERS[prefixes[0]]


def _empty_package(module: str, graph: dict[str, set[str]]) -> bool:
    """A package whose ``__init__`` imports nothing: importing its modules runs no other layer."""
    folder = PACKAGE.parent.joinpath(*module.split("."))
    return (folder / "__init__.py").is_file() and not graph.get(module)


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in sorted(graph.items())
        if a != "onnx_kvcache"
        for b in sorted(targets)
        if layer(b) > layer(a) and not b.startswith(a + ".") and not _empty_package(b, graph)
    ]


def test_no_import_runs_upward():
    graph = import_graph()
    assert upward_arrows(graph) == []


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("onnx_kvcache.cache.formats", "onnx_kvcache.passes.kv_cache_quantization"),
        ("onnx_kvcache.passes.kv_cache_quantization", "onnx_kvcache.files.conversion"),
        ("onnx_kvcache.files.conversion", "onnx_kvcache.cli.commands"),
        ("onnx_kvcache.cli.commands", "onnx_kvcache"),  # `from onnx_kvcache import convert_model`
    ],
)
def test_an_upward_arrow_is_found(importer, imported):
    graph = import_graph()
    graph[importer] = {*graph[importer], imported}
    assert upward_arrows(graph) == [
        f"{importer} (layer {layer(importer)}) imports {imported} (layer {layer(imported)})"
    ]


def test_every_module_has_a_layer():
    for module in import_graph():
        if module != "onnx_kvcache":
            layer(module)


def test_each_folder_has_one_rank():
    """LAYERS names folders (packages) and the bottom modules only: no module is an exception."""
    for name in LAYERS:
        path = PACKAGE.parent.joinpath(*name.split("."))
        if name.removeprefix("onnx_kvcache.") in (*BOTTOM, "__main__"):
            assert path.with_suffix(".py").is_file(), name
        else:
            assert (path / "__init__.py").is_file(), f"{name} is not a folder"
    assert sorted(f.name for f in PACKAGE.iterdir() if (f / "__init__.py").is_file()) == sorted(FOLDERS)


def test_a_lazy_import_is_an_arrow_too():
    """An import inside a function runs when it is called: it counts as one at the top."""
    graph = import_graph()
    # cli._calibrate (the calibrate command) imports calibration in the command's function only
    assert "onnx_kvcache.calibrate.calibration" in graph["onnx_kvcache.cli._calibrate"]
    assert "onnx_kvcache.runtime.doctor" in graph["onnx_kvcache.cli.commands"]


def test_the_folders_form_an_order_with_no_cycle():
    """Read from the imports, folder to folder: each arrow runs from a higher rank to a lower."""
    graph = import_graph()
    arrows = {
        (a.split(".")[1], b.split(".")[1])
        for a, targets in graph.items()
        for b in targets
        if a.count(".") >= 1 and b.count(".") >= 1 and a.split(".")[1] != b.split(".")[1]
    }
    both_ways = sorted((a, b) for a, b in arrows if (b, a) in arrows and a < b)
    assert both_ways == []
    assert all(layer(f"onnx_kvcache.{a}") > layer(f"onnx_kvcache.{b}") for a, b in arrows), sorted(
        (a, b) for a, b in arrows if layer(f"onnx_kvcache.{a}") <= layer(f"onnx_kvcache.{b}")
    )


def test_the_test_folders_mirror_the_tree():
    """tests/<folder>/ holds the tests of src/onnx_kvcache/<folder>/ (calibration's sat in
    tests/scales, the safe writes' in tests/files); builders/ and data/ are the tests' own."""
    import pathlib

    tests = pathlib.Path(__file__).parent
    folders = {
        path.parent.relative_to(tests).as_posix()
        for path in tests.rglob("*.py")
        if path.parent != tests and path.relative_to(tests).parts[0] not in ("builders", "data")
    }
    assert folders and sorted(f for f in folders if not (PACKAGE / f / "__init__.py").is_file()) == []

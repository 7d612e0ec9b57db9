"""The package tree is layered: a module imports only modules of its own layer or below.

cache < capabilities < scale files < passes < pipeline < files / runtime / models < what runs
the model to measure it (calibration, doctor) < cli. The file primitives every layer reads a
model or writes a file with (safe reads and writes, the converted marker, genai folders) and
the onnxruntime import sit at the bottom with the errors.
"""

from __future__ import annotations

import pytest

from test_import_graph import PACKAGE, import_graph

#: package (or module) -> layer; the longest matching prefix wins
LAYERS = {
    "onnx_kvcache.errors": 0,
    "onnx_kvcache._version": 0,
    "onnx_kvcache._signals": 0,
    "onnx_kvcache._moved": 0,
    "onnx_kvcache._enums": 0,
    "onnx_kvcache._gc": 0,
    "onnx_kvcache.files._atomic": 0,
    "onnx_kvcache.files._inputs": 0,
    "onnx_kvcache.files._outputs": 0,
    "onnx_kvcache.files._marker": 0,
    "onnx_kvcache.files.genai_folder": 0,
    "onnx_kvcache.files.reading": 0,
    "onnx_kvcache.runtime._sessions": 0,
    "onnx_kvcache.cache": 1,
    "onnx_kvcache.capabilities": 2,
    "onnx_kvcache.scales": 3,
    "onnx_kvcache.passes": 4,
    "onnx_kvcache.pipeline": 5,
    "onnx_kvcache.files": 6,
    "onnx_kvcache.runtime": 6,
    "onnx_kvcache.models": 6,
    "onnx_kvcache.scales.calibration": 7,
    "onnx_kvcache.capabilities.doctor": 7,
    "onnx_kvcache.cli": 8,
    "onnx_kvcache.__main__": 8,
}


def layer(module: str) -> int:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    assert prefixes, f"{module} has no layer: add its package to LAYERS"
    return LAYERS[max(prefixes, key=len)]


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

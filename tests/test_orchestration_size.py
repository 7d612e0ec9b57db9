"""The orchestration layer is small functions: at most 40 lines and 8 parameters each.

A public entry point whose signature is the documented API may take more parameters, but it
delegates in at most 15 lines. The layer: the pipeline, file conversion, calibration,
evaluation, the runner and the command (the passes, proofs and tables are not orchestration).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parents[1] / "src" / "onnx_kvcache"
ORCHESTRATION = [
    "pipeline",
    "files/conversion.py",
    "files/_conversion_plan.py",
    "files/_conversion_write.py",
    "files/_conversion_terms.py",
    "calibrate/calibration.py",
    "calibrate/_settings.py",
    "calibrate/_sampler.py",
    "calibrate/_stats.py",
    "calibrate/_methods.py",
    "calibrate/_reservoir.py",
    "calibrate/_rope_envelope.py",
    "calibrate/_attention_weights.py",
    "runtime",
    "cli",
]
#: documented entry points: any signature, body of at most 15 lines
ENTRY_POINTS = {
    "convert_model",
    "optimize_model",
    "calibrate_kv_cache",
    "evaluate_kv_cache",
    "KvCacheRunner.__init__",
}
MAX_LINES, MAX_PARAMETERS, MAX_ENTRY_LINES = 40, 8, 15


def _files() -> list[pathlib.Path]:
    found = []
    for part in ORCHESTRATION:
        path = PACKAGE / part
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return found


def _functions(tree: ast.Module):
    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")

    yield from visit(tree, "")


def _size(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
    body = node.body[1:] if ast.get_docstring(node) else node.body
    lines = (body[-1].end_lineno - body[0].lineno + 1) if body else 0
    args = node.args
    parameters = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    parameters = [a for a in parameters if a.arg not in ("self", "cls")]
    return lines, len(parameters) + bool(args.vararg) + bool(args.kwarg)


def oversized() -> list[str]:
    found = []
    for path in _files():
        for name, node in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            lines, parameters = _size(node)
            where = f"{path.relative_to(PACKAGE)}:{node.lineno} {name}"
            if name in ENTRY_POINTS:
                if lines > MAX_ENTRY_LINES:
                    found.append(f"{where}: entry point of {lines} lines (delegate in {MAX_ENTRY_LINES})")
            elif lines > MAX_LINES or parameters > MAX_PARAMETERS:
                found.append(f"{where}: {lines} lines, {parameters} parameters")
    return found


def test_orchestration_functions_are_small():
    assert oversized() == []


def test_the_rule_sees_a_long_function(tmp_path, monkeypatch):
    module = tmp_path / "pipeline"
    module.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    (module / "long.py").write_text(
        f"def f(a, b):\n{body}\n\n\ndef convert_model(a, b, c, d, e, f, g, h, i):\n    return a\n"
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    monkeypatch.setattr(__import__(__name__), "ORCHESTRATION", ["pipeline"])
    assert oversized() == [f"pipeline/long.py:1 f: {MAX_LINES + 1} lines, 2 parameters"]


@pytest.mark.parametrize("parameters", [MAX_PARAMETERS, MAX_PARAMETERS + 1])
def test_the_rule_counts_parameters(tmp_path, monkeypatch, parameters):
    (tmp_path / "pipeline").mkdir()
    names = ", ".join(f"p{i}" for i in range(parameters))
    (tmp_path / "pipeline" / "wide.py").write_text(f"def g({names}):\n    return 1\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    monkeypatch.setattr(__import__(__name__), "ORCHESTRATION", ["pipeline"])
    expected = (
        [] if parameters <= MAX_PARAMETERS else [f"pipeline/wide.py:1 g: 1 lines, {parameters} parameters"]
    )
    assert oversized() == expected

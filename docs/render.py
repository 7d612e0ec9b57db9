"""Regenerate the generated parts of docs/ from the code: python docs/render.py"""

from __future__ import annotations

import importlib.util
import pathlib
import re

from onnx_kvcache.capabilities.table import render_capability_table

BEGIN, END = "<!-- BEGIN capability-table -->", "<!-- END capability-table -->"
PRODUCERS_BEGIN, PRODUCERS_END = "<!-- BEGIN producer-table -->", "<!-- END producer-table -->"
_PRODUCERS = pathlib.Path(__file__).parents[1] / "tests" / "passes" / "fusion" / "producers.py"


def _replace(text: str, begin: str, end: str, table: str) -> str:
    block = f"{begin}\n{table}\n{end}"
    return re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)


def render(text: str) -> str:
    return _replace(text, BEGIN, END, render_capability_table())


def render_producers(text: str) -> str:
    """docs/exporting.md's support table: the real producers' files and what each becomes
    (tests/passes/fusion/producers.py, which test_producers.py checks against the files)."""
    spec = importlib.util.spec_from_file_location("producers", _PRODUCERS)
    assert spec is not None and spec.loader is not None
    producers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(producers)
    return _replace(text, PRODUCERS_BEGIN, PRODUCERS_END, producers.render_support_table())


if __name__ == "__main__":
    docs = pathlib.Path(__file__).parent
    page = docs / "capabilities.md"
    page.write_text(render(page.read_text()))
    page = docs / "exporting.md"
    page.write_text(render_producers(page.read_text()))

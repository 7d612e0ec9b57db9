"""Regenerate the generated parts of docs/ from the code: python docs/render.py"""

from __future__ import annotations

import pathlib
import re

from onnx_kvcache.capabilities.table import render_capability_table

BEGIN, END = "<!-- BEGIN capability-table -->", "<!-- END capability-table -->"


def render(text: str) -> str:
    block = f"{BEGIN}\n{render_capability_table()}\n{END}"
    return re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), block, text, flags=re.S)


if __name__ == "__main__":
    page = pathlib.Path(__file__).with_name("capabilities.md")
    page.write_text(render(page.read_text()))

"""docs/exporting.md runs: every Python and shell block but the torch export, in order."""

from __future__ import annotations

import json
import pathlib
import re
import shlex

import onnx_ir as ir
import pytest

from onnx_kvcache import build_decoder
from onnx_kvcache.cli import main
from onnx_kvcache.demo_model import byte_level_tokenizer
from onnx_kvcache.exported_decoder import exported_config

PAGE = pathlib.Path(__file__).parent.parent / "docs" / "exporting.md"
BLOCK = re.compile(r"```(python|bash)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str]]:
    return [(kind, code) for kind, code in BLOCK.findall(PAGE.read_text()) if "NOT RUN HERE" not in code]


def test_only_the_export_block_is_skipped():
    every = BLOCK.findall(PAGE.read_text())
    skipped = [code for _, code in every if "NOT RUN HERE" in code]
    assert len(skipped) == 1 and "torch.onnx.export(" in skipped[0] and "opset_version=23" in skipped[0]


def test_the_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ir.save(build_decoder(exported_config("llama", num_layers=2, dtype="float16")), "model.onnx")
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer()))
    for kind, code in blocks():
        if kind == "python":
            exec(compile(code, str(PAGE), "exec"), {})
            continue
        for line in code.strip().splitlines():
            argv = shlex.split(line)
            assert argv[0] == "onnx-kvcache", line
            assert main(argv[1:]) == 0, line
    for name in ("model.fp8.onnx", "model.int8.onnx", "model.int8-cli.onnx", "fp8_scales.json"):
        assert (tmp_path / name).is_file(), name
    fp8 = ir.load("model.fp8.onnx")
    assert {v.dtype for v in fp8.graph.inputs if v.name.startswith("past")} == {ir.DataType.FLOAT8E4M3FN}


@pytest.mark.parametrize("name", ["exporting.md"])
def test_index_links_the_page(name):
    index = (PAGE.parent / "index.md").read_text()
    assert f"]({name})" in index and "passes/attention_fusion.py" in index

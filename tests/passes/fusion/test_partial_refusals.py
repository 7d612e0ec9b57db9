"""A producer's file whose layers fuse but one: the command and the Python functions agree.

The mixed rolling/full exports (transformers 5.x's ``DynamicCache(config=...)`` of Gemma2, Cohere2
and Qwen2 with windows: one layer a rolling window cache, the other a full-length one) fuse, their
window caches' lengths declared apart (``cache.rolling.split_window_lengths``). Declared with one
number of rows for every past instead, they cannot be: every layer fuses but the rolling one.
``convert`` exits 1 and writes nothing, ``convert_model`` returns a result that did not convert,
``optimize_model`` returns the model as it was; each says the rolling-window reason, and
``allow_partial`` converts the fused layer alone in all three.
"""

from __future__ import annotations

import json
import warnings

import onnx_ir as ir
import pytest
from producers import CONVERTS, EXPECTED, entries, model_path

from onnx_kvcache import convert_model, load_model, optimize_model
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import NotConvertedWarning

from conftest import gqa_nodes

MIXED = [e for e in entries() if e["form"].endswith("-rollingcache") and e["family"] != "mistral"]
REASON = "rolling window cache of W - 1 past tokens"


@pytest.fixture(params=MIXED, ids=lambda e: e["path"])
def partial(request, tmp_path):
    """``(file, layers)``: a mixed rolling export, every past declared 2 rows (one number)."""
    entry = request.param
    model = load_model(model_path(entry))
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values"):
            value.shape = ir.Shape([*value.shape[:2], 2, value.shape[3]])
    ir.save(model, tmp_path / "model.onnx")
    return tmp_path / "model.onnx", entry["config"]["layers"]


def _scales(tmp_path, layers: int):
    path = tmp_path / "scales.json"
    path.write_text(
        json.dumps({"scales": {"k_scales": [0.05] * layers, "v_scales": [0.05] * layers}, "qmax": 128})
    )
    return path


def test_the_mixed_rolling_exports_convert_as_exported():
    assert sorted(e["family"] for e in MIXED) == ["cohere2", "gemma2", "gemma2", "qwen2_window"]
    assert {EXPECTED[e["path"]] for e in MIXED} == {CONVERTS}


def test_the_command_and_the_functions_refuse_alike(partial, tmp_path, capsys):
    src, layers = partial
    scales = _scales(tmp_path, layers)
    out = tmp_path / "out.onnx"
    argv = ["convert", str(src), str(out), "--format", "int8", "--scales", str(scales), "--ep", "cpu"]
    assert main(argv) == 1 and not out.exists()
    assert REASON in capsys.readouterr().err
    with pytest.warns(NotConvertedWarning, match=REASON):
        result = convert_model(src, out, format="int8", scales=scales, ep="cpu", progress=False)
    assert not result.converted and not out.exists()
    model = load_model(src)
    before = ir.to_proto(model).SerializeToString()
    with pytest.warns(NotConvertedWarning, match=REASON):
        optimize_model(model, ep="cpu", format="int8", scales=scales)
    assert ir.to_proto(model).SerializeToString() == before  # returned as it was


def test_allow_partial_converts_the_fused_layer_in_all_three(partial, tmp_path, capsys):
    src, layers = partial
    scales = _scales(tmp_path, layers)
    argv = ["convert", str(src), str(tmp_path / "cli.onnx"), "--format", "int8", "--scales", str(scales)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fusion's padding and partial notes
        assert main([*argv, "--ep", "cpu", "--allow-partial"]) == 0
        result = convert_model(
            src,
            tmp_path / "py.onnx",
            format="int8",
            scales=scales,
            ep="cpu",
            allow_partial=True,
            progress=False,
        )
        model = optimize_model(load_model(src), ep="cpu", format="int8", scales=scales, allow_partial=True)
    assert result.converted and result.nodes == 1
    for converted in (load_model(tmp_path / "cli.onnx"), load_model(tmp_path / "py.onnx"), model):
        nodes = gqa_nodes(converted)
        assert len(nodes) == 1 and nodes[0].inputs[3].dtype == ir.DataType.INT8

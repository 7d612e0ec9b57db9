"""``inspect`` of a model whose caches ``convert --storage qdq`` keeps: their bytes per token now
and as int8, and, once converted, the format they are stored in."""

from __future__ import annotations

import json

import qdq_models
from onnx_kvcache import convert_model, inspect_kv_cache
from onnx_kvcache.cli.commands import main


def test_inspect_shows_the_storage_before_and_after(tmp_path, capsys):
    source = qdq_models.ROOT / qdq_models.STATIC[0] / "model.onnx"
    assert main(["inspect", str(source)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].endswith("cache bytes per token 512 now, 128 as int8 (4.00x smaller)")
    scales = tmp_path / "s.json"
    qdq_models.calibrate(qdq_models.load(qdq_models.STATIC[0]), "int8", "per_tensor", 128.0).save(scales)
    assert convert_model(source, tmp_path / "q.onnx", storage="qdq", scales=scales).converted
    assert main(["inspect", str(tmp_path / "q.onnx")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "4 cache(s) stored int8 through QuantizeLinear/DequantizeLinear; cache bytes per token 128"
    )
    assert not any(line.startswith("convert would refuse") for line in lines)  # stored: nothing to refuse


def test_json_and_the_api_report_the_storage_caches(tmp_path, capsys):
    source = qdq_models.ROOT / qdq_models.STATIC[0] / "model.onnx"
    info = inspect_kv_cache(source)
    assert [layer.layer_id for layer in info.layers] == [0, 1] and info.bytes_per_token == 512
    assert {layer.storage for layer in info.layers} == {"qdq"}
    assert main(["inspect", str(source), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["layers"]) == 2 and doc["bytes_per_token"] == 512
    assert (
        doc["preview"]["storage"]["format"] == "int8"
        and doc["preview"]["storage"]["bytes_per_token_after"] == 128
    )
    assert main(["inspect", str(source), "--json", "--ep", "cuda"]) == 0  # no storage row for cuda: refused
    storage = json.loads(capsys.readouterr().out)["preview"]["storage"]
    assert storage["format"] is None and storage["refused"] is not None
    scales = tmp_path / "s.json"
    qdq_models.calibrate(qdq_models.load(qdq_models.STATIC[0]), "int8", "per_tensor", 128.0).save(scales)
    assert convert_model(source, tmp_path / "q.onnx", storage="qdq", scales=scales).converted
    info = inspect_kv_cache(tmp_path / "q.onnx")
    assert info.bytes_per_token == 128 and info.original_bytes_per_token == 512
    assert {layer.dtype for layer in info.layers} == {"INT8"}
    assert main(["inspect", str(tmp_path / "q.onnx"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bytes_per_token"] == 128 and doc["preview"]["storage"]["stored"] == "int8"
    assert "qdq" not in doc["preview"]["refused"]  # not a node the conversion made


def test_json_lists_an_unfused_exports_own_caches_as_the_text_does(capsys):
    source = qdq_models.ROOT / qdq_models.MLA[0] / "model.onnx"
    assert main(["inspect", str(source), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["layers"]) == 2 and doc["bytes_per_token"] > 0

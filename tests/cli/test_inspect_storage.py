"""``inspect`` of a model whose caches ``convert --storage qdq`` keeps: their bytes per token now
and as int8, and, once converted, the format they are stored in."""

from __future__ import annotations

import qdq_models
from onnx_kvcache import convert_model
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
